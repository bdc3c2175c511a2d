"""The pipeline text syntax: parse and print ``trace,split{stages=4 cost=flops no-split=a,b}``.

Grammar (the flat MLIR/xDSL subset; we have one IR level, so no nesting)::

    pipeline ::= (element ("," element)*)?
    element  ::= name ("{" (option (" " option)*)? "}")?
    option   ::= key ("=" (value ("," value)*)?)?
    value    ::= bare | '"' chars '"'           (escapes in quotes: \\\\ \\" \\n \\r \\t)

Keys are the option fields in kebab-case (``max-depth`` -> ``max_depth``). Values are typed by the
field annotation: ``int``, ``float``, ``bool`` (``true``/``false``; a bare key means ``true``), ``str``,
``Literal[...]``, ``X | None`` (written ``none``) and ``tuple[X, ...]`` or fixed ``tuple[X, Y]``
(comma-separated; ``key=`` is the empty tuple). Whitespace is allowed around ``,`` ``{`` ``}``
between elements, but the canonical form printed by ``format_pass`` has none.

Every syntax or typing problem raises ``SpecError`` whose message shows the spec with a caret
under the offending text; the error also carries ``spec``, ``line``, ``column`` and ``span``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from autoshard.errors import AutoshardError, InvalidArgumentTypeError, SpecError, suggest
from autoshard.passes.base import Pass
from autoshard.passes.options import (LiteralType, OptionalType, ScalarType, TupleType, default_of, describe,
                                      format_pass, format_value, kebab, option_types)
from autoshard.passes.registry import PassRegistry, default_registry

__all__ = [
    "OptionSpec",
    "PassSpec",
    "ValueSpec",
    "format_pass",
    "instantiate",
    "parse_passes",
    "parse_spec",
    "spec_error",
]


# --------------------------------------------------------------------------------------------
# Syntax tree
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ValueSpec:
    """One value as written; ``quoted`` values are always strings."""

    text: str
    quoted: bool
    start: int
    end: int


@dataclass(frozen=True)
class OptionSpec:
    """``key=v1,v2`` as written; ``values`` is ``None`` for a bare key."""

    key: str
    values: tuple[ValueSpec, ...] | None
    start: int
    end: int

    @property
    def key_end(self) -> int:
        return self.start + len(self.key)


@dataclass(frozen=True)
class PassSpec:
    """One pipeline element as written: a name and its options, with source offsets."""

    name: str
    options: tuple[OptionSpec, ...]
    start: int
    end: int

    @property
    def name_end(self) -> int:
        return self.start + len(self.name)


def _locate(text: str, pos: int) -> tuple[int, int, int]:
    """(1-based line, 1-based column, offset of the line start) of ``text[pos]``."""
    line_start = text.rfind("\n", 0, pos) + 1
    return text.count("\n", 0, pos) + 1, pos - line_start + 1, line_start


def spec_error(message: str, text: str, start: int, end: int | None = None) -> SpecError:
    """A ``SpecError`` for ``text[start:end]``: the message, then the spec line with a caret under it.

    The error also carries ``reason`` (the message alone), ``spec``, ``line``, ``column`` (1-based)
    and ``span`` (offsets into ``spec``).
    """
    start = max(0, min(start, len(text)))
    end = max(start + 1, end if end is not None else start + 1)
    line_no, column, line_start = _locate(text, start)
    line_end = text.find("\n", start)
    if line_end == -1:
        line_end = len(text)
    width = max(1, min(end, line_end) - start)
    where = f"column {column}" if "\n" not in text else f"line {line_no}, column {column}"
    shown = text[line_start:line_end].replace("\t", " ")
    err = SpecError(f"{message}\n  {shown}\n  {' ' * (column - 1)}{'^' * width} {where}")
    err.reason = message  # type: ignore[attr-defined]
    err.spec = text  # type: ignore[attr-defined]
    err.line = line_no  # type: ignore[attr-defined]
    err.column = column  # type: ignore[attr-defined]
    err.span = (start, end)  # type: ignore[attr-defined]
    return err


# --------------------------------------------------------------------------------------------
# Lexing and parsing (syntax only)
# --------------------------------------------------------------------------------------------
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_BARE = re.compile(r'[^\s,{}="]+')
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "r": "\r", "t": "\t"}


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, message: str, start: int | None = None, end: int | None = None) -> SpecError:
        return spec_error(message, self.text, self.pos if start is None else start, end)

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def shown(self) -> str:
        return f"'{self.peek()}'" if self.peek() else "the end of the spec"

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def word(self, pattern: re.Pattern[str]) -> str | None:
        m = pattern.match(self.text, self.pos)
        if not m:
            return None
        self.pos = m.end()
        return m.group()

    def pipeline(self) -> tuple[PassSpec, ...]:
        self.skip_ws()
        if self.at_end():
            return ()
        elements = [self.element()]
        while True:
            self.skip_ws()
            if self.at_end():
                return tuple(elements)
            c = self.peek()
            if c == ",":
                self.pos += 1
                self.skip_ws()
                elements.append(self.element())
            elif c == "}":
                raise self.error("unexpected '}' (no matching '{')")
            else:
                raise self.error(f"expected ',' between passes, got {self.shown()}")

    def ascii_name(self, kind: str, name: str) -> None:
        """Refuse a name running into a non-ASCII character, which would otherwise be reported as a
        missing separator after the name's ASCII part."""
        if self.peek() and not self.peek().isascii():
            raise self.error(f"unexpected {self.shown()} in {kind} '{name}...': names use ASCII letters, digits, "
                             "'-', '_' and '.'")

    def element(self) -> PassSpec:
        start = self.pos
        name = self.word(_NAME)
        if name is None:
            raise self.error(f"expected a pass name, got {self.shown()}")
        self.ascii_name("pass name", name)
        after_name = self.pos
        self.skip_ws()
        if self.peek() != "{":
            self.pos = after_name
            return PassSpec(name, (), start, after_name)
        brace = self.pos
        self.pos += 1
        options: list[OptionSpec] = []
        while True:
            self.skip_ws()
            if self.at_end():
                raise self.error(f"unclosed '{{' of pass '{name}': expected '}}'", brace)
            if self.peek() == "}":
                self.pos += 1
                return PassSpec(name, tuple(options), start, self.pos)
            options.append(self.option(name))

    def option(self, pass_name: str) -> OptionSpec:
        start = self.pos
        key = self.word(_NAME)
        if key is None:
            raise self.error(f"expected an option name or '}}' in the options of '{pass_name}', got {self.shown()}")
        self.ascii_name("option name", key)
        gap = self.pos
        while gap < len(self.text) and self.text[gap].isspace():
            gap += 1
        if gap > self.pos and self.text[gap:gap + 1] == "=":
            raise self.error(f"no spaces around '=' in an option: write {key}=...", self.pos, gap + 1)
        values: tuple[ValueSpec, ...] | None = None
        if self.peek() == "=":
            self.pos += 1
            values = self.values()
        c = self.peek()
        if c and not c.isspace() and c != "}":
            if c == "," and values is None:
                raise self.error("unexpected ',': options are separated by spaces, not commas")
            if c == "=" and values is not None and len(values) > 1:
                comma = values[-1].start - 1
                raise self.error("options are separated by spaces, not commas", comma, comma + 1)
            raise self.error(f"expected a space or '}}' after option '{key}', got {self.shown()}")
        return OptionSpec(key, values, start, self.pos)

    def values(self) -> tuple[ValueSpec, ...]:
        c = self.peek()
        if not c or c.isspace() or c == "}":
            return ()  # `key=`: the empty list
        items = [self.value()]
        while self.peek() == ",":
            self.pos += 1
            if self.peek().isspace():
                raise self.error("no spaces after ',' in a list of values: write a,b (quote a value that holds "
                                 "spaces or commas)")
            items.append(self.value())
        return tuple(items)

    def value(self) -> ValueSpec:
        start = self.pos
        if self.peek() == '"':
            self.pos += 1
            chars: list[str] = []
            while True:
                if self.at_end():
                    raise self.error("unterminated string: expected a closing '\"'", start)
                c = self.text[self.pos]
                if c == '"':
                    self.pos += 1
                    return ValueSpec("".join(chars), True, start, self.pos)
                if c == "\\":
                    esc = self.text[self.pos + 1 : self.pos + 2]
                    if esc not in _ESCAPES:
                        raise self.error(
                            "unknown escape in string: use \\\\, \\\", \\n, \\r or \\t", self.pos, self.pos + 2
                        )
                    chars.append(_ESCAPES[esc])
                    self.pos += 2
                else:
                    chars.append(c)
                    self.pos += 1
        text = self.word(_BARE)
        if text is None:
            raise self.error(f"expected a value, got {self.shown()}")
        return ValueSpec(text, False, start, self.pos)


