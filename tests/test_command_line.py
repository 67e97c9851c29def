"""A single run's command line is read once by Hydra's parser and its config composed once before Hydra runs, and
the Setup validated then is the one that trains: the config checks (task, registries, model) run once per run."""
import json
import os
import subprocess
import sys
import textwrap

from conftest import ROOT

# Counts each call of Hydra's argument parser, of a config composition (every one goes through the config loader)
# and of a config's validation, before Hydra takes over (cli.train) and by the end of the run.
COUNTING = """
    import collections, functools, json, sys
    import hydra._internal.utils, hydra.main
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    calls = collections.Counter()

    def counted(name, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    parser = counted("argv parsed", hydra._internal.utils.get_args_parser)
    hydra._internal.utils.get_args_parser = sys.modules["hydra.main"].get_args_parser = parser
    ConfigLoaderImpl.load_configuration = counted("composed", ConfigLoaderImpl.load_configuration)
    import blocklab.cli, blocklab.experiment
    blocklab.experiment._validated = counted("validated", blocklab.experiment._validated)
    before_hydra = {}

    def train():
        before_hydra.update(calls)
        return hydra_app()

    hydra_app, blocklab.cli.train = blocklab.cli.train, train
    sys.argv = ["train.py", *ARGS]
    blocklab.cli.main()
    print(json.dumps({"before_hydra": before_hydra, "in_all": dict(calls)}))
"""


def counts(args: list[str]) -> dict:
    script = textwrap.dedent(COUNTING).replace("ARGS", repr(args))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_run_is_read_composed_and_validated_once_before_hydra_and_not_validated_again(tmp_path):
    seen = counts(["trainer=debug", "trainer.max_steps=2", "logger=none", "diagnostics=none", "pos=alibi",
                   "task.eval_examples=4", f"hydra.run.dir={tmp_path / 'run'}"])
    assert seen["before_hydra"] == {"argv parsed": 1, "composed": 1, "validated": 1}
    assert seen["in_all"]["validated"] == 1  # the run trained the Setup the command line validated
    assert (tmp_path / "run" / "results.json").exists()
    saved = (tmp_path / "run" / ".hydra" / "config.yaml").read_text()
    assert "name: alibi" in saved and f"run_dir: {tmp_path / 'run'}" in saved  # Hydra's run_dir, not a placeholder
