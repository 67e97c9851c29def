"""The command line's overrides, checked before Hydra takes over. A misspelled key, an unknown option or a
malformed override is answered with one line that names the fix, instead of Hydra's message of up to 20
lines (the config search path among them, and "use +key" for a misspelled key, which is the wrong fix).
Hydra's compose API is all it needs: no torch, no run directory. HYDRA_FULL_ERROR=1 skips the check.
Also here: a multirun's jobs as Hydra's basic sweeper expands them, and the folder name Hydra gives each."""
import argparse
import contextlib
import copy
import difflib
import io
import os
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

import blocklab.modifications  # noqa: F401 - registers ${modifications:}, which the modifications sweep's params use
from blocklab.paths import CONF_DIR
from blocklab.schema import schema_errors

GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"
# run_dir names Hydra's output dir, which only a run has: a config composed before Hydra runs has none.
RUN_DIR_UNUSED = "run_dir=unused"


class OverrideError(ValueError):
    """An override Hydra would refuse; the message is the one line that says why and what to type instead."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key  # the config key it is about, where there is one


@dataclass
class CommandLine:
    """A command line as Hydra reads it, read once (cli.main) and passed down. `args` is Hydra's own reading (its
    argument parser has no public home); None where Hydra would refuse the flags: it answers that itself.
    `config`: the single run's resolved config (no `hydra` key), once `check` composed it; None for a multirun,
    --cfg, help, or a primary config other than ours."""
    args: argparse.Namespace | None
    config: dict | None = None
    error: str | None = None  # the one line for flags Hydra would refuse that BlockLab can name the fix of

    @classmethod
    def read(cls, argv: list[str]) -> "CommandLine":
        parser = get_args_parser()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                return cls(parser.parse_args(argv))
            except SystemExit:
                pass
            try:  # an option after the overrides (`seed=0,1 -m`): Hydra prints its usage, 8 lines
                args = parser.parse_intermixed_args(argv)
            except (SystemExit, TypeError):
                return cls(None)
        if not args.overrides:
            return cls(None)
        return cls(None, error=_options_after_overrides(argv, list(args.overrides)))

    @property
    def multirun(self) -> bool:
        return self.args is not None and bool(self.args.multirun)

    @property
    def overrides(self) -> list[str]:
        return [] if self.args is None else list(self.args.overrides)

    @property
    def ours(self) -> bool:
        """Whether BlockLab reads this command: not help, shell completion, a rerun, or another primary config."""
        args = self.args
        return args is not None and not (args.help or args.hydra_help or args.shell_completion
                                         or args.experimental_rerun or args.config_path or args.config_name
                                         or args.config_dir)

    def check(self) -> str | None:
        """The one-line error for overrides that do not compose, or a single run's values out of the schema, or
        None: Hydra takes it from there. A single run's config is composed once, here, and kept (`config`)."""
        if self.error is not None:
            return self.error
        if not self.ours:
            return None
        args, single = self.args, not self.args.multirun and not self.args.cfg
        try:
            cfg = check_overrides(args.overrides, multirun=args.multirun, single=single) if args.overrides else None
            command_problem(args)
            if not single:  # a multirun checks every job (after importing torch); --cfg prints the config
                errors = [] if args.cfg or not args.overrides else [output_dir_error(args.overrides, multirun=True)]
            else:
                if cfg is None:  # no overrides: the config as shipped
                    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
                        cfg = _compose([RUN_DIR_UNUSED])
                folder = OmegaConf.select(cfg, "hydra.run.dir")
                config = _without_hydra(cfg)
                errors = schema_errors(config) or list(filter(None, [_folder_error("hydra.run.dir", folder)]))
                if not errors:
                    self.config = config
        except OverrideError as err:
            return str(err)
        except (HydraException, OmegaConfBaseException, ValueError) as err:
            if isinstance(err, InterpolationResolutionError):
                return interpolation_error(err)
            return None  # a failure this check has no line for: Hydra's own answer, as before
        return "\n".join(filter(None, errors)) or None


