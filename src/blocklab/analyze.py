"""Diagnostics without training, or of a finished run.

    python -m blocklab.analyze RUN_DIR                 # a trained run: its final model
    python -m blocklab.analyze --init [overrides ...]  # a freshly initialised model, e.g. norm=post_ln model.n_layers=24
    python -m blocklab.analyze RUN_DIR --eval-scaling yarn:4   # the trained model under a context extension

Writes to DIR/diagnostics/ (RUN_DIR for a run; --out, default outputs/analyze/TIMESTAMP, for --init)
the same measurements as training's diagnostics, and prints each path:
    analysis.json          the numbers
    attention_TAG.png      attention maps, layers x heads, one colour scale
    layers_TAG.png         each measure against layer: gradient norms, activation RMS, rank collapse, ...
    history.png            a run with diagnostics: the same measures against training step
TAG is init or trained.

--eval-scaling METHOD:FACTOR (pi, ntk, yarn; or none) evaluates the run's trained weights, without retraining, with
pos.scaling=METHOD pos.scaling_factor=FACTOR at the task's evaluation lengths, and writes
RUN_DIR/eval_scaling_METHOD_FACTOR.json beside the run (its results.json is never touched)."""
import argparse
import json
import math
import time
from pathlib import Path

from blocklab import folder
from blocklab.errors import ConfigError, OneLineParser, exit_on
from blocklab.results import unfinished_run_error
from blocklab.startup import uncollected_imports


def analyze_init(overrides: list[str], out: Path) -> list[Path]:
    import torch
    from hydra import compose, initialize_config_dir

    from blocklab.paths import CONF_DIR  # the packaged config groups
    from blocklab.experiment import Setup
    from blocklab.model import build_model

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"run_dir={out}"])
    setup = Setup.from_config(cfg)
    torch.manual_seed(setup.config["seed"])
    model = build_model(setup.model_cfg)
    return _write(model, setup, out, "init", {"overrides": overrides})


def analyze_run(run_dir: Path) -> list[Path]:
    from blocklab.analysis.plots import history_figure, save
    from blocklab.experiment import Setup

    setup = Setup.from_run_dir(run_dir, with_task=True)
    paths = _write(setup.trained_model(), setup, run_dir, "trained", {"run_dir": str(run_dir)})
    history = Path("diagnostics") / "history.json"
    try:
        fig = history_figure(folder.read_json(run_dir, history)) if folder.exists(run_dir, history) else None
    except (ValueError, TypeError, KeyError) as err:  # FolderError (a link, a FIFO) is a ValueError too
        raise ConfigError(f"{run_dir / history} is unreadable or damaged ({str(err).splitlines()[0][:200]}); "
                          "remove it to analyze the run without its history") from None
    return paths + ([save(fig, run_dir / history.with_suffix(".png"))] if fig is not None else [])


def parse_scaling(spec: str) -> tuple[str, float] | str:
    """'yarn:4' -> ('yarn', 4.0); 'none' -> ('none', 1.0); anything else: the one-line error (a str)."""
    method, _, factor = spec.partition(":")
    if method == "none" and not factor:
        return "none", 1.0
    try:
        value = float(factor)
    except ValueError:
        value = None
    if not method or value is None or not math.isfinite(value) or value < 1:
        return (f"--eval-scaling {spec!r} must be METHOD:FACTOR with a finite FACTOR >= 1 (e.g. yarn:4, pi:2, "
                "ntk:8), or none")
    return method, value


