"""BlockLab from Python or a notebook, beside the command line (the top layer, as cli.py):

    from blocklab import api
    model = api.build_model(["pos=alibi", "model.n_layers=4"])      # a torch.nn.Module, freshly initialised
    results = api.run(["trainer.max_steps=200", "logger=none"], "outputs/runs/mine")   # results.json as a dict
    rows = api.read_sweep("outputs/sweeps/pe_copy")                 # one flat dict per run

Each takes the overrides `python train.py` takes. `run` trains through `python -m blocklab.train` in a
subprocess, so a run from Python gets every check, the same run directory and the same results as one from
the shell, and a crash or a Ctrl-C in training cannot take the notebook's kernel with it."""
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

from blocklab.errors import ConfigError
from blocklab.results import METRICS, RESULTS_FILE, read_results


def build_model(overrides: list[str] | tuple[str, ...] = ()):
    """The model `python train.py OVERRIDES` would train, freshly initialised (torch's seed set to the config's
    `seed`, as a run does), in train mode. The packaged config is composed with Hydra's compose API and
    validated as a run's is: a bad override raises ConfigError with one line per problem."""
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from blocklab.experiment import Setup
    from blocklab.model import build_model as build

    try:
        with initialize_config_dir(config_dir=str(files("blocklab") / "conf"), version_base="1.3", job_name="api"):
            cfg = compose(config_name="config", overrides=[*overrides, "run_dir=unused"])
    except HydraException as err:  # an unknown key or option: Hydra's own message, in one line
        message = " ".join(str(err).split()).partition(" Config search path:")[0]  # the path is Hydra's internals
        raise ConfigError(message.removeprefix("In 'config': ")) from None
    setup = Setup.from_config(cfg)
    torch.manual_seed(cfg.seed)
    return build(setup.model_cfg)


def run(overrides: list[str] | tuple[str, ...], run_dir: str | Path, quiet: bool = True) -> dict:
    """Train and evaluate one experiment in `run_dir` (hydra.run.dir) and return its results.json as a dict.
    Its console (progress bar, result table) is dropped when `quiet`, else shown on this process's stdout. Bad overrides
    raise ConfigError with the command line's one-line errors, and nothing is written; a run that diverges
    returns its results (status "diverged"), as the command line exits 0 for it. Running it again on a finished
    `run_dir` returns the results already there; on an interrupted one, resumes it."""
    run_dir = Path(run_dir)
    quoted = str(run_dir).replace("\\", "\\\\").replace("'", "\\'")  # Hydra's grammar: '=' or ',' in a path
    command = [sys.executable, "-m", "blocklab.train", *overrides, f"hydra.run.dir='{quoted}'"]
    done = subprocess.run(command, text=True, stderr=subprocess.PIPE,
                          stdout=subprocess.DEVNULL if quiet else None)
    if done.returncode == 2:  # a config error: the command line's own lines, before any file was written
        raise ConfigError("\n".join(line.removeprefix("error: ") for line in done.stderr.splitlines()
                                    if line.startswith("error: ")) or done.stderr.strip())
    if not (run_dir / RESULTS_FILE).exists():
        raise RuntimeError(f"python -m blocklab.train exited {done.returncode} without results in {run_dir}:\n"
                           f"{done.stderr.strip()}")
    if done.returncode != 0 and not quiet:
        print(done.stderr, file=sys.stderr, end="")
    return read_results(run_dir)


def read_sweep(path: str | Path) -> list[dict]:
    """Every run under `path` (a sweep folder, a folder of sweeps, or any folder of run directories) as one flat
    dict each: the rows `python -m blocklab.report` tabulates (run, status, study, task, the choices, every
    config key dotted as `optim.lr`, and the summary metrics such as final_val_loss, exact_match_in and
    exact_match_out), plus each evaluated length's metrics as `exact_match@16`, `token_acc@16`. Values are
    numbers, strings, booleans or None, so `pandas.DataFrame(rows)` is the table. Runs in folder order."""
    from blocklab.report.collect import collect

    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder; give a sweep folder such as outputs/sweeps/NAME")
    rows = []
    for row in collect(root):
        flat = {key: value for key, value in row.items() if not isinstance(value, (dict, list))}
        for line in row.get("eval") or []:  # failed and invalid runs have none
            flat.update({f"{metric}@{line['length']}": line[metric] for metric in METRICS if metric in line})
        rows.append(flat)
    return rows
