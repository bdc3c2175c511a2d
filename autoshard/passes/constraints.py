"""``SplitConstraints``: what the split must keep, as data any pass can add to.

The ``constraints`` artifact carries module-level constraints from the passes that add them
(``pin``, ``no-split``, ``cut-before``, or a user's pass) to the split, which resolves them to
nodes of its DAG (``autoshard.graph.scopes``) and hands them to ``split_dag`` with its own
options. Names, not nodes: a constraint written before capture holds for any graph of the model,
which is what lets a plan keep its weights in their stages when the model is captured again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError


@dataclass(frozen=True)
class SplitConstraints:
    """``pins``: ``(name, stage)`` pairs, each holding a module path, class or weight to a stage;
    ``no_split``: module paths or classes kept whole; ``cut_before``: module paths a stage starts at;
    ``optional``: names that may be missing from the graph (a weight this capture does not read
    pins nothing, a module this branch does not run is kept whole or cut before nowhere), where
    other names missing are refused."""

    pins: tuple[tuple[str, int], ...] = ()
    no_split: tuple[str, ...] = ()
    cut_before: tuple[str, ...] = ()
    optional: frozenset[str] = frozenset()

    def adding(self, pins: Iterable[tuple[str, int]] = (), no_split: Iterable[str] = (),
               cut_before: Iterable[str] = (), optional: bool = False) -> SplitConstraints:
        """These constraints and more (``optional``: the new names may be missing from the graph); a
        name pinned twice must be pinned to one stage."""
        pins, no_split, cut_before = tuple(pins), tuple(no_split), tuple(cut_before)
        merged = dict(self.pins)
        for name, stage in pins:
            if merged.setdefault(name, stage) != stage:
                raise InvalidArgumentError(
                    f"pin: {name!r} is pinned to stage {merged[name]} and to stage {stage}; pin it once")
        return replace(self, pins=tuple(merged.items()),
                       optional=self.optional | {*(name for name, _ in pins), *no_split, *cut_before}
                       if optional else self.optional,
                       no_split=tuple(dict.fromkeys((*self.no_split, *no_split))),
                       cut_before=tuple(dict.fromkeys((*self.cut_before, *cut_before))))

    def names(self) -> list[str]:
        """The kinds set, for messages: ``pin``, ``no-split``, ``cut-before``."""
        return [name for name, value in (("pin", self.pins), ("no-split", self.no_split),
                                         ("cut-before", self.cut_before)) if value]


def pins_of(pin: Any) -> tuple[tuple[str, int], ...]:
    """``shard_model``'s ``pin={name: stage}`` checked: names are strings, stages whole numbers >= 0."""
    if not isinstance(pin, Mapping):
        raise InvalidArgumentTypeError(f"pin must be a {{module, class or weight name: stage}} mapping, got {pin!r}")
    for name, stage in pin.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgumentTypeError(f"pin: each key must be a module path, class or weight name, got {name!r}")
        if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
            raise InvalidArgumentError(f"pin[{name!r}] must be a stage number >= 0, got {stage!r}")
    return tuple(pin.items())


def names_of(option: str, names: Any) -> tuple[str, ...]:
    """A list of module paths or class names (one string is one name)."""
    names = (names,) if isinstance(names, str) else names
    if not isinstance(names, Iterable) or not all(isinstance(n, str) and n for n in names):
        raise InvalidArgumentTypeError(f"{option} must be a list of module paths or class names, got {names!r}")
    return tuple(names)