def _options_after_overrides(argv: list[str], overrides: list[str]) -> str:
    """The one line for options written after the first override, which Hydra's parser does not read there."""
    import shlex

    first = next(i for i, arg in enumerate(argv) if arg in overrides)
    late = [arg for arg in argv[first:] if arg.startswith("-") and arg not in overrides]
    left = list(overrides)
    options = []
    for arg in argv:  # the options with their values, in order; then the overrides
        if arg in left:
            left.remove(arg)
        else:
            options.append(arg)
    command = " ".join(shlex.quote(arg) for arg in [*options, *overrides])
    return (f"{' '.join(late)} must come before the overrides (Hydra reads no option after them); "
            f"run: {_program()} {command}")


def command_line_error(argv: list[str]) -> str | None:
    """The one-line error for a command line whose overrides do not compose, or None (CommandLine.check)."""
    return CommandLine.read(argv).check()


def job_config(overrides: list[str]) -> dict:
    """One job's resolved config as plain dicts, without Hydra's own keys: what the schema checks."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        cfg = _compose([o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
                       + [RUN_DIR_UNUSED])
    return _without_hydra(cfg)


def _without_hydra(cfg: DictConfig) -> dict:
    """A composed config resolved to plain values, without Hydra's own keys (`cfg` loses them too)."""
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.to_container(cfg, resolve=True)


