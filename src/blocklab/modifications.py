"""The `modifications` sweep's jobs, from the registries: a decoder-LM baseline and one change at a time.

Every Registry of blocklab.model (and blocklab.optim's optimizers) names a config key (`attn.kind`, `optim.name`...),
whose first part is a config group. A modification is one option of such a group (conf/<group>/<option>.yaml, so
MQA and GQA, which are options of `attn`, count), or, for a registry entry no option selects, that entry set on the baseline's option
(`pos.scaling=yarn`). Each is stored in Hydra's ConfigStore as an option of the group `modification` (package
_global_: an `override /<group>: <option>` in its defaults list, or the key's value), so each job is composed by
Hydra like any other: `modification=attn-mqa` (the sweep file's defaults pick `baseline`, registered on
import so the file composes before the rest are). The sweep file asks for them with `${modifications:}`, which
registers them and returns the names that apply to a decoder LM; the rest are `plan().left_out`, each with the
first line config_errors gives for it. An entry registered later joins the sweep without an edit, and so does an
option that is no registry entry once schema.ABLATIONS declares it (`attn.output_gate`: `attn_output_gate-headwise`)."""
from dataclasses import dataclass, field
from functools import cache

from omegaconf import OmegaConf

from blocklab.paths import CONF_DIR
from blocklab.schema import ABLATIONS

GROUP = "modification"
BASELINE = "baseline"
SWEEP = ["sweep=modifications"]


@dataclass
class Plan:
    jobs: list[str] = field(default_factory=list)  # applies to a decoder LM, baseline first
    left_out: dict[str, str] = field(default_factory=dict)  # name -> why not


def registries() -> dict:
    """Every Registry defined in a module of blocklab.model, by its config key."""
    import importlib
    import pkgutil

    import blocklab.model
    import blocklab.optim
    from blocklab.registry import Registry

    found = {}
    modules = [importlib.import_module(f"blocklab.model.{info.name}")
               for info in pkgutil.iter_modules(blocklab.model.__path__)]
    for module in [*modules, blocklab.optim]:
        for value in vars(module).values():
            if isinstance(value, Registry) and "." in value.key:
                found[value.key] = value
    return dict(sorted(found.items()))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _compose(overrides: list[str]):
    """A job's config as Hydra composes it (inside an initialized Hydra, e.g. the sweeper, or on our own)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=[*overrides, "run_dir=unused"])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        return compose(config_name="config", overrides=[*overrides, "run_dir=unused"])


# conf/model holds sizes (tiny, small), not architectures: the study is at one size, and model.arch's entries join
# one by one.
SIZE_GROUPS = ("model",)


def candidates() -> dict[str, dict]:
    """name -> the ConfigStore node of every modification, before asking which apply: each option of a group a
    registry selects that composes differently from the baseline's, then each registry entry no option selects."""
    base = _compose(SWEEP)
    nodes = {BASELINE: {}}
    for key, registry in registries().items():
        group, _, field_ = key.partition(".")
        if group not in base or "." in field_ or (group in NOT_MODEL and group not in SIZE_GROUPS):
            continue
        selected = {OmegaConf.select(base, key)}
        for option in [] if group in SIZE_GROUPS else _options(group):
            composed = _compose([*SWEEP, f"{group}={option}"])[group]
            selected.add(OmegaConf.select(composed, field_))
            if composed != base[group]:
                nodes.setdefault(f"{group}-{option}", {"defaults": [{f"override /{group}": option}]})
        for entry in registry.names():
            if entry not in selected:
                nodes[f"{group}_{field_}-{entry}"] = {group: {field_: entry}}
    for key, values in ABLATIONS.items():  # options declared as ablations (schema.ABLATIONS)
        group, _, field_ = key.partition(".")
        for value in values:
            if value != OmegaConf.select(base, key):
                nodes[f"{group}_{field_}-{str(value).lower()}"] = {group: {field_: value}}
    return nodes


def recipe() -> dict[str, str]:
    """The baseline's group options (the sweep file's study.recipe): every node picks them, but the one it changes,
    since an option a node picks cannot override one the sweep file picks after it."""
    study = OmegaConf.load(CONF_DIR / "sweep" / "modifications.yaml").study
    return dict(OmegaConf.to_container(study.recipe))