def eval_scaling(run_dir: Path, method: str, factor: float) -> list[Path]:
    """The run's trained weights under pos.scaling=method, scaling_factor=factor, evaluated as training's outcome
    evaluates (the task's own `evaluate`, at its eval lengths); written beside the run, results.json untouched."""
    import dataclasses

    import torch

    from blocklab.experiment import Setup, trained_context

    setup = Setup.from_run_dir(run_dir, with_task=True)
    cfg = setup.model_cfg
    options = {**cfg.pos.options, "scaling": method, "scaling_factor": factor}
    if options.get("original_context") is None:  # a run from before pos.scaling: the context it trained at
        options["original_context"] = trained_context(setup.task)
    scaled = dataclasses.replace(cfg, pos=dataclasses.replace(cfg.pos, options=options))
    errors = scaled.errors()
    if errors:
        raise ConfigError(f"--eval-scaling {method}:{factor:g} on {run_dir}: {errors[0]}")
    model = dataclasses.replace(setup, model_cfg=scaled).trained_model()
    with torch.no_grad():
        rows = setup.task.evaluate(model)
    record = {"run_dir": str(run_dir), "task": setup.task.name, "pos": cfg.pos.name, "scaling": method,
              "scaling_factor": factor, "original_context": options["original_context"],
              "train_lengths": list(setup.task.train_lengths), "eval": rows}
    # JSON has no NaN or Infinity: a loss that overflowed is written as null, as results.json writes it.
    record = json.loads(json.dumps(record), parse_constant=lambda _: None)
    return [folder.write_json(run_dir, f"eval_scaling_{method}_{factor:g}.json", record)]  # atomic


def _write(model, setup, out: Path, tag: str, about: dict) -> list[Path]:
    """analysis.json, the attention figure and the per-layer figure."""
    from blocklab.analysis.plots import layer_figure, save
    from blocklab.analysis.probe import measure
    from blocklab.train.diagnostics import write_measurement

    diag = setup.config["diagnostics"]
    probe = setup.task.probe_batch(diag.get("probe_examples", 16))
    stats = measure(model, probe, diag.get("sparsity_eps", 1e-3), keep_weights=True)
    stats = write_measurement(stats, out / "diagnostics", tag, maps=True)
    path = folder.write_json(out, Path("diagnostics") / "analysis.json", {**about, "tag": tag, **stats}, indent=1)
    layers = save(layer_figure(stats, f"per-layer diagnostics ({tag}, probe batch)"),
                  out / "diagnostics" / f"layers_{tag}.png")
    return [path, *(out / p for p in stats["attention_maps"]), layers]


def main(argv=None) -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", nargs="*", help="RUN_DIR, or with --init: config overrides")
    parser.add_argument("--init", action="store_true", help="analyse a freshly initialised model")
    parser.add_argument("--out", type=Path, default=None, help="output directory for --init")
    parser.add_argument("--eval-scaling", metavar="METHOD:FACTOR", default=None,
                        help="evaluate RUN_DIR's weights under a context extension (pi, ntk, yarn; none), no training")
    args = parser.parse_args(argv)
    scaling = None
    if args.eval_scaling is not None:
        if args.init:
            parser.error("--eval-scaling evaluates a trained run: give RUN_DIR, not --init")
        scaling = parse_scaling(args.eval_scaling)
        exit_on(scaling if isinstance(scaling, str) else None)
    if not args.init:
        if len(args.target) != 1:
            parser.error("give one RUN_DIR, or --init with config overrides")
        exit_on(unfinished_run_error(Path(args.target[0])))  # before torch and Lightning are imported
    else:  # the overrides as train.py checks them: a misspelled key or a bad value is one line, not Hydra's traceback
        from blocklab.overrides import command_line_error

        exit_on(command_line_error(args.target))
    try:
        with uncollected_imports("blocklab.train.diagnostics"):
            import blocklab.experiment, blocklab.train.diagnostics  # noqa: F401,E401  torch, Lightning, matplotlib
        if args.init:
            out = args.out or Path("outputs/analyze") / time.strftime("%Y-%m-%d_%H-%M-%S")
            paths = analyze_init(args.target, out)
        else:  # the run's lock, as training holds it: one writer at a time, and a read-only folder refused first
            with folder.lock(Path(args.target[0]), "BlockLab process (a run still training, or another analysis)"):
                paths = (eval_scaling(Path(args.target[0]), *scaling) if scaling is not None
                         else analyze_run(Path(args.target[0])))
    except ConfigError as err:
        exit_on(str(err))
    for path in paths:
        print(f"wrote {path}")

if __name__ == "__main__":
    main()