def check_overrides(overrides: list[str], multirun: bool, single: bool = False) -> DictConfig | None:
    """Raise OverrideError for the first override that Hydra would refuse to compose. In a multirun, every
    swept option of a group must exist, and one job (the first value of each sweep) is composed: an error
    there that another swept option could avoid is left to the sweep's own check of every job. `single`: a
    single run's, whose composed config (Hydra's keys included, run_dir unresolved) is returned."""
    parsed = _parse(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        loader = _loader_with_search_path(parsed)
        first_job, swept_sections = [], set()  # (override, its text in the first job)
        for override in parsed:
            swept = _swept_values(override, loader, multirun)
            if override.is_sweep_override() and swept is None:
                continue  # interval(...): a search sweeper's to draw from; Hydra answers for the basic one
            group = override.key_or_group
            if loader.repository.group_exists(group) and not override.is_delete():
                chosen = swept if swept is not None else override.value()  # an option, or a list of them
                for value in chosen if isinstance(chosen, list) else [chosen]:
                    _check_option(group, "null" if value is None else str(value), loader.get_group_options(group))
                if swept is not None:
                    swept_sections.add(_section(loader, group, swept[0]))
            first_job.append((override, override.input_line if swept is None
                              else f"{override.get_key_element()}={swept[0]}"))
        extra = [RUN_DIR_UNUSED] if single else []
        adds_or_deletes = [override for override, _ in first_job if _adds_or_deletes_a_key(override)]
        try:
            # Hydra creates a missing parent for `+a.b=1` and names no close key for `~a.b`: checked here instead
            cfg = _compose([text for override, text in first_job if override not in adds_or_deletes] + extra)
            for override in adds_or_deletes:
                _check_added_or_deleted(cfg, override)
        except OverrideError as err:
            if err.key is None or not swept_sections & {"", err.key.split(".")[0]}:
                raise
            return None
        if single and adds_or_deletes:  # the job itself, with the keys they add or delete
            cfg = _compose([text for _, text in first_job] + extra)
        return cfg if single else None


def _section(loader: ConfigLoaderImpl, group: str, option: str) -> str:
    """The top-level key a group's option writes to ('' where that is the whole config: experiment, sweep)."""
    header = loader.repository.load_config(f"{group}/{option}").header
    package = header.get("package") or group.replace("/", ".")
    return "" if package == "_global_" else package.split(".")[0]


def _parse(overrides: list[str]) -> list[Override]:
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as err:
        raise OverrideError(f"cannot parse override {err.override!r}: {_parse_detail(err)}; "
                            f"the grammar: {GRAMMAR}") from None
    except ValueError as err:  # Hydra's parser calls int() on the digits: past Python's limit it raises this
        raise _unreadable_integer(overrides, err) from None
    for override in parsed:
        if not override.key_or_group:
            raise OverrideError(f"cannot parse override {override.input_line!r}: no key before '='; use key=value")
    return parsed


def _unreadable_integer(overrides: list[str], err: ValueError) -> OverrideError:
    """The one line for an integer too long for Python to read (sys.get_int_max_str_digits, 4300 digits by
    default): no size BlockLab takes is near it, so it is refused rather than the limit raised."""
    import re
    import sys

    from blocklab.naming import override_key

    limit = sys.get_int_max_str_digits()
    digits = re.compile(r"\d{%d,}" % (limit + 1))
    bad = next((o for o in overrides if digits.search(o)), None)
    if bad is None:
        return OverrideError(f"cannot parse the overrides: {_one_line(str(err))[:200]}")
    key = override_key(bad)
    return OverrideError(f"{key}=<an integer of {len(digits.search(bad).group())} digits> is longer than the {limit} "
                         "digits Python reads; give a value of a sensible size", key=key)


def _parse_detail(err: OverrideParseException) -> str:
    lines = [line for line in err.message.splitlines()
             if line.strip() and not line.startswith(("Error parsing override", "See https://"))]
    lexer = "LexerNoViableAltException: "
    if lines[0].startswith(lexer) and len(lines) > 1 and "^" in lines[1]:
        position = lines[1].index("^") - len(lexer)
        return f"unexpected {err.override[position:]!r}"
    return lines[0]


def _loader_with_search_path(parsed: list[Override]) -> ConfigLoaderImpl:
    """The config loader, with the config dirs a `hydra.searchpath=[...]` override adds (their groups too)."""
    loader = GlobalHydra.instance().config_loader()
    extra = next((o.value() for o in parsed if o.get_key_element() == "hydra.searchpath"), None)
    if not isinstance(extra, list):
        return loader  # a malformed one is for compose to report
    search_path = copy.deepcopy(loader.get_search_path())
    schema = search_path.get_path().pop(-1)  # structured configs stay last, as Hydra orders them
    for path in extra:
        search_path.append(provider="hydra.searchpath in command-line", path=str(path))
    search_path.append(schema.provider, schema.path)
    return ConfigLoaderImpl(config_search_path=search_path)


def _swept_values(override: Override, loader: ConfigLoaderImpl, multirun: bool) -> list[str] | None:
    """Each value of a sweep (`seed=0,1`, `pos=glob(*)`), as override text; None for a plain override."""
    if not override.is_sweep_override():
        return None
    if not multirun:
        raise OverrideError(f"{override.input_line} is a sweep: add -m (--multirun) to run one job per value, "
                            f"or write {override.get_key_element()}=[...] for a list")
    override.config_loader = loader  # glob(...) lists the group's options
    try:
        values = list(override.sweep_string_iterator())
    except HydraException:  # interval(...): only a search sweeper draws from it; Hydra answers that itself
        return None
    if not values:
        options = loader.get_group_options(override.key_or_group)
        raise OverrideError(f"{override.input_line} matches no option of group {override.key_or_group}; "
                            f"options: {' '.join(options)}")
    return values


def _check_option(group: str, value: str, options: list[str], key: str | None = None) -> None:
    if value in options or value == "null":  # null: no option of an optional group (experiment, sweep)
        return
    close = difflib.get_close_matches(value, options, n=2)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise OverrideError(f"{group}={value} is not an option of group {group}; {hint}options: {' '.join(options)}",
                        key=key)


def _compose(overrides: list[str], hydra_keys: bool = True) -> DictConfig:
    """The composed config, or OverrideError with the one line for why Hydra cannot compose it. `hydra_keys`:
    with Hydra's own keys (a job's config as the run sees it has none)."""
    try:
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra_keys)
    except MissingConfigException as err:  # an option that a config's own defaults list names
        if err.options is not None and err.missing_cfg_file is not None:
            group, _, value = err.missing_cfg_file.rpartition("/")
            _check_option(group, value, err.options, key=group.replace("/", "."))
        raise OverrideError(str(err).splitlines()[0], key="") from None  # then: the config search path
    except ConfigCompositionException as err:
        cause = err.__cause__
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
            parent = cause.parent_node
            siblings = list(parent.keys()) if isinstance(parent, DictConfig) else []
            raise OverrideError(_not_a_key(cause.full_key, siblings), key=cause.full_key) from None
        if isinstance(cause, OmegaConfBaseException):  # a value Hydra's own schema refuses (hydra.*)
            raise OverrideError(f"{_one_line(str(err))}: {str(cause.msg).splitlines()[0]}") from None
        raise OverrideError(_one_line(str(err))) from None


def _adds_or_deletes_a_key(override: Override) -> bool:
    """`+a.b=1`, `++a.b=1`, `~a.b`: a config key (groups have no dots); Hydra's own keys are its to check."""
    return (override.is_add() or override.is_force_add() or override.is_delete()) \
        and "." in override.key_or_group and not override.is_hydra_override()


