"""Ladders: one sweep across model sizes (`study.ladder` in a sweep file), so a verdict can be fitted against N.

A sweep file declares

    study:
      rung: null                       # the job's rung (null: the first); swept below
      ladder:
        sizes: [model.d_model, model.n_heads]   # the keys the rungs set, and the only ones they may set
        rungs:                                   # >= 5, each a set of size overrides, smallest first
          d32: {model.d_model: 32, model.n_heads: 2}
          ...
        budget: {rule: tokens, tokens: 300000, evals: 8}   # or {rule: tokens_per_param, ratio: 20, evals: 8}
    model:
      d_model: ${ladder:model.d_model}     # each size key reads its rung's value
    trainer:
      max_steps: ${ladder:max_steps}       # and the budget follows from the rule
      val_check_interval: ${ladder:eval_every}
    hydra.sweeper.params:
      study.rung: ${ladder:rungs}          # every rung, by name: jobs are named study.rung=d32,...

The budget rules: `tokens`, the same number of training tokens at every rung (times study.scale); `tokens_per_param`,
`ratio` tokens per parameter, counted as Kaplan et al. 2020's non-embedding estimate N = 12 n_layers d_model^2 (a
rule on the size keys, so the budget needs no model built). Steps are tokens over task.batch_size x task.block_size,
rounded up. `evals` validations per run (val_check_interval = max_steps // evals): each is recorded in results.json
`val_loss_curve`, so a fit can use the whole curve (Choshen et al. 2025), not only the final loss.

`ladder_error`, called by the launch on every job's composed config before any job runs, refuses a ladder of under
MIN_RUNGS rungs, a rung that sets a key `sizes` does not declare, a job whose size keys or budget are not its rung's,
and jobs of one setting whose configs differ across rungs in anything else (a launcher that silently drifts between
sizes: Marin #8156)."""
import math
import re

from omegaconf import DictConfig, OmegaConf

MIN_RUNGS = 5  # a 3-parameter law per setting keeps 2 degrees of freedom
RULES = ("tokens", "tokens_per_param")
BUDGET_KEYS = ("trainer.max_steps", "trainer.val_check_interval")
EVALS = 8
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def select(tree: dict, dotted: str, default=None):
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def rung_of(study: dict) -> tuple[str, dict]:
    """The job's rung name and its size overrides (the first rung where study.rung is null)."""
    rungs = study["ladder"]["rungs"]
    name = study.get("rung")
    name = next(iter(rungs)) if name is None else str(name)
    if name not in rungs:
        raise ValueError(f"study.rung={name} is not a rung of study.ladder ({', '.join(rungs)})")
    return name, rungs[name]


def non_embedding_params(d_model: int, n_layers: int) -> int:
    """Kaplan et al. 2020 (eq. 2.1 without the context term): 12 n_layers d_model^2."""
    return 12 * n_layers * d_model ** 2


def max_steps(config: dict) -> int:
    """The rung's training steps under the ladder's budget rule (config: the job's config, resolved or not)."""
    study = config["study"]
    budget, (_, sizes) = study["ladder"]["budget"], rung_of(study)
    per_step = config["task"]["batch_size"] * config["task"]["block_size"]

    def size(key):
        return sizes.get(key, select(config, key))

    if budget["rule"] == "tokens":
        tokens = budget["tokens"]
    elif budget["rule"] == "tokens_per_param":
        tokens = budget["ratio"] * non_embedding_params(size("model.d_model"), size("model.n_layers"))
    else:
        raise ValueError(f"study.ladder.budget.rule={budget['rule']} is not one of {', '.join(RULES)}")
    return max(1, math.ceil(tokens * study.get("scale", 1) / per_step))


