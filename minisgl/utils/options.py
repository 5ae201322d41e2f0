"""Options as dataclass fields: each field carries its default, help text and limits, and the command-line
flags, the keyword API (`LLM(**kw)`) and the range checks are derived from it. An option has one name (the
field's; its flag is the name with dashes) plus any older spellings listed as aliases.

    @dataclass
    class Config:
        page_size: int = option(1, help="tokens per KV page", min=1)
        tags: list[str] = field(default_factory=list)  # no `option`: set by code, never a flag

        def __post_init__(self) -> None:
            check(self)
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_KEY = "minisgl.option"


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """What a field needs besides its default to be an option."""

    help: str
    choices: tuple[str, ...] | None = None  # the accepted text (checked before `parse`)
    min: float | None = None
    max: float | None = None
    aliases: tuple[str, ...] = ()  # older names, accepted as keywords and as flags
    parse: Callable[[str], Any] | None = None  # text -> value (flags, and strings given as keywords)
    metavar: str | None = None  # the value's name in --help (default: N, X or VALUE by type)


class OptionError(ValueError):
    """A bad option value; `name` is the field, `problem` what is wrong with the value."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} {problem}")
        self.name = name
        self.problem = problem


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    choices: Sequence[str] | None = None,
    min: float | None = None,
    max: float | None = None,
    aliases: Sequence[str] = (),
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field that is an option (a flag, a keyword, checked by `check`)."""
    spec = OptionSpec(help, tuple(choices) if choices else None, min, max, tuple(aliases), parse, metavar)
    return dataclasses.field(default=default, metadata={_KEY: spec})


def spec_of(f: dataclasses.Field) -> OptionSpec | None:
    """The field's OptionSpec, or None for a field that is not an option."""
    return f.metadata.get(_KEY)


def options(cls: Any) -> list[dataclasses.Field]:
    """The fields of a dataclass (or instance) that are options, in declaration order."""
    return [f for f in dataclasses.fields(cls) if spec_of(f) is not None]


def flag(name: str) -> str:
    """The flag of a field or alias name: `max_running_req` -> `--max-running-req`."""
    return "--" + name.replace("_", "-")


def check(obj: Any) -> None:
    """Turn text values into values (`parse`) and refuse values outside their choices or range; call it from
    `__post_init__`. Raises OptionError naming the field."""
    for f in options(obj):
        spec, value = spec_of(f), getattr(obj, f.name)
        if isinstance(value, str) and spec.choices is not None and value not in spec.choices:
            raise OptionError(f.name, f"must be one of {', '.join(spec.choices)}, got {value!r}")
        if isinstance(value, str) and spec.parse is not None:
            value = spec.parse(value)
            setattr(obj, f.name, value)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        problem = _out_of_range(value, spec.min, spec.max)
        if problem:
            raise OptionError(f.name, problem)


def _out_of_range(value: float, lo: float | None, hi: float | None) -> str:
    if (lo is None or value >= lo) and (hi is None or value <= hi):
        return ""
    if hi is None:
        return f"must be >= {_num(lo)}, got {value}"
    if lo is None:
        return f"must be <= {_num(hi)}, got {value}"
    return f"must be in {_num(lo)}..{_num(hi)}, got {value}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def build(cls: type[T], kwargs: Mapping[str, Any], parser: argparse.ArgumentParser | None = None) -> T:
    """`cls(**kwargs)` where a keyword may be a field or an alias; an unknown keyword is a TypeError naming
    it. With `parser`, a bad value exits through `parser.error`, naming the flag."""
    names = _accepted_names(cls)
    resolved: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key not in names:
            close = difflib.get_close_matches(key, list(names), n=1)
            hint = f" (did you mean {names[close[0]]!r}?)" if close else ""
            raise TypeError(f"{cls.__name__} has no option {key!r}{hint}")
        name = names[key]
        if name in resolved:
            raise TypeError(f"{key!r} names the option {name!r} a second time")
        resolved[name] = value
    try:
        return cls(**resolved)
    except OptionError as e:
        if parser is None:
            raise
        parser.error(f"{flag(e.name)} {e.problem}")


def _accepted_names(cls: Any) -> dict[str, str]:
    names = {f.name: f.name for f in dataclasses.fields(cls) if f.init}
    for f in options(cls):
        names.update(dict.fromkeys(spec_of(f).aliases, f.name))
    return names


# ---- command line -----------------------------------------------------------------------------------------
def add_flags(
    parser: argparse.ArgumentParser,
    cls: Any,
    *,
    defaults: Mapping[str, Any] | None = None,
    lists: Iterable[str] = (),
) -> None:
    """Add one flag per option of `cls` (its aliases as extra spellings), grouped by the class that declares
    it. A flag left off the command line leaves its field's default to the dataclass, unless `defaults`
    names one for this parser. A field in `lists` takes comma-separated values (a sweep) and always lands
    in the namespace, as a list."""
    defaults, lists = dict(defaults or {}), set(lists)
    hints = typing.get_type_hints(cls)
    for owner in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):  # the base's first
        own = [f for f in options(owner) if f.name in vars(owner).get("__annotations__", {})]
        group = parser.add_argument_group(f"{owner.__name__} options") if own else None
        for f in own:
            _add_flag(group, f, _base_type(hints[f.name]), defaults, f.name in lists)


def _add_flag(group: Any, f: dataclasses.Field, kind: Any, defaults: dict[str, Any], as_list: bool) -> None:
    spec = spec_of(f)
    default = defaults.get(f.name, f.default)
    kw: dict[str, Any] = {"dest": f.name, "default": defaults.get(f.name, argparse.SUPPRESS)}
    if as_list:  # argparse runs a text default through `type` too, so the default becomes a list as well
        kw["type"] = _list_of(spec, str if spec.parse is not None else kind)
        kw["default"] = default if isinstance(default, str) else [default]
    elif kind is bool and spec.parse is None:
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = str if spec.parse is not None else kind
        kw["choices"] = spec.choices
    name = spec.metavar or {int: "N", float: "X"}.get(kind, "VALUE")
    if as_list:
        kw["metavar"] = ("{" + ",".join(spec.choices) + "}" if spec.choices else name) + "[,...]"
    elif "action" not in kw and not spec.choices:
        kw["metavar"] = name
    if f.name in defaults:
        note = f" (default here: {default})"
    elif default not in (None, "", dataclasses.MISSING) and "default" not in spec.help:
        note = f" (default: {default})"
    else:
        note = ""
    kw["help"] = (spec.help + note).replace("%", "%%")
    group.add_argument(flag(f.name), *map(flag, spec.aliases), **kw)


def given(ns: argparse.Namespace, cls: Any) -> dict[str, Any]:
    """The options of `cls` present in a namespace parsed with `add_flags`, by field name."""
    return {f.name: getattr(ns, f.name) for f in options(cls) if hasattr(ns, f.name)}


def _base_type(hint: Any) -> Any:
    """`int | None` -> int; the type argparse converts a flag's text to."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = tuple(a for a in args if a is not type(None))
        return args[0] if len(args) == 1 else str
    return hint if isinstance(hint, type) else str


def _list_of(spec: OptionSpec, convert: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        values = [v.strip() for v in text.split(",")]
        for v in values:
            if spec.choices is not None and v not in spec.choices:
                raise argparse.ArgumentTypeError(
                    f"invalid choice {v!r} (choose from {', '.join(spec.choices)})"
                )
        return [convert(v) for v in values]

    return parse
