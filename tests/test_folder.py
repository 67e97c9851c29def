"""The folder module (src/blocklab/folder.py), the one way in and out of a run or sweep folder: links anywhere below
the root, special files, oversize files, paths that leave the folder, YAML aliases and interpolations are refused in
one line; writes are atomic through new temporaries; and no other module opens a folder's files itself."""
import ast
import os
import time
from pathlib import Path

import pytest

from blocklab import folder
from blocklab.folder import FolderError

SRC = Path(__file__).resolve().parents[1] / "src" / "blocklab"


@pytest.fixture
def root(tmp_path) -> Path:
    run = tmp_path / "run"
    folder.write_json(run, "results.json", {"status": "completed"})
    folder.write_text(run, ".hydra/config.yaml", "seed: 0\n")
    return run


def test_a_round_trip_reads_what_was_written(root):
    assert folder.read_json(root, "results.json") == {"status": "completed"}
    assert folder.read_yaml(root, ".hydra/config.yaml") == {"seed": 0}
    assert sorted(p.name for p in root.iterdir()) == [".hydra", "results.json"]  # no temporary left behind


@pytest.mark.parametrize("where", ["results.json", ".hydra", ".hydra/config.yaml"])
def test_a_link_anywhere_below_the_root_is_refused_for_reading_and_writing(root, tmp_path, where):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.yaml").write_text("precious\n")
    target = root / where
    kept = target.rename(tmp_path / "kept")
    os.symlink(outside if kept.is_dir() else outside / "config.yaml", target)
    name = "results.json" if where == "results.json" else ".hydra/config.yaml"
    with pytest.raises(FolderError, match="is a link"):
        folder.read_bytes(root, name)
    with pytest.raises(FolderError, match="is a link"):
        folder.write_text(root, name, "overwritten\n")
    assert (outside / "config.yaml").read_text() == "precious\n"
    assert sorted(p.name for p in outside.iterdir()) == ["config.yaml"]


def test_the_root_itself_may_be_a_link(root, tmp_path):
    linked = tmp_path / "linked"
    os.symlink(root, linked)
    assert folder.read_json(linked, "results.json") == {"status": "completed"}
    folder.write_json(linked, "results.json", {"status": "failed"})
    assert folder.read_json(root, "results.json") == {"status": "failed"}


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "oversize", "folder"])
def test_a_special_or_oversize_file_is_refused_at_once(root, kind):
    path = root / "results.json"
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "oversize":
        with open(path, "wb") as file:  # sparse: 3 GB on paper, nothing on the disk
            file.truncate(3 * 2**30)
    else:
        path.mkdir()
    start = time.monotonic()
    with pytest.raises(FolderError) as refused:
        folder.read_json(root, "results.json")
    assert time.monotonic() - start < 2
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("recorded", ["/etc/passwd", "../outside.png", "diagnostics/../../x.png"])
def test_a_path_recorded_in_a_file_must_stay_inside(root, recorded):
    assert folder.inside(root, recorded) is None
    with pytest.raises(FolderError, match="outside the folder|leaves the folder"):
        folder.read_bytes(root, recorded)


def test_a_stale_temporary_never_blocks_the_next_write(root):
    (root / ".results.json.stale.tmp").write_text("left by a kill")
    (root / "results.json.tmp").mkdir()  # the old fixed temporary name, as a folder: it no longer matters
    folder.write_json(root, "results.json", {"status": "failed"})
    assert folder.read_json(root, "results.json") == {"status": "failed"}


def test_yaml_aliases_are_refused_before_they_expand():
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]  # 10**7 nodes expanded
    start = time.monotonic()
    with pytest.raises(ValueError, match="alias"):
        folder.parse_yaml("\n".join(levels))
    assert time.monotonic() - start < 1


@pytest.mark.parametrize("text", ["home: ${oc.env:HOME}", "a: ${b}\nb: 1", "deep: {x: [1, '${oc.env:SECRET}']}"])
def test_an_interpolation_is_refused_not_resolved(text, monkeypatch):
    monkeypatch.setenv("SECRET", "hunter2")
    with pytest.raises(ValueError, match="interpolation") as refused:
        folder.parse_yaml(text)
    assert "hunter2" not in str(refused.value) and os.environ["HOME"] not in str(refused.value)


def test_nan_in_json_is_not_json(root):
    (root / "results.json").write_text('{"loss": NaN}')
    with pytest.raises(ValueError):
        folder.read_json(root, "results.json")


