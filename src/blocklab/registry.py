"""One registry idiom for every pluggable concept (norm type, placement, position scheme, activation,
attention kind, init scheme, task, architecture).

An entry is a class (or function) registered under a name. It declares:
  options      the keyword arguments of its constructor (or function) past the framework's own,
               with their defaults; `option_errors` type-checks configured values against them
  errors(...)  its own constraints, as one-line messages naming the key and the fix (optional)
  derived values through its own methods or attributes (for example a learned table's size)

Nothing outside a registry compares a variant name to a string: code asks the entry instead.
"""
import difflib
import inspect
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """name -> entry for one config group. `key` is how the config names the choice (e.g. 'pos.name')."""

    def __init__(self, key: str, framework_args: tuple[str, ...] = ()):
        self.key = key
        self.framework_args = frozenset(framework_args)  # constructor arguments the model supplies, not the user
        self.entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self.entries and self.entries[name] is not entry:
                raise ValueError(f"{self.key}={name!r} is registered twice")
            try:
                entry.registry_name = name  # lets an instance say which variant it is
            except (AttributeError, TypeError):
                pass
            self.entries[name] = entry
            return entry

        return add

    def unregister(self, name: str) -> None:
        """For tests that register a throwaway entry."""
        self.entries.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def names(self) -> list[str]:
        return list(self.entries)

    def __getitem__(self, name: str) -> T:
        if name not in self:
            raise KeyError(self.unknown(name))
        return self.entries[name]

    def get(self, name: str, default: T | None = None) -> T | None:
        return self.entries.get(name, default) if isinstance(name, str) else default

    def unknown(self, name: Any) -> str:
        """The one-line error for a name that is not registered, with the closest match first."""
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"{self.key}={name!r} is unknown; {hint}use one of {self.names()}"

    def options(self, name: str) -> dict[str, Any]:
        """The user-settable options of an entry and their defaults (inspect.Parameter.empty: required)."""
        entry = self.entries[name]
        if not callable(entry):
            return {}  # a plain description (a placement, an activation) has no options of its own
        options = {}
        # A constructor that passes **kwargs on takes its base class's keywords too.
        for target in [c.__init__ for c in inspect.getmro(entry)] if inspect.isclass(entry) else [entry]:
            params = inspect.signature(target).parameters.values()
            for p in params:
                if p.name not in self.framework_args and p.name != "self" \
                        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    options.setdefault(p.name, p.default)
            if not any(p.kind == p.VAR_KEYWORD for p in params):
                break
        return options

    def option_errors(self, name: str, values: dict[str, Any], prefix: str) -> list[str]:
        """Unknown options and values of the wrong kind, each as one line naming `prefix.key`.
        A None value means 'derive it' and is always accepted."""
        accepted = self.options(name)
        errs = []
        for key in sorted(set(values) - set(accepted)):
            close = difflib.get_close_matches(key, list(accepted), n=1)
            hint = f"did you mean {prefix}.{close[0]}? " if close else ""
            errs.append(f"{prefix}.{key} is not an option of {self.key}={name}; {hint}its options are "
                        f"{sorted(accepted)}")
        for key, value in sorted(values.items()):
            default = accepted.get(key)
            if value is not None and default is not None and not same_kind(value, default):
                errs.append(f"{prefix}.{key}={value!r} must be {kind_name(default)}")
        return errs


def is_number(value: Any) -> bool:
    """An int or float, but not a bool (which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def same_kind(value: Any, default: Any) -> bool:
    """A bool option takes a bool; a numeric one any number but a bool; a string one a string."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float)):
        return is_number(value)
    if isinstance(default, str):
        return isinstance(value, str)
    return True


def kind_name(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, (int, float)):
        return "a number"
    return "a string" if isinstance(default, str) else "valid"


# Options declared as ablations: config key -> the value the `modifications` sweep gives it, one row each beside the
# registries' entries (blocklab/modifications.py). An option joins the sweep by declaring itself where it is defined.
ABLATIONS: dict[str, Any] = {}


def declare_ablation(key: str, value: Any) -> None:
    """`key` (group.field, e.g. attn.softcap) set to `value` is a modification of its own."""
    if ABLATIONS.get(key, value) != value:
        raise ValueError(f"{key} is declared as an ablation twice, with {ABLATIONS[key]!r} and {value!r}")
    ABLATIONS[key] = value