def eval_every(config: dict) -> int:
    return max(1, max_steps(config) // config["study"]["ladder"]["budget"].get("evals", EVALS))


def _resolve(key: str, *, _root_: DictConfig):
    """`${ladder:KEY}`: the rung's value of a size key, `rungs` (the rung names, comma-separated, for the sweeper),
    `max_steps` or `eval_every` (the budget rule's)."""
    config = OmegaConf.to_container(_root_.study, resolve=True)
    root = {"study": config, "task": OmegaConf.to_container(_root_.task, resolve=True)}
    if not isinstance(config.get("ladder"), dict):
        raise ValueError("${ladder:...} needs study.ladder (a sweep file's ladder of rungs)")
    if key == "rungs":
        return ",".join(config["ladder"]["rungs"])
    if key == "max_steps":
        return max_steps(root)
    if key == "eval_every":
        return eval_every(root)
    _, sizes = rung_of(config)
    if key not in sizes:
        raise ValueError(f"the rung sets no {key} (study.ladder.sizes: {', '.join(config['ladder']['sizes'])})")
    return sizes[key]


OmegaConf.register_new_resolver("ladder", _resolve, replace=True)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def shape_error(ladder) -> str | None:
    """What is wrong with a declared study.ladder itself, as one line, or None."""
    fix = "see blocklab/ladder.py for the form"
    if not isinstance(ladder, dict) or not isinstance(ladder.get("rungs"), dict) \
            or not isinstance(ladder.get("sizes"), list) or not ladder["sizes"]:
        return f"study.ladder needs `sizes` (a list of size keys) and `rungs` (a mapping of rung names); {fix}"
    rungs, sizes = ladder["rungs"], ladder["sizes"]
    if len(rungs) < MIN_RUNGS:
        return (f"study.ladder has {len(rungs)} rungs; a fit of E + A N^-alpha per setting needs at least "
                f"{MIN_RUNGS} (2 degrees of freedom left): add rungs")
    for name, sets in rungs.items():
        if not _NAME.match(str(name)):
            return f"study.ladder rung name {name!r} names job folders: use letters, digits, _ and - only"
        if not isinstance(sets, dict) or set(sets) != set(sizes):
            extra = sorted(set(sets) - set(sizes)) if isinstance(sets, dict) else []
            what = (f"sets {', '.join(extra)}, which study.ladder.sizes does not declare" if extra else
                    f"must set exactly the size keys {', '.join(sizes)}")
            return f"study.ladder rung {name} {what}; rungs may differ only in their declared size keys"
    budget = ladder.get("budget")
    if not isinstance(budget, dict) or budget.get("rule") not in RULES:
        return f"study.ladder.budget.rule must be one of {', '.join(RULES)}; {fix}"
    needed = "tokens" if budget["rule"] == "tokens" else "ratio"
    value = budget.get(needed)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        return f"study.ladder.budget.{needed}={value!r} must be a positive number under rule {budget['rule']}"
    evals = budget.get("evals", EVALS)
    if not isinstance(evals, int) or isinstance(evals, bool) or evals < 1:
        return f"study.ladder.budget.evals={evals!r} must be a positive integer (validations per run)"
    return None


def ladder_error(jobs: list[list[str]], configs: list[dict]) -> str | None:
    """Why this launch's ladder cannot run as declared, as one line, or None (no ladder: None). `jobs`: each job's
    overrides, `configs`: its resolved config."""
    ladders = [c.get("study", {}).get("ladder") if isinstance(c.get("study"), dict) else None for c in configs]
    if all(ladder is None for ladder in ladders):
        return None
    error = shape_error(ladders[0])
    if error:
        return error
    sizes = list(ladders[0]["sizes"])
    settings: dict[tuple, dict[str, tuple[list[str], dict]]] = {}
    for job, config in zip(jobs, configs):
        name, rung = rung_of(config["study"])
        for key in sizes:
            if select(config, key) != rung[key]:
                return (f"{key} is {select(config, key)!r} in rung {name}, whose value is {rung[key]!r}: set "
                        f"{key}: ${{ladder:{key}}} in the sweep file (and do not override it)")
        expected = {"trainer.max_steps": max_steps(config), "trainer.val_check_interval": eval_every(config)}
        for key, value in expected.items():
            if select(config, key) != value:
                rule = "${ladder:max_steps}" if key.endswith("max_steps") else "${ladder:eval_every}"
                return (f"{key} is {select(config, key)!r} in rung {name}, but the ladder's budget rule gives {value}: "
                        f"set {key}: {rule} in the sweep file")
        setting = tuple(o for o in job if not o.startswith("study.rung="))
        settings.setdefault(setting, {})[name] = (job, config)
    free = set(sizes) | set(BUDGET_KEYS) | {"study.rung"}
    for setting, by_rung in settings.items():
        (first, (_, base)), *rest = by_rung.items()
        base = {k: v for k, v in _flat(base).items() if k not in free}
        for name, (_, config) in rest:
            other = {k: v for k, v in _flat(config).items() if k not in free}
            drift = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
            if drift:
                key = drift[0]
                return (f"rungs {first} and {name} differ in {key} ({base.get(key)!r} against {other.get(key)!r}), "
                        f"which is not a declared size key ({', '.join(sizes)}) nor a budget key; a ladder's rungs "
                        "differ in their sizes and budget only: declare it in study.ladder.sizes or set it once")
    return None
