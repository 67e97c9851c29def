import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from blocklab.paths import CONF_DIR

ROOT = Path(__file__).resolve().parents[1]
# Tokenized corpora go to a per-session folder, never the user's cache.
if "BLOCKLAB_CACHE" not in os.environ:
    os.environ["BLOCKLAB_CACHE"] = tempfile.mkdtemp(prefix="blocklab-cache-")
    atexit.register(shutil.rmtree, os.environ["BLOCKLAB_CACHE"], ignore_errors=True)
# Under pytest-xdist the workers split the cores: two workers of two torch threads each on two cores would contend.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch
    from joblib import cpu_count

    _threads = max(1, cpu_count() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))  # the train.py subprocesses tests start
    if os.environ["OMP_NUM_THREADS"].isdigit():  # one the user set: the same count here as in those subprocesses
        _threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
    torch.set_num_threads(_threads)
CONF = CONF_DIR  # the packaged config (conf/ at the root is a link to it)

# Fast settings for end-to-end runs: a few steps, small eval sets, no W&B unless a test asks, and no attention
# heatmap PNGs (drawing them is most of a 20-step run; test_analysis covers them).
FAST = ["trainer=debug", "logger=none", "task.eval_examples=16", "++diagnostics.attention_maps=none"]


def compose_config(overrides: list[str], run_dir: Path | None = None):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        extra = [f"run_dir={run_dir}"] if run_dir is not None else ["run_dir=unused"]
        return compose(config_name="config", overrides=[*overrides, *extra])


def run_in_process(overrides: list[str], run_dir: Path):
    from blocklab.train.run import run

    return run(compose_config(overrides, run_dir))


def run_cli(args: list[str], timeout: int = 600, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd or ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "WANDB_SILENT": "true", **(env or {})})


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"


@pytest.fixture(scope="session")
def copy_task():
    """The copy task the diagnostics tests probe models with: lengths 1-16 over 16 characters."""
    from blocklab.tasks import build_task

    return build_task(dict(name="copy", alphabet="abcdefghijklmnop", min_len=1, max_len=16, eval_lengths=None,
                           batch_size=8, eval_examples=32, eval_seed=1), 0)


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> dict:
    """results.json of the default run with FAST settings: what a run of one option is compared with."""
    from blocklab.results import read_results

    run_dir = tmp_path_factory.mktemp("default") / "run"
    run_in_process(FAST, run_dir)
    return read_results(run_dir)


@contextlib.contextmanager
def report_page(index: Path):
    """A report page opened in headless Chromium; skips where Chromium or playwright (dev extra) is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian package `chromium`); the browser check needs it")
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright (dev extra) drives the browser")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.goto(index.as_uri())
            yield page
            page.screenshot(path=str(index.parent / "screenshot.png"), full_page=True)
        finally:
            browser.close()