def parse_spec(text: str) -> tuple[PassSpec, ...]:
    """Parse the syntax of a pipeline spec, without looking any name up."""
    if not isinstance(text, str):
        raise InvalidArgumentTypeError(f"a pipeline spec must be a str, got {type(text).__name__}")
    return _Parser(text).pipeline()


# --------------------------------------------------------------------------------------------
# Typing the values of a parsed element
# --------------------------------------------------------------------------------------------
class _BadValue(Exception):
    def __init__(self, value: ValueSpec | None) -> None:
        self.value = value


def _scalar(v: ValueSpec, t: Any) -> Any:
    """Convert one written value; raises ``_BadValue`` when it does not fit ``t``."""
    if isinstance(t, OptionalType):
        if not v.quoted and v.text == "none":
            return None
        return _scalar(v, t.inner)
    if isinstance(t, LiteralType):
        for m in t.values:
            if isinstance(m, str):
                if v.text == m:
                    return m
            elif not v.quoted:
                try:
                    if _scalar(v, ScalarType(type(m))) == m:
                        return m
                except _BadValue:
                    pass
        raise _BadValue(v)
    kind = t.kind
    if kind is str:
        return v.text
    if v.quoted:
        raise _BadValue(v)
    if kind is bool:
        if v.text in ("true", "false"):
            return v.text == "true"
        raise _BadValue(v)
    try:
        return int(v.text, 10) if kind is int else float(v.text)
    except ValueError:
        raise _BadValue(v) from None


