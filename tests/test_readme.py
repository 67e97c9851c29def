"""The README and docs/ stay true: the README is short and holds no dated figure or machine name, every relative
link resolves, every doc links back, and the commands they show work (the cheap ones are run here)."""
import re
import shlex
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
# Docs whose commands must work: the README and the hand-written docs (decisions/ records what was removed, and
# its commands may be gone with it).
COMMAND_DOCS = [README, *(d for d in DOCS if "decisions" not in d.relative_to(ROOT / "docs").parts)]
CONF = str(files("blocklab") / "conf")
MACHINES = re.compile(r"\b(Zen|EPYC|Xeon|AVX\w*|H100|H200|A100|NVIDIA|Intel|AMD|Ryzen|Graviton)\b", re.IGNORECASE)
# Overrides the docs show as mistakes that are refused (README: a misspelt key; running.md: a sweep no job survives).
REFUSED = ("model.dmodel=64", "model.d_model=0")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]+\b")  # NAME, PATH, RUN_DIR, DIR: the reader fills them in


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_the_readme_is_short_and_holds_no_dated_figure_or_machine():
    readme = text(README)
    assert len(readme.splitlines()) <= 250
    assert not re.findall(r"20\d\d-\d\d-\d\d", readme)
    assert not MACHINES.findall(readme), MACHINES.findall(readme)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[`*_\[\]()]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in text(path).splitlines() if re.match(r"#{1,6} ", line)}


def links(path: Path) -> list[str]:
    body = re.sub(r"```.*?```", "", text(path), flags=re.DOTALL)  # code blocks hold no links
    return re.findall(r"\]\(([^)\s]+)\)", body)


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_an_existing_file_and_heading(doc):
    for link in links(doc):
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name}: {link} points at nothing"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{doc.name}: {link}: no heading #{anchor} in {path.name}"


def targets(doc: Path) -> set[Path]:
    return {(doc.parent / link.partition("#")[0]).resolve() for link in links(doc)
            if not link.startswith("#") and not re.match(r"[a-z]+:", link)}


def test_every_doc_links_back_to_the_readme_and_the_readme_reaches_every_doc():
    reached, todo = set(), [README]
    while todo:  # every file the README leads to, link by link (a folder's README.md stands for the folder)
        doc = todo.pop()
        for target in targets(doc):
            target = target / "README.md" if (target / "README.md").exists() else target
            if target.suffix == ".md" and target not in reached:
                reached.add(target)
                todo.append(target)
    for doc in DOCS:
        if "decisions" not in doc.parts:  # reached through the docs/decisions/ folder's link
            assert README in targets(doc), f"{doc} does not link back to the README"
            assert doc in reached, f"the README leads nowhere near {doc}"


def test_the_readme_table_names_every_option_of_each_group():
    """The README's and components.md's group tables list exactly the yaml files of each group."""
    for doc in (README, ROOT / "docs" / "components.md"):
        rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", text(doc), flags=re.MULTILINE)
        # the options before any `;`, without (remarks): `wandb (offline) tensorboard`, `tiny small; arch: ...`
        listed = {group: set(re.findall(r"[a-z_0-9]+", re.sub(r"\(.*?\)", "", options.split(";")[0])))
                  for group, options in rows}
        for group in ("model", "norm", "pos", "act", "ffn", "attn", "init", "task", "optim", "trainer", "logger",
                      "diagnostics", "experiment"):
            on_disk = {p.stem for p in Path(CONF, group).glob("*.yaml")}
            assert listed[group] == on_disk, (doc.name, group, listed[group] ^ on_disk)


def test_the_sweep_table_counts_each_sweeps_jobs():
    """The job counts in the README's sweep table are the sweep files' (Hydra's basic sweeper expands them)."""
    from blocklab.overrides import sweep_jobs

    rows = re.findall(r"^\| (`\w+`(?:, `\w+`)*) \| [^|]+ \| ([\d, ]+(?: each)?) \|$", text(README), flags=re.MULTILINE)
    listed = {}
    for names, jobs in rows:
        names = re.findall(r"`(\w+)`", names)
        counts = [int(n) for n in re.findall(r"\d+", jobs)]
        listed.update(zip(names, counts * len(names) if "each" in jobs else counts, strict=True))
    assert set(listed) == {p.stem for p in Path(CONF, "sweep").glob("*.yaml")}
    assert {name: len(sweep_jobs([f"sweep={name}"])) for name in listed} == listed


def shell_commands(path: Path) -> list[str]:
    """The commands a doc shows: lines of ```bash blocks (with their continuations) and inline `python ...` spans."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text(path), flags=re.DOTALL):
        found += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    body = re.sub(r"```.*?```", "", text(path), flags=re.DOTALL)
    found += [" ".join(span.split()) for span in re.findall(r"`(python (?:train\.py|-m blocklab\.\w+)[^`]*)`", body)]
    # A findings page's Reproduce chains its launches (python ... && python ...): each is a command of its own.
    return [part.strip() for line in found
            for part in (re.split(r" && (?=python )", line) if line.startswith("python ") else [line])]


def all_commands() -> list[tuple[str, str]]:
    return [(str(doc.relative_to(ROOT)), command) for doc in COMMAND_DOCS for command in shell_commands(doc)]


def first_job(overrides: list[str]) -> list[str]:
    """One job of a multirun: the first value of each comma-separated sweep (not inside brackets or quotes)."""
    job = []
    for override in overrides:
        key, _, value = override.partition("=")
        if "," in value and not value.startswith(("[", "'", '"', "glob(")):
            value = value.split(",")[0]
        job.append(f"{key}={value}" if _ else override)
    return job


def train_overrides(command: str) -> list[str] | None:
    """The overrides of a `python train.py` / `python -m blocklab.train` command, without flags, Hydra's own keys
    and placeholders the reader fills in; None for other commands."""
    words = shlex.split(command, comments=True)
    if words[:2] != ["python", "train.py"] and words[:3] != ["python", "-m", "blocklab.train"]:
        return None
    args = words[2:] if words[1] == "train.py" else words[3:]
    kept = [a for a in args if not a.startswith("-") and not a.lstrip("+~").startswith(("hydra.", "hydra/"))
            and not PLACEHOLDER.search(a.partition("=")[2] or a)]
    return first_job(kept)


def test_every_train_command_in_the_docs_composes_and_passes_the_schema():
    """Each `python train.py ...` in the README and docs composes (Hydra's compose API: keys and options exist,
    interpolations resolve) and its values pass the schema; a multirun is checked on its first job."""
    from blocklab import modifications
    from blocklab.schema import schema_errors

    modifications.register(modifications.candidates())  # as a sweep's ${modifications:} does before its jobs compose

    commands = {}  # overrides -> where they are shown (many commands share theirs)
    for doc, command in all_commands():
        if (overrides := train_overrides(command)) is not None:
            commands.setdefault(tuple(overrides), (doc, command))
    assert len(commands) > 40  # the docs show many; an extraction that finds few has broken
    problems = []
    with initialize_config_dir(config_dir=CONF, version_base="1.3", job_name="train"):
        for overrides, (doc, command) in commands.items():
            try:
                config = OmegaConf.to_container(compose("config", [*overrides, "run_dir=unused"]), resolve=True)
                errors = schema_errors(config)
            except Exception as err:  # noqa: BLE001 - every failure is a broken command to report
                errors = [f"{type(err).__name__}: {err}"]
            if any(refused in overrides for refused in REFUSED):  # shown as a mistake: it must still be one
                errors = [] if errors else ["is shown as refused, and is accepted"]
            problems += [f"{doc}: {command}: {error}" for error in errors]
    assert not problems, "\n".join(problems)


def run(args: list[str], cwd: Path = ROOT, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_every_tool_the_docs_show_answers_help():
    modules = {m for _, c in all_commands() for m in re.findall(r"^python -m (blocklab\.\w+)", c)}
    assert {"blocklab.report", "blocklab.generate", "blocklab.analyze", "blocklab.bench"} <= modules
    for module in sorted(modules):
        done = run(["-m", module, "--help"])
        assert done.returncode == 0 and done.stdout.strip() and not done.stderr.strip(), (module, done.stderr[-500:])


def test_the_readmes_help_and_refused_key_commands_answer_as_shown():
    assert "python train.py --help" in text(README)
    done = run(["train.py", "--help"])
    assert done.returncode == 0 and "pos: alibi, fire, learned" in done.stdout
    [line] = [c for c in shell_commands(README) if "model.dmodel=64" in c]
    command, _, shown = line.partition("#")
    done = run(shlex.split(command)[1:])
    assert done.returncode == 2 and done.stderr.strip() == shown.strip()


def test_the_main_commands_are_the_ones_ci_runs():
    """A new user's two commands: install and run the main job, and run the tests."""
    commands = shell_commands(README)
    assert 'pip install -e ".[dev]" && python train.py' in commands
    assert any(c.startswith("pytest ") or c == "pytest" for c in commands)
    assert any(c.startswith("pytest -m slow") for c in commands)
    ci = text(ROOT / ".ci" / "run")
    assert 'pip install -e ".[dev]"' in ci and "pytest" in ci


@pytest.mark.slow  # ~10 s: a 20-step run of the smoke-test command the README's option table shows
def test_the_readmes_smoke_test_run_trains(tmp_path):
    assert "`python train.py trainer=debug`" in text(README)
    done = run([str(ROOT / "train.py"), "trainer=debug", "logger=none", f"hydra.run.dir={tmp_path}"], cwd=tmp_path,
               timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "status: completed" in done.stdout and "steps 20" in done.stdout
