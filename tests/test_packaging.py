"""An installed BlockLab (a wheel, not this checkout) ships its config and runs from any directory:
train, analyze --init, report and the start-up benchmark need no source tree."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import blocklab
from blocklab.paths import CONF_DIR
from conftest import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from the project, built from a copy so that the checkout gets no build/ folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next((tmp / "dist").glob("blocklab-*.whl"))


def test_wheel_ships_every_config_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"blocklab/conf/{p.relative_to(CONF_DIR).as_posix()}" for p in CONF_DIR.rglob("*.yaml")}
    assert {"blocklab/conf/config.yaml", "blocklab/conf/sweep/pe_copy.yaml", "blocklab/conf/pos/rope.yaml"} <= expected
    assert expected <= names
    assert "blocklab/cli.py" in names and "blocklab/train/__main__.py" in names


def test_wheel_ships_every_template(wheel):
    """Every Jinja2 template the report loads, the HTML report's and the findings pages': a missing one is a
    TemplateNotFound from an installed wheel only, never from a checkout."""
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = Path(blocklab.__file__).resolve().parent / "report" / "templates"
    expected = {f"blocklab/report/templates/{p.name}" for p in templates.iterdir() if p.is_file()}
    assert {"blocklab/report/templates/index.html.j2", "blocklab/report/templates/findings.md.j2",
            "blocklab/report/templates/findings_index.md.j2",
            "blocklab/report/templates/findings_unmeasured.md.j2"} <= expected
    assert expected - names == set()


def test_cli_finds_its_config_through_the_package():
    assert CONF_DIR == Path(blocklab.__file__).resolve().parent / "conf"
    assert (CONF_DIR / "config.yaml").is_file() and (CONF_DIR / "sweep").is_dir()
    # The checkout's conf/ and sweeps/ are links into the package, for the paths users know.
    assert (ROOT / "conf").resolve() == CONF_DIR and (ROOT / "sweeps").resolve() == CONF_DIR / "sweep"


def test_no_module_derives_a_path_from_the_checkout():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "src" / "blocklab").rglob("*.py")
                 if ".parents[" in p.read_text() or '/ "train.py"' in p.read_text()]
    assert offenders == []


@pytest.mark.slow
def test_installed_wheel_trains_analyzes_reports_and_benchmarks_from_anywhere(wheel, tmp_path):
    venv = tmp_path / "venv"
    # System site-packages supply torch and the other dependencies; the wheel itself goes into the venv.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    if sys.prefix != sys.base_prefix:  # pytest itself runs in a venv: its packages are not the system's, so the new
        # venv reaches them through a .pth (after its own site-packages, the wheel's, as the system's would be)
        purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                 capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        import site

        Path(purelib, "_parent_env.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n"
                                                            for d in site.getsitepackages()))
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    # No PYTHONPATH, no user site. The checkout's editable install (a .pth in the system site-packages)
    # still reaches this venv, but after the venv's own site-packages: the wheel must win.
    env = {**os.environ, "PYTHONPATH": "", "PYTHONNOUSERSITE": "1", "WANDB_SILENT": "true"}

    def run(*args, timeout=600):
        proc = subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc

    where = run("-I", "-c", "import blocklab, blocklab.paths; print(blocklab.__file__); print(blocklab.paths.CONF_DIR)")
    package_file, conf_dir = where.stdout.split()
    assert Path(package_file).is_relative_to(venv) and Path(conf_dir).is_relative_to(venv)

    run_dir = cwd / "runs" / "debug"
    # A study block makes the folder a tiny study of one run: --findings renders its page (findings.md.j2).
    run("-I", "-m", "blocklab.train", "trainer=debug", "logger=none", "task.eval_examples=16",
        "study={name:tiny,scale:1,compare:[seed],metrics:[final_train_loss]}", f"hydra.run.dir={run_dir}")
    assert json.loads((run_dir / "results.json").read_text())["status"] == "completed"

    run("-I", "-m", "blocklab.analyze", "--init", "--out", str(cwd / "init"), "model.n_layers=1")
    assert any((cwd / "init").iterdir())

    run("-I", "-m", "blocklab.report", str(cwd / "runs"))
    assert (cwd / "runs" / "report" / "index.html").is_file()

    # The findings pages come from the wheel's own templates (the page, the index, an unmeasured sweep's page);
    # a template the wheel lacks is a TemplateNotFound here.
    findings = cwd / "findings"
    done = run("-I", "-m", "blocklab.report", str(cwd / "runs"), "--findings", str(findings))
    assert "TemplateNotFound" not in done.stderr
    assert {"tiny.jsonl", "tiny.md", "README.md", "causal_mask.md"} <= {p.name for p in findings.iterdir()}
    assert "](tiny.md)" in (findings / "README.md").read_text()
    assert (findings / "causal_mask.md").read_text().startswith("Not measured yet")
    done = run("-I", "-m", "blocklab.report", "--findings", str(findings), "--rerender")
    assert "0 file(s) changed" in done.stdout

    run("-I", "-m", "blocklab.bench", "startup", "--size", "tiny", "--out", str(cwd / "bench.json"))
    assert json.loads((cwd / "bench.json").read_text())["benchmarks"]["startup"]["first_step_s"] > 0
    assert not (cwd / "outputs").exists() or not any((cwd / "outputs").rglob("results.json"))