def test_the_lock_refuses_a_second_holder_and_a_planted_link(root, tmp_path):
    with folder.lock(root):
        assert folder.is_locked(root)  # flock is per open file: the check's own open sees it held
        with pytest.raises(folder.FolderInUse):
            with folder.lock(root):
                pass
    assert not (root / folder.LOCK_FILE).exists()
    target = tmp_path / "precious"
    target.write_text("precious")
    os.symlink(target, root / folder.LOCK_FILE)
    with pytest.raises(FolderError, match="is a link"):
        with folder.lock(root):
            pass
    assert target.read_text() == "precious"


# Calls that open a file themselves. Only the folder module makes them, but for files no run or sweep folder holds.
OPENERS = {"open", "os.open", "torch.save", "torch.load", "OmegaConf.save", "OmegaConf.load", "np.save", "np.load",
           ".read_text", ".write_text", ".read_bytes", ".write_bytes", ".savefig", ".to_csv"}
ALLOWED = {
    # the packaged config and sweep files, inside the installed package
    ("naming.py", "OmegaConf.load"): "CONF_DIR / config.yaml",
    ("modifications.py", "OmegaConf.load"): "the packaged sweep file",
    ("report/findings_data.py", "OmegaConf.load"): "the packaged sweep file",
    ("report/collect.py", "OmegaConf.load"): "the packaged sweep file",
    # bytes in memory, handed to or taken from the folder module
    ("checkpoint.py", "torch.load"): "the bytes folder.read_bytes read",
    ("train/checkpoint_io.py", "torch.save"): "into a BytesIO that folder.write_bytes writes",
    ("analysis/plots.py", ".savefig"): "a PNG into a BytesIO that folder.write_bytes writes",
    ("report/benches.py", ".savefig"): "a PNG into a BytesIO that the report's Out writes",
    ("report/figures.py", ".savefig"): "a PNG into a BytesIO that the report's Out or folder.write_bytes writes",
    ("report/ladder_page.py", ".savefig"): "a PNG into a BytesIO that its caller writes through blocklab.folder",
    # the one exemption: the report reads benchmark results from outputs/bench or --bench FILE by design
    ("report/benches.py", ".read_text"): "a bench JSON, regular files only, capped",
    # the user's own cache of tokenized corpora and the corpus a package ships (BLOCKLAB_CACHE), not a run folder
    ("tasks/lm.py", ".read_text"): "the corpus cache's meta.json",
    ("tasks/lm.py", ".write_text"): "the corpus cache's meta.json",
    ("tasks/lm.py", "np.save"): "the corpus cache",
    ("tasks/lm.py", "np.load"): "the corpus cache",
    ("tasks/corpus.py", "open"): "a corpus file",
    ("tasks/corpus.py", ".read_text"): "the plays a package ships",
    ("tasks/corpus.py", ".write_text"): "the corpus cache",
    ("hardware.py", ".read_text"): "/proc/cpuinfo",
    # a benchmark's own output (--out or outputs/bench), which the report's bench section reads by design
    ("bench/__main__.py", ".write_text"): "the bench's --out file",
    ("bench/suites.py", "open"): "os.devnull",
    ("bench/attention.py", "os.open"): "os.devnull",
}


def _openers(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            name = func.id
        elif isinstance(func, ast.Attribute):
            receiver = func.value.id if isinstance(func.value, ast.Name) else ""
            if receiver in ("folder", "out"):  # the folder module, or the report's Out, which writes through it
                continue
            name = f"{receiver}.{func.attr}" if f"{receiver}.{func.attr}" in OPENERS else f".{func.attr}"
        else:
            continue
        if name in OPENERS:
            yield name, node.lineno


def test_no_module_but_the_folder_module_opens_files_itself():
    """open, Path.read_text/write_text/read_bytes/write_bytes, torch.save/load, OmegaConf.load/save, savefig: only
    src/blocklab/folder.py calls them, but for the files ALLOWED names (none of a run or sweep folder)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        module = str(path.relative_to(SRC))
        if module == "folder.py":
            continue
        found += [f"{module}:{line} {name}" for name, line in _openers(path) if (module, name) not in ALLOWED]
    assert not found, "open a run or sweep folder's files through blocklab.folder:\n" + "\n".join(found)


def test_a_written_file_has_the_mode_open_would_give_it(root):
    umask = os.umask(0o022)
    os.umask(umask)
    path = folder.write_text(root, "report/index.html", "<p>shared</p>")
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_library_folder_may_hold_its_own_links_but_may_not_be_one(root, tmp_path):
    """W&B keeps wandb/latest-run as a link to its run: the walk leaves W&B's folder to W&B. A link planted as the
    folder itself is still refused."""
    folder.make_dirs(root, "wandb/offline-run-1")
    os.symlink("offline-run-1", root / "wandb" / "latest-run")
    folder.check_tree(root)
    os.symlink(tmp_path, root / "diagnostics")
    with pytest.raises(FolderError, match="is a link"):
        folder.check_tree(root)
