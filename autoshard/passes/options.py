"""Pass options and their types: which annotations a pipeline spec can express, and how a
value of each prints and is described.

A pass's options are its dataclass fields; ``option_types`` reads their annotations once into a
small type model (a scalar, a ``Literal``, ``X | None``, a tuple), which the spec parser converts
written text against, ``format_value`` prints back, and ``check_option_values`` checks passes
built in Python against, and ``format_pass`` prints a whole pass. Kept apart from ``spec`` (the
text syntax) so each module has one job. The functions take any ``Pass`` (class or instance) but
do not import it: ``passes.base`` imports this module, as ``Pass.__str__`` prints through
``format_pass``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
import weakref
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Union

from autoshard.errors import InvalidArgumentTypeError, SpecError

__all__ = [
    "LiteralType",
    "OptionInfo",
    "OptionalType",
    "ScalarType",
    "TupleType",
    "check_option_values",
    "default_of",
    "describe",
    "format_pass",
    "format_value",
    "kebab",
    "matches",
    "option_table",
    "option_types",
]


class _Unsupported(Exception):
    pass


@dataclass(frozen=True)
class ScalarType:
    """``int``, ``float``, ``bool`` or ``str``."""

    kind: type  # int, float, bool or str


@dataclass(frozen=True)
class LiteralType:
    """``Literal[...]``: one of the listed values."""

    values: tuple[Any, ...]


@dataclass(frozen=True)
class OptionalType:
    """``X | None``, written ``none``."""

    inner: Any


@dataclass(frozen=True)
class TupleType:
    """``tuple[X, ...]`` (``elem``) or ``tuple[X, Y]`` (``items``), written comma-separated."""

    elem: Any = None  # tuple[elem, ...]
    items: tuple[Any, ...] | None = None  # tuple[a, b]


_SCALARS = (bool, int, float, str)


def _normalize(tp: Any, *, in_tuple: bool = False) -> Any:
    if tp in _SCALARS:
        return ScalarType(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if not args or not all(type(a) in _SCALARS for a in args):
            raise _Unsupported("Literal members must be str, int, float or bool")
        return LiteralType(args)
    if origin is Union or origin is types.UnionType:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(rest) == len(args):
            raise _Unsupported("the only union it can express is `X | None`")
        inner = _normalize(rest[0], in_tuple=in_tuple)
        if isinstance(inner, TupleType) and any(isinstance(i, OptionalType)
                                                for i in (inner.elem, *(inner.items or ()))):
            raise _Unsupported("in `tuple[X | None, ...] | None` the value `none` would be ambiguous")
        return OptionalType(inner)
    if origin is tuple or tp is tuple:
        if in_tuple:
            raise _Unsupported("tuples cannot nest")
        if len(args) == 2 and args[1] is Ellipsis:
            return TupleType(elem=_normalize(args[0], in_tuple=True))
        if not args or args == ((),):
            raise _Unsupported("give the item type, e.g. tuple[int, ...]")
        return TupleType(items=tuple(_normalize(a, in_tuple=True) for a in args))
    raise _Unsupported("supported: int, float, bool, str, Literal[...], X | None, tuple[X, ...]")


_TYPE_CACHE: "weakref.WeakKeyDictionary[type, dict[str, Any]]" = weakref.WeakKeyDictionary()


def kebab(field_name: str) -> str:
    """The text key of an option field: ``max_depth`` -> ``max-depth``."""
    return field_name.replace("_", "-")


def _resolve_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # some unrelated annotation in the MRO does not resolve; go field by field
        pass
    hints: dict[str, Any] = {}
    for f in cls.options():
        tp = f.type
        if isinstance(tp, str):
            owner = next((c for c in cls.__mro__ if f.name in c.__dict__.get("__annotations__", {})), cls)
            namespace = dict(vars(sys.modules.get(owner.__module__, typing)))
            try:
                tp = eval(tp, namespace, dict(vars(owner)))  # noqa: S307 - annotations are code by definition
            except Exception as exc:
                raise SpecError(
                    f"cannot resolve the annotation {f.type!r} of option '{kebab(f.name)}' of pass "
                    f"'{cls.name}': {type(exc).__name__}: {exc}"
                ) from exc
        hints[f.name] = tp
    return hints


def option_types(cls: type) -> dict[str, Any]:
    """Map each option field of ``cls`` to its (internal) type; ``SpecError`` for types the syntax cannot express."""
    cached = _TYPE_CACHE.get(cls)
    if cached is not None:
        return cached
    hints = _resolve_hints(cls)
    out: dict[str, Any] = {}
    for f in cls.options():
        tp = hints.get(f.name, f.type)
        try:
            out[f.name] = _normalize(tp)
        except _Unsupported as exc:
            raise SpecError(
                f"option '{kebab(f.name)}' of pass '{cls.name}' has type {_type_name(tp)}, which pass specs "
                f"cannot express: {exc}"
            ) from None
        default = default_of(f)
        if default is not dataclasses.MISSING and not matches(default, out[f.name]):
            raise SpecError(
                f"option '{kebab(f.name)}' of pass '{cls.name}' has default {default!r}, "
                f"which is not {describe(out[f.name])}"
            )
    _TYPE_CACHE[cls] = out
    return out


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


_ARTICLE = {int: "an int", float: "a float", bool: "a bool (true or false)", str: "a string"}
_PLURAL = {int: "ints", float: "floats", bool: "bools (true or false)", str: "strings"}


def describe(t: Any, plural: bool = False) -> str:
    if isinstance(t, ScalarType):
        return (_PLURAL if plural else _ARTICLE)[t.kind]
    if isinstance(t, LiteralType):
        return ("values from " if plural else "one of ") + ", ".join(f"'{_format(v, _lit_type(v))}'" for v in t.values)
    if isinstance(t, OptionalType):
        return f"{describe(t.inner, plural)} or none"
    if isinstance(t, TupleType):
        if t.elem is not None:
            return f"a comma-separated list of {describe(t.elem, plural=True)}"
        return f"{len(t.items)} comma-separated values ({', '.join(describe(i) for i in t.items)})"
    raise AssertionError(t)  # pragma: no cover


def _lit_type(v: Any) -> ScalarType:
    return ScalarType(type(v))


def matches(value: Any, t: Any) -> bool:
    """Whether a Python value fits type ``t`` (and so prints and parses back equal)."""
    if isinstance(t, ScalarType):
        if t.kind is bool:
            return isinstance(value, bool)
        if t.kind is int:
            return isinstance(value, int) and not isinstance(value, bool)
        if t.kind is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        return isinstance(value, str)
    if isinstance(t, LiteralType):
        return any(type(value) is type(m) and value == m for m in t.values)
    if isinstance(t, OptionalType):
        return value is None or matches(value, t.inner)
    if isinstance(t, TupleType):
        if not isinstance(value, tuple):
            return False
        if t.elem is not None:
            return all(matches(v, t.elem) for v in value)
        return len(value) == len(t.items) and all(matches(v, i) for v, i in zip(value, t.items))
    raise AssertionError(t)  # pragma: no cover


def check_option_values(p: Any) -> None:
    """Raise ``InvalidArgumentTypeError`` if an option of a pass built in Python has the wrong type."""
    cls = type(p)
    for name, t in option_types(cls).items():
        value = getattr(p, name)
        if not matches(value, t):
            hint = " (use a tuple)" if isinstance(t, (TupleType, OptionalType)) and isinstance(value, list) else ""
            raise InvalidArgumentTypeError(
                f"option '{kebab(name)}' of pass '{cls.name}' expects {describe(t)}, "
                f"got {value!r} ({type(value).__name__}){hint}"
            )


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------
_SAFE_BARE = re.compile(r"[A-Za-z0-9_.+\-/:@%]+")
_QUOTE = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _quote(s: str) -> str:
    return '"' + "".join(_QUOTE.get(c, c) for c in s) + '"'


def _format(value: Any, t: Any, none_ok: bool = False) -> str:
    if isinstance(t, OptionalType):
        return "none" if value is None else _format(value, t.inner, none_ok=True)
    if isinstance(t, LiteralType):
        return _format(value, _lit_type(value), none_ok)
    if isinstance(t, TupleType):
        item_types = [t.elem] * len(value) if t.elem is not None else t.items
        # inside `tuple[str, ...] | None`, a lone bare "none" would read back as None
        return ",".join(_format(v, it, none_ok) for v, it in zip(value, item_types))
    kind = t.kind
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return str(int(value))
    if kind is float:  # a whole number without its ".0" (a byte budget reads max-memory=614400); parses back equal
        text = repr(float(value))
        return text[:-2] if text.endswith(".0") else text
    if _SAFE_BARE.fullmatch(value) and not (none_ok and value == "none"):
        return value
    return _quote(value)


def format_value(value: Any, t: Any) -> str:
    """Print one option value so that it parses back equal (``t`` from ``option_types``)."""
    return _format(value, t)


# --------------------------------------------------------------------------------------------
# Documentation helpers
# --------------------------------------------------------------------------------------------
class OptionInfo(NamedTuple):
    """One row of a pass's option table, e.g. for ``autoshard passes``."""

    key: str
    field: str
    type: str
    default: str | None  # printed as in a spec; None when the option is required
    help: str


def option_table(cls: type) -> tuple[OptionInfo, ...]:
    kinds = option_types(cls)
    rows = []
    for f in cls.options():
        default = default_of(f)
        shown = None if default is dataclasses.MISSING else _format(default, kinds[f.name])
        rows.append(OptionInfo(kebab(f.name), f.name, describe(kinds[f.name]), shown, f.metadata.get("help", "")))
    return tuple(rows)


def format_pass(p: Any, explicit: frozenset[str] | set[str] | tuple[str, ...] = frozenset()) -> str:
    """The canonical spec of one pass: its name, then (in field order) the options that are
    required, not at their default, or named in ``explicit``."""
    cls = type(p)
    kinds = option_types(cls)
    parts = []
    for f in cls.options():
        value = getattr(p, f.name)
        default = default_of(f)
        if f.name in explicit or default is dataclasses.MISSING or not _same(value, default):
            parts.append(f"{kebab(f.name)}={format_value(value, kinds[f.name])}")
    return cls.name + ("{" + " ".join(parts) + "}" if parts else "")


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # pragma: no cover - exotic __eq__
        return False
