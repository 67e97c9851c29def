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

A token ladder (`budget: {rule: wsd_branches, ...}`) has one model size and rungs of training budget D instead: the
cooldown branches of one warmup-stable-decay trunk per setting and seed (optim.schedule=wsd, blocklab/schedule.py;
Hägele et al. 2024; OLMo-core's WSD-S ladders). Its rungs are branch points, fractions of the trunk's steps, and the
rung `trunk` (TRUNK) is the trunk itself:

    study:
      ladder:
        rungs: {t1: 0.0625, t2: 0.125, t3: 0.25, t4: 0.5, t5: 1.0}   # >= 5 branch points, smallest first
        budget: {rule: wsd_branches, tokens: 2621440, evals: 8,       # the trunk's tokens
                 tokens_per_step: ${mul:${task.batch_size},${task.block_size}}}   # the page's D = steps x this
    optim:
      schedule: wsd
      branch_points: ${ladder:branch_points}   # the trunk's: every rung's fraction; a branch's: []
      branch_from: ${ladder:branch_from}       # a branch's: rung:trunk (TRUNK_FROM); the trunk's: null
      branch_step: ${ladder:branch_step}       # a branch's: its fraction of the trunk's steps, rounded
    hydra.sweeper.params:
      study.rung: ${ladder:rungs}              # trunk, then every branch

The trunk trains ceil(tokens / tokens_per_step) steps at a constant lr after warmup, keeping a full checkpoint at
each branch point S; the branch of rung f starts from the one at S = round(f x trunk steps) and decays to
round(S / (1 - optim.cooldown)) steps: its cooldown is optim.cooldown of its own length (20%: Hägele et al.'s and
OLMo-core's share). `rung:trunk` names the folder beside the branch's own in its sweep folder whose study.rung is
trunk (`trunk_folder`), so a branch finds its own setting and seed's trunk however the sweep folder is named. The
trunks run before their branches: `python train.py -m sweep=NAME study.rung=trunk`, then the whole sweep (its
trunks are then skipped as finished); a launch whose branches' trunks have not kept their checkpoints is refused.

`ladder_error`, called by the launch on every job's composed config before any job runs, refuses a ladder of under
MIN_RUNGS rungs, a rung that sets a key `sizes` does not declare, a job whose size keys or budget are not its rung's,
and jobs of one setting whose configs differ across rungs in anything else (a launcher that silently drifts between
sizes: Marin #8156)."""
import math
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from blocklab.schedule import branch_steps

MIN_RUNGS = 5  # a 3-parameter law per setting keeps 2 degrees of freedom
RULES = ("tokens", "tokens_per_param", "wsd_branches")
BRANCHES = "wsd_branches"  # the rule of a token ladder: its rungs are one wsd trunk's cooldown branches
TRUNK = "trunk"  # a token ladder's rung that trains the trunk
TRUNK_FROM = f"rung:{TRUNK}"  # a branch's optim.branch_from: its own setting and seed's trunk, in its sweep folder
BUDGET_KEYS = ("trainer.max_steps", "trainer.val_check_interval")
BRANCH_KEYS = ("optim.branch_points", "optim.branch_from", "optim.branch_step")  # a token ladder's budget keys too
EVALS = 8
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def select(tree: dict, dotted: str, default=None):
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def axis(ladder: dict) -> str:
    """What a ladder's rungs grow: `tokens` (one model, its wsd branches) or `params` (model sizes)."""
    return "tokens" if (ladder.get("budget") or {}).get("rule") == BRANCHES else "params"


def rung_names(ladder: dict) -> list[str]:
    """Every rung a job may take, in order: a token ladder's trunk first."""
    return ([TRUNK] if axis(ladder) == "tokens" else []) + list(ladder["rungs"])


def rung_of(study: dict) -> tuple[str, dict | float | None]:
    """The job's rung name and its size overrides (a token ladder: its branch point, None for the trunk); the first
    rung where study.rung is null."""
    ladder = study["ladder"]
    name = study.get("rung")
    name = rung_names(ladder)[0] if name is None else str(name)
    if name not in rung_names(ladder):
        raise ValueError(f"study.rung={name} is not a rung of study.ladder ({', '.join(rung_names(ladder))})")
    return name, ladder["rungs"].get(name)


def trunk_steps(config: dict) -> int:
    """A token ladder's trunk: its tokens (times study.scale) over a step's, rounded up."""
    study = config["study"]
    per_step = config["task"]["batch_size"] * config["task"]["block_size"]
    return max(1, math.ceil(study["ladder"]["budget"]["tokens"] * study.get("scale", 1) / per_step))


def branch_step(config: dict) -> int | None:
    """The trunk's step a token ladder's branch starts from (as the trunk keeps it: schedule.branch_steps)."""
    _, fraction = rung_of(config["study"])
    return None if fraction is None else branch_steps([fraction], trunk_steps(config))[0]


def trunk_folder(run_dir: Path, rung: str) -> Path:
    """The trunk beside a branch's run folder: its name with study.rung=RUNG as study.rung=trunk (Hydra's job
    folder names, hydra.job.override_dirname: key=value items joined by commas)."""
    items = run_dir.name.split(",")
    mine = f"study.rung={rung}"
    if mine not in items:
        raise ValueError(f"optim.branch_from={TRUNK_FROM} is for a token ladder's jobs, whose folder is named by "
                         f"{mine}; {run_dir.name} is not: give the trunk's run folder instead")
    return run_dir.parent / ",".join(f"study.rung={TRUNK}" if item == mine else item for item in items)


def non_embedding_params(d_model: int, n_layers: int) -> int:
    """Kaplan et al. 2020 (eq. 2.1 without the context term): 12 n_layers d_model^2."""
    return 12 * n_layers * d_model ** 2


def max_steps(config: dict) -> int:
    """The rung's training steps under the ladder's budget rule (config: the job's config, resolved or not)."""
    study = config["study"]
    budget, (_, sizes) = study["ladder"]["budget"], rung_of(study)
    if budget["rule"] == BRANCHES:  # the trunk's steps, or a branch's: its point, then its cooldown's share
        start = branch_step(config)
        return trunk_steps(config) if start is None else round(start / (1 - config["optim"]["cooldown"]))
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
    `max_steps` or `eval_every` (the budget rule's); a token ladder's `branch_points`, `branch_from` and
    `branch_step` (the trunk's or the branch's optim keys)."""
    if not isinstance(_root_.study, DictConfig) or not isinstance(_root_.study.get("ladder"), DictConfig):
        raise ValueError("${ladder:...} needs study.ladder (a sweep file's ladder of rungs)")
    if key == "rungs":  # read alone (the sweep file without the rest of the config): nothing else resolved
        declared = _root_.study.ladder
        return ",".join(rung_names({"rungs": OmegaConf.to_container(declared.rungs, resolve=True),
                                    "budget": {"rule": declared.budget.get("rule")}}))
    config = OmegaConf.to_container(_root_.study, resolve=True)
    root = {"study": config, "task": OmegaConf.to_container(_root_.task, resolve=True),
            "optim": {"cooldown": _root_.optim.get("cooldown")}}
    if key == "max_steps":
        return max_steps(root)
    if key == "eval_every":
        return eval_every(root)
    if key in ("branch_points", "branch_from", "branch_step"):
        return branch_keys(root)[f"optim.{key}"]
    _, sizes = rung_of(config)
    if key not in sizes:
        raise ValueError(f"the rung sets no {key} (study.ladder.sizes: {', '.join(config['ladder']['sizes'])})")
    return sizes[key]


def branch_keys(config: dict) -> dict:
    """A token ladder job's optim keys: the trunk keeps every branch point; a branch starts from its own."""
    start = branch_step(config)
    if start is None:
        return {"optim.branch_points": list(config["study"]["ladder"]["rungs"].values()), "optim.branch_from": None,
                "optim.branch_step": None}
    return {"optim.branch_points": [], "optim.branch_from": TRUNK_FROM, "optim.branch_step": start}


OmegaConf.register_new_resolver("ladder", _resolve, replace=True)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def shape_error(ladder) -> str | None:
    """What is wrong with a declared study.ladder itself, as one line, or None."""
    fix = "see blocklab/ladder.py for the form"
    if isinstance(ladder, dict) and isinstance(ladder.get("rungs"), dict) and axis(ladder) == "tokens":
        return _branches_shape_error(ladder)
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


def _positive(value, integer: bool = False) -> bool:
    kind = int if integer else (int, float)
    return isinstance(value, kind) and not isinstance(value, bool) and value > 0


def _branches_shape_error(ladder: dict) -> str | None:
    """A token ladder's own errors: >= MIN_RUNGS increasing branch points in (0, 1], its trunk's budget."""
    rungs, budget = ladder["rungs"], ladder["budget"]
    if ladder.get("sizes"):
        return ("study.ladder.sizes is for a ladder across model sizes; a wsd_branches ladder trains one model: "
                "remove study.ladder.sizes")
    if len(rungs) < MIN_RUNGS:
        return (f"study.ladder has {len(rungs)} rungs; a fit of E + B D^-beta per setting needs at least {MIN_RUNGS} "
                "(2 degrees of freedom left): add branch points")
    for name, point in rungs.items():
        if not _NAME.match(str(name)) or str(name) == TRUNK:
            return (f"study.ladder rung name {name!r} names job folders: use letters, digits, _ and - only, and not "
                    f"{TRUNK} (the trunk's rung)")
        if not _positive(point) or point > 1:
            return (f"study.ladder rung {name}={point!r} must be a branch point: a fraction of the trunk's steps in "
                    "(0, 1]")
    points = list(rungs.values())
    if any(b <= a for a, b in zip(points, points[1:])):
        return f"study.ladder's branch points {points} must increase, smallest first"
    if not _positive(budget.get("tokens")):
        return f"study.ladder.budget.tokens={budget.get('tokens')!r} must be the trunk's tokens, a positive number"
    if not _positive(budget.get("evals", EVALS), integer=True):
        return f"study.ladder.budget.evals={budget.get('evals')!r} must be a positive integer (validations per run)"
    if not _positive(budget.get("tokens_per_step"), integer=True):
        return ("study.ladder.budget.tokens_per_step must be ${mul:${task.batch_size},${task.block_size}}: the page's "
                "D is a run's steps times it")
    return None


def _branches_error(name: str, config: dict) -> str | None:
    """What a token ladder's job sets otherwise than its rung asks, as one line, or None."""
    budget, optim = config["study"]["ladder"]["budget"], config["optim"]
    if optim.get("schedule") != "wsd":
        return f"optim.schedule is {optim.get('schedule')!r}; a wsd_branches ladder's rungs need optim.schedule: wsd"
    per_step = config["task"]["batch_size"] * config["task"]["block_size"]
    if budget["tokens_per_step"] != per_step:
        return (f"study.ladder.budget.tokens_per_step is {budget['tokens_per_step']} but a step takes {per_step} "
                "tokens: set it to ${mul:${task.batch_size},${task.block_size}}")
    start = branch_step(config)
    if start is not None and start <= optim["warmup_steps"]:
        return (f"rung {name} branches at step {start}, within optim.warmup_steps={optim['warmup_steps']}: a branch "
                "decays from the trunk's constant lr; use fewer warmup steps or a larger trunk (budget.tokens)")
    for key, value in branch_keys(config).items():
        if select(config, key) != value:
            return (f"{key} is {select(config, key)!r} in rung {name}, but the ladder gives {value!r}: set "
                    f"{key}: ${{ladder:{key.split('.')[-1]}}} in the sweep file (and do not override it)")
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
    tokens = axis(ladders[0]) == "tokens"
    sizes = [] if tokens else list(ladders[0]["sizes"])
    settings: dict[tuple, dict[str, tuple[list[str], dict]]] = {}
    for job, config in zip(jobs, configs):
        name, rung = rung_of(config["study"])
        if tokens and (error := _branches_error(name, config)):
            return error
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
    free = set(sizes) | set(BUDGET_KEYS) | set(BRANCH_KEYS if tokens else ()) | {"study.rung"}
    for setting, by_rung in settings.items():
        (first, (_, base)), *rest = by_rung.items()
        base = {k: v for k, v in _flat(base).items() if k not in free}
        for name, (_, config) in rest:
            other = {k: v for k, v in _flat(config).items() if k not in free}
            drift = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
            if drift:
                key = drift[0]
                if tokens:
                    return (f"rungs {first} and {name} differ in {key} ({base.get(key)!r} against "
                            f"{other.get(key)!r}), which is not a budget key; a token ladder's rungs (one trunk and "
                            "its branches) differ in their budget only: set it once")
                return (f"rungs {first} and {name} differ in {key} ({base.get(key)!r} against {other.get(key)!r}), "
                        f"which is not a declared size key ({', '.join(sizes)}) nor a budget key; a ladder's rungs "
                        "differ in their sizes and budget only: declare it in study.ladder.sizes or set it once")
    return None