def _convert(opt: OptionSpec, t: Any) -> Any:
    values = opt.values
    if values is None:  # bare key
        inner = t.inner if isinstance(t, OptionalType) else t
        if isinstance(inner, ScalarType) and inner.kind is bool:
            return True
        raise _BadValue(None)
    base = t.inner if isinstance(t, OptionalType) else t
    if isinstance(base, TupleType):
        if isinstance(t, OptionalType) and len(values) == 1 and not values[0].quoted and values[0].text == "none":
            return None
        if base.elem is not None:
            return tuple(_scalar(v, base.elem) for v in values)
        if len(values) != len(base.items):
            raise _BadValue(None)
        return tuple(_scalar(v, it) for v, it in zip(values, base.items))
    if len(values) != 1:
        raise _BadValue(None)
    return _scalar(values[0], t)


def _passes_taking(registry: PassRegistry, option: str, besides: str) -> str:
    """Where an option unknown to one pass belongs (``time-limit`` is ``split-exact``'s, not
    ``split``'s), as a hint; empty when no other pass takes it."""
    others = [p.name for p in registry.passes() if p.name != besides and option in {f.name for f in p.options()}]
    if not others:
        return ""
    return f" (pass {' and '.join(repr(o) for o in others[:3])} take{'s' if len(others) == 1 else ''} it)"


def instantiate(element: PassSpec, text: str, registry: PassRegistry | None = None) -> tuple[Pass, frozenset[str]]:
    """Look up and construct one parsed element; returns the pass and the option fields written."""
    registry = default_registry if registry is None else registry
    try:
        cls = registry.get(element.name)
    except SpecError as exc:
        raise spec_error(str(exc), text, element.start, element.name_end) from exc
    kinds = option_types(cls)
    fields = {f.name: f for f in cls.options()}
    kwargs: dict[str, Any] = {}
    first: dict[str, OptionSpec] = {}
    for opt in element.options:
        fname = opt.key.replace("-", "_")
        if fname not in fields:
            keys = [kebab(n) for n in fields]
            hint = suggest(opt.key, keys)
            if not hint:
                hint = f"; its options are: {', '.join(keys)}" if keys else f"; '{cls.name}' takes no options"
            hint += _passes_taking(registry, fname, cls.name)
            raise spec_error(f"unknown option '{opt.key}' for pass '{cls.name}'{hint}", text, opt.start, opt.key_end)
        if fname in first:
            _, col, _ = _locate(text, first[fname].start)
            raise spec_error(
                f"option '{kebab(fname)}' of '{cls.name}' is given twice (first at column {col})",
                text,
                opt.start,
                opt.key_end,
            )
        first[fname] = opt
        try:
            kwargs[fname] = _convert(opt, kinds[fname])
        except _BadValue as bad:
            expected = describe(kinds[fname])
            key = kebab(fname)
            if opt.values is None:
                raise spec_error(
                    f"option '{key}' of '{cls.name}' needs a value ({expected}): write {key}=...",
                    text, opt.start, opt.end,
                ) from None
            if bad.value is None:
                got = f"{len(opt.values)} values" if opt.values else "nothing"
                span = (opt.values[0].start, opt.values[-1].end) if opt.values else (opt.key_end, opt.end)
                raise spec_error(f"option '{key}' of '{cls.name}' expects {expected}, got {got}", text, *span) from None
            lit = kinds[fname].inner if isinstance(kinds[fname], OptionalType) else kinds[fname]
            written = [format_value(m, ScalarType(type(m))) for m in lit.values] if isinstance(lit, LiteralType) else []
            hint = suggest(bad.value.text, written) if written else ""
            raise spec_error(
                f"option '{key}' of '{cls.name}' expects {expected}, got '{bad.value.text}'{hint}",
                text, bad.value.start, bad.value.end,
            ) from None
    for name, f in fields.items():
        if name not in kwargs and default_of(f) is dataclasses.MISSING:
            raise spec_error(
                f"missing required option '{kebab(name)}' for pass '{cls.name}' ({describe(kinds[name])}): "
                f"write {cls.name}{{{kebab(name)}=...}}",
                text, element.start, element.end,
            )
    try:
        instance = cls(**kwargs)
    except (ValueError, TypeError) as exc:
        located = spec_error(f"invalid options for pass '{cls.name}': {exc}", text, element.start, element.end)
        if isinstance(exc, AutoshardError):  # a typed error from the pass's own checks keeps its type
            exc.add_note("in the pass spec:\n" + str(located).split("\n", 1)[1])
            raise
        raise located from exc
    return instance, frozenset(kwargs)


def parse_passes(text: str, registry: PassRegistry | None = None) -> list[tuple[Pass, frozenset[str]]]:
    """Parse a spec into ``(pass, explicitly written option fields)`` pairs."""
    return [instantiate(e, text, registry) for e in parse_spec(text)]