def register(nodes: dict[str, dict]) -> None:
    from hydra.core.config_store import ConfigStore

    store, base = ConfigStore.instance(), recipe()
    for name, node in nodes.items():
        changed = {next(iter(d))[len("override /"):] for d in node.get("defaults", [])}
        kept = [{f"override /{group}": option} for group, option in base.items() if group not in changed]
        store.store(group=GROUP, name=name, node={**node, "defaults": kept + node.get("defaults", [])},
                    package="_global_")


def computed(model_cfg, seed: int):
    """What a job's model computes before training: its parameter count and its logits on a fixed batch."""
    import torch

    from blocklab.model import build_model

    torch.manual_seed(seed)
    model = build_model(model_cfg).eval()
    tokens = torch.randint(model_cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.num_params(), model(tokens)


def plan() -> Plan:
    """Which modifications apply to a decoder LM: those whose composed job passes config_errors and whose model
    computes another function than the baseline's and every modification's kept before it (pos.scaling at
    scaling_factor 1, or attn.pattern=full, the default pattern, would only repeat the baseline; attn=local is
    attn=window by an older name), or that trains otherwise (another optimizer, a declared ablation)."""
    import torch

    from blocklab.errors import ConfigError
    from blocklab.experiment import Setup

    register({BASELINE: {}})
    nodes = candidates()
    register(nodes)
    # A declared ablation changes training even where the model starts as the baseline's (a soft-cap that small
    # initial scores do not reach); so does an optimizer.
    declared = {name for name, node in nodes.items() if any(f"{group}.{field_}" in ABLATIONS
                                                             for group, fields_ in node.items() if group != "defaults"
                                                             for field_ in fields_)}
    out, seen = Plan(), []  # (name, params, logits, optim) of every job kept so far, the baseline first
    for name in nodes:  # the baseline first
        config = OmegaConf.to_container(_compose([*SWEEP, f"{GROUP}={name}"]), resolve=True)
        try:  # validated once: config_errors's lines, and the model config to build
            model_cfg, errors = Setup.from_config(config).model_cfg, []
        except ConfigError as err:
            errors = str(err).splitlines()
        if not errors and not config["attn"]["causal"]:
            errors = [f"{name} sets attn.causal=false: a decoder LM would see the token it is asked to predict"]
        if not errors:
            params, logits = computed(model_cfg, config["seed"])
            same = next((other for other, p, out_, optim in seen if p == params and optim == config["optim"]
                         and torch.allclose(logits, out_, rtol=1e-5, atol=1e-6)), None)
            if same is not None and name not in declared:
                errors = [f"{name} computes what {'the baseline' if same == BASELINE else same} computes at its "
                          f"defaults: the same parameters and outputs, so its row would only repeat "
                          f"{'the baseline' if same == BASELINE else same}'s"]
        if errors:
            out.left_out[name] = errors[0]
        else:
            out.jobs.append(name)
            seen.append((name, params, logits, config["optim"]))
    return out


@cache
def _names() -> str:
    return ",".join(plan().jobs)


def _resolve(*wanted: str) -> str:
    """`${modifications:}`: the modifications that apply, comma-separated (a sweep over +modification);
    `${modifications:baseline,attn-diff}`: those named, each of which must apply (a sweep of a few, as `frontier`)."""
    if not wanted:
        return _names()
    jobs = _names().split(",")
    missing = [name for name in wanted if name not in jobs]
    if missing:
        from blocklab.errors import ConfigError

        raise ConfigError(f"${{modifications:...}} names {missing}, which are not modifications of the LLaMA-style "
                          f"LM; use names of {jobs}")
    return ",".join(wanted)


# Groups that configure the run, not the model: never a modification. `param` says how init and learning rates scale
# with width (sp or µP): a question of ladders across widths, not of one change at the sweep's one size. The optim
# group's options (optim=muon) are modifications: they change how the model trains.
NOT_MODEL = ("task", "trainer", "logger", "diagnostics", "method", "experiment", "sweep", "model", "param")


def _cheap_nodes() -> dict[str, dict]:
    """The baseline and one node per option of each model group, from the folder listing alone (no torch, no
    compose), so a command that names modifications (modification=attn-mqa,ffn-moe) passes the command line's
    check of group options before ${modifications:} registers the rest (registry entries no option selects)."""
    nodes = {BASELINE: {}}
    for folder in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in NOT_MODEL):
        for option in _options(folder.name):
            nodes[f"{folder.name}-{option}"] = {"defaults": [{f"override /{folder.name}": option}]}
    return nodes


OmegaConf.register_new_resolver("modifications", _resolve, replace=True)
register(_cheap_nodes())