def _check_added_or_deleted(cfg: DictConfig, override: Override) -> None:
    key = override.key_or_group
    parent_key, _, leaf = key.rpartition(".")
    try:
        parent = _existing_node(cfg, parent_key)
    except OverrideError as err:
        raise OverrideError(f"{override.input_line}: {err}", key=key) from None
    if override.is_delete() and leaf not in parent:
        raise OverrideError(f"{override.input_line}: {_not_a_key(key, list(parent.keys()))}", key=key)
    if override.is_add() and leaf in parent:
        raise OverrideError(f"{override.input_line}: {key} already exists; set it without the +: "
                            f"{override.input_line.removeprefix('+')}", key=key)


def _existing_node(cfg: DictConfig, dotted: str) -> DictConfig:
    """The dict at `dotted`, or OverrideError naming the first part of it that does not exist."""
    node, path = cfg, []
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            raise OverrideError(_not_a_key(".".join([*path, part]), list(node.keys()) if isinstance(node, DictConfig)
                                           else []))
        node, path = node._get_node(part), [*path, part]  # the node itself: no interpolation is resolved
    if not isinstance(node, DictConfig):
        raise OverrideError(f"{dotted} is a value, not a group of keys")
    return node


def _not_a_key(key: str, siblings: list[str]) -> str:
    """`model.dmodel is not a key of model; did you mean model.d_model?`"""
    parent, _, leaf = key.rpartition(".")
    where, prefix = (parent, f"{parent}.") if parent else ("the config", "")
    close = difflib.get_close_matches(leaf, siblings, n=2)
    if close:
        hint = f"did you mean {' or '.join(prefix + k for k in close)}?"
    else:
        hint = f"its keys: {' '.join(sorted(siblings))}" if siblings else f"{where} has no keys under it"
    return f"{key} is not a key of {where}; {hint}"


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def compose_job(overrides: list[str]) -> DictConfig:
    """One sweep job's config without Hydra's keys (inside initialize_config_dir), or OverrideError: the one
    line for why Hydra cannot compose it (a key its options do not have)."""
    return _compose(overrides, hydra_keys=False)


def job_dirname(overrides: list[str], naming) -> str:
    """The folder name Hydra gives a sweep job with these overrides (hydra.job.override_dirname), under the
    naming settings `naming` (hydra.job.config.override_dirname)."""
    return get_overrides_dirname(OverridesParser.create().parse_overrides(overrides), list(naming.exclude_keys),
                                 naming.item_sep, naming.kv_sep)


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper makes them: the sweep file's `hydra.sweeper.params`,
    then the command line (which wins for a key both set), every sweep expanded (glob included)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed = _parse(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        loader = _loader_with_search_path(parsed)
        plain = [o for o in parsed if not o.is_sweep_override()]
        try:
            params = _compose([o.input_line for o in plain]).hydra.sweeper.params or {}
        except OverrideError:  # a key only some swept options have (-m attn=gla,mha attn.gate_rank=8): the
            # sweeper's params come from the sweep file and Hydra's keys, which the groups and hydra.* set alone
            chosen = [o.input_line for o in plain if o.is_hydra_override() or "." not in o.key_or_group
                      and loader.repository.group_exists(o.key_or_group)]
            params = _compose(chosen).hydra.sweeper.params or {}
        lines = [f"{key}={value}" for key, value in params.items()] + list(overrides)
        swept = OverridesParser.create(config_loader=loader).parse_overrides(lines)
        return [list(job) for batch in BasicSweeper.split_arguments(swept, max_batch_size=None) for job in batch]


# --- whole-command checks: what no single override shows ------------------------------------------------------

def command_problem(args) -> None:
    """OverrideError for a command line Hydra would run but not as typed: a key set twice (Hydra keeps the last
    without a word), or a sweep file without -m (Hydra would train its first job alone)."""
    from blocklab.naming import override_key

    if os.environ.get("LOCAL_RANK", "0") != "0":  # a DDP rank Lightning started: it appends its own hydra.run.dir
        return  # to the command its rank zero checked
    keys: dict[str, list[str]] = {}
    for override in args.overrides:
        keys.setdefault(override_key(override), []).append(override)
    for key, overrides in keys.items():
        if len(overrides) > 1:
            raise OverrideError(f"{key} is set {len(overrides)} times ({' '.join(overrides)}); Hydra would keep "
                                f"the last without a word: keep one", key=key)
    sweep = next((o for o in args.overrides if override_key(o) == "sweep" and not o.startswith("~")), None)
    if sweep is not None and not args.multirun and not args.cfg and sweep.partition("=")[2] not in ("", "null"):
        raise OverrideError(f"{sweep} names a sweep, which runs as a multirun only (without -m it would train its "
                            f"first job alone, which is refused); run: {_program()} -m {' '.join(args.overrides)}",
                            key="sweep")


def _program() -> str:
    """How the command was started, to spell a corrected one: `python train.py` or `python -m blocklab.train`."""
    import sys
    from pathlib import Path

    return "python -m blocklab.train" if Path(sys.argv[0]).name == "__main__.py" else "python train.py"


def output_dir_error(overrides: list[str], multirun: bool) -> str | None:
    """The one line for a run (or sweep) folder Hydra could not create: Hydra makes it before any of BlockLab's
    code runs, and its failure is a traceback. None where the folder exists or its parent can take it."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        try:
            cfg = _compose([o.input_line for o in _parse(overrides) if not o.is_sweep_override()] + [RUN_DIR_UNUSED])
        except OverrideError:  # a key only a swept option has (-m pos=rope,learned pos.max_len=64): the jobs' check
            return None
        for group in cfg:  # a value the folder's name reads (study.scale) is named for itself, not as the folder
            if group != "hydra" and isinstance(cfg[group], DictConfig):
                OmegaConf.to_container(cfg[group], resolve=True)
        return _folder_error(key, OmegaConf.select(cfg, key))


def _folder_error(key: str, value) -> str | None:
    """output_dir_error's line for `value`, the folder `key` (hydra.run.dir or hydra.sweep.dir) names: one that is
    empty (Hydra would write into the current folder), whose name the file system cannot hold, or that cannot be
    created."""
    import errno

    text = "" if value is None else str(value)
    if not text.strip():
        example = "outputs/sweeps/NAME" if key == "hydra.sweep.dir" else "outputs/runs/NAME"
        return (f"{key} is empty, and Hydra would write into the current folder; give a folder, e.g. "
                f"{key}={example} (or {key}=. to mean the current folder)")
    folder = Path(text)
    shown = text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"
    try:
        existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
    except OSError as err:  # ENAMETOOLONG: a name over the file system's limit (255 bytes on most)
        if err.errno != errno.ENAMETOOLONG:
            return f"{key}={shown} cannot be created: {err.strerror}; choose another {key}"
        longest = max(len(part.encode()) for part in folder.parts)
        size = f"a name in it is {longest} bytes" if longest > 255 else f"the path is {len(text.encode())} bytes"
        return (f"{key}={shown} cannot be created: {size}, longer than the file system allows (255 bytes a name, "
                f"4096 a path on most); choose a shorter {key}")
    if existing == folder and folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
        return None
    if not existing.is_dir():
        why = f"{existing} is a file, not a folder"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable (permissions, or a read-only file system)"
    else:
        return None
    return f"{key}={folder} cannot be created: {why}; choose another {key}"


def interpolation_error(err: OmegaConfBaseException) -> str:
    """One line for a value whose ${...} cannot be resolved (an unset environment variable, a reference to no
    key, a resolver given the wrong kind of value), naming the key, its text and what it refers to."""
    import re

    key, parent = getattr(err, "full_key", None), getattr(err, "parent_node", None)
    leaf = str(key).rpartition(".")[2]
    text = parent._get_node(leaf)._value() if isinstance(parent, DictConfig) and leaf in parent else None
    root = parent._get_root() if parent is not None else None
    absent = object()
    values = {} if root is None or not isinstance(text, str) else {
        ref: OmegaConf.select(root, ref, default=absent, throw_on_resolution_failure=False)
        for ref in re.findall(r"\$\{([\w.]+)\}", text)}
    refs = [f"{ref} is not a key" if value is absent else f"{ref}={value!r}" for ref, value in values.items()]
    what = f"{key}={text}" if text is not None else str(key or "a value")
    detail = str(getattr(err, "msg", err)).splitlines()[0].replace(" raised while resolving interpolation", "")
    return (f"{what} cannot be resolved{' (' + ', '.join(refs) + ')' if refs else ''}: {detail[:200]}; "
            "give the value directly, or set what it refers to")
