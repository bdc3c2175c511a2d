"""An input guard written as code: the checks a passing call makes, as one straight function.

``check_inputs`` runs once per microbatch. Read from the guard's fields it walks them on every
call (a dict argument's layout, each leaf's dtype, each shape), 20 us on a dict of two tensors.
``accepting`` writes the same checks out once per guard as Python over closure constants (like
``held_state.kept_check``): a call they pass returns the graph's inputs at once; anything else (a
check that fails, an exception, a layout the code does not cover) returns None, and the guard's
own walk decides and names the problem. The code only ever accepts what the walk accepts, with
the same values returned; a guard it cannot write returns no function, and the walk runs alone.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import torch

from autoshard.capture.structure import same_constant

#: The channels-last memory format of a tensor of each rank that has one.
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


#: What a condition may call besides the inputs: the names torch's printer of size expressions emits.
CONDITION_NAMES = {"math": math, "max": max, "min": min, "abs": abs}


class _Writer:
    """The lines of an ``accept`` function and the constants they read (``c0``, ``c1``, ...)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.constants: list[Any] = []
        self.names = 0

    def constant(self, value: Any) -> str:
        self.constants.append(value)
        return f"c{len(self.constants) - 1}"

    def fresh(self) -> str:
        self.names += 1
        return f"t{self.names}"

    def refuse_unless(self, test: str) -> None:
        self.lines.append(f"if not ({test}): return None")

    def container(self, value: str, spec: Any, where: dict[str, str], leaves: list[tuple[str, Any]]) -> bool:
        """Lines that accept ``value`` where it is laid out as ``spec`` exactly (as
        ``structure._leaves_in_layout`` reads it), binding each leaf to a name in ``where`` under its
        full name (``leaves``: the structure's, in order, each with its full name); False where the
        spec holds a container the walk does not read."""
        kind = spec.type
        if kind is None:
            path, leaf = leaves.pop(0)
            where[path] = value
            if isinstance(leaf, torch.dtype):  # a tensor of its dtype
                self.refuse_unless(f"isinstance({value}, Tensor) and {value}.dtype == {self.constant(leaf)}")
            else:  # the same constant (of its type: no container, which pytree would have opened, nor tensor)
                expected = self.constant(leaf)
                self.refuse_unless(f"{value} is {expected} or same({value}, {expected})")
            return True
        if kind not in (dict, list, tuple):
            return False
        self.refuse_unless(f"type({value}) is {kind.__name__} and len({value}) == {spec.num_children}")
        items = [self.fresh() for _ in range(spec.num_children)]
        if not items:
            return True
        if kind is dict:  # its keys in the captured order, each of the captured key's type
            keys = [self.fresh() for _ in items]
            self.lines.append(f"{''.join(k + ', ' for k in keys)}= {value}")
            self.refuse_unless(" and ".join(f"type({k}) is {self.constant(type(then))} and {k} == {self.constant(then)}"
                                            for k, then in zip(keys, spec.context)))
        self.lines.append(f"{''.join(i + ', ' for i in items)}= {value}{'.values()' if kind is dict else ''}")
        return all(self.container(item, child, where, leaves) for item, child in zip(items, spec.children()))

    def shape(self, value: str, dims: tuple[Any, ...], symbols: dict[str, str]) -> None:
        """Lines that accept tensor ``value`` of ``dims``' rank, fixed sizes and ranges, a symbol's
        size the same wherever it appears (``InputGuard.size_problem``)."""
        shape = self.fresh()
        self.refuse_unless(f"isinstance({value}, Tensor)")
        self.lines.append(f"{shape} = {value}.shape")
        self.refuse_unless(f"len({shape}) == {len(dims)}")
        for axis, dim in enumerate(dims):
            size = f"{shape}[{axis}]"
            if dim.size is not None:
                self.refuse_unless(f"{size} == {int(dim.size)}")
                continue
            if not dim.symbol:  # any size (``DimSpec()``)
                continue
            if dim.symbol in symbols:
                self.refuse_unless(f"{size} == {symbols[dim.symbol]}")
            else:
                symbols[dim.symbol] = self.fresh()
                self.lines.append(f"{symbols[dim.symbol]} = {size}")
            bounds = [f"{int(dim.low)} <= {symbols[dim.symbol]}"]  # each dim's own (as the walk checks them)
            bounds += [f"{symbols[dim.symbol]} <= {int(dim.high)}"] if dim.high is not None else []
            self.refuse_unless(" and ".join(bounds))


def accepting(guard: Any, holds: Callable[[str, Any], bool]) -> Callable[..., tuple[Any, ...] | None] | None:
    """``accept(*values)`` for ``guard`` (an ``InputGuard``): the graph's inputs where every check
    passes, else None; None where a container argument is of a kind the code does not read (a
    namedtuple, an ``OrderedDict``). ``holds(condition, values)`` decides a condition on sizes."""
    writer = _Writer()
    arguments = [f"v{i}" for i in range(len(guard.names))]
    where = dict(zip(guard.names, arguments))
    for name, value in list(where.items()):  # (containers add their leaves)
        if name in guard.constants:
            expected = writer.constant(guard.constants[name])
            writer.refuse_unless(f"{value} is {expected} or same({value}, {expected})")
            if name in guard.snapshots:  # the same object, changed in place since, is refused
                writer.refuse_unless(f"same({value}, {writer.constant(guard.snapshots[name])})")
        if name in guard.structures:
            structure = guard.structures[name]
            leaves = [(name + path, leaf) for path, leaf in zip(structure.paths, structure.leaves)]
            if not writer.container(value, structure.spec, where, leaves):
                return None
    for default, then in guard.default_snapshots.values():
        writer.refuse_unless(f"same({writer.constant(default)}, {writer.constant(then)})")
    for name, dtype in guard.dtypes.items():
        writer.refuse_unless(f"isinstance({where[name]}, Tensor) and {where[name]}.dtype == {writer.constant(dtype)}")
    symbols: dict[str, str] = {}
    for name, dims in guard.shapes.items():
        writer.shape(where[name], dims, symbols)
    for name, (requires_grad, contiguous, channels_last) in guard.layouts.items():
        value, rank = where[name], len(guard.shapes[name])
        laid = f" and {value}.is_contiguous(memory_format={writer.constant(CHANNELS_LAST[rank])}) is {channels_last}" \
            if rank in CHANNELS_LAST else ""
        writer.refuse_unless(f"isinstance({value}, Tensor) and {value}.requires_grad is {requires_grad} "
                             f"and {value}.is_contiguous() is {contiguous}{laid}")
    for name, strides in guard.strides.items():
        writer.refuse_unless(f"{where[name]}.stride() == {writer.constant(strides)}")
    for name, offset in guard.offsets.items():
        writer.refuse_unless(f"{where[name]}.storage_offset() == {offset}")
    argument_of = dict(zip(guard.names, arguments))
    conditions = (*guard.conditions, *guard.checked_early)
    inline = ["" if _implied(condition, guard.shapes) else _inlined(condition, argument_of)
              for condition in conditions]
    for condition, code in zip(conditions, inline):
        if code:  # written out: no dict of the arguments, no eval
            writer.refuse_unless(f"bool({code})")
    if None in inline:
        named = ", ".join(f"{writer.constant(name)}: {value}" for name, value in zip(guard.names, arguments))
        writer.lines.append(f"named = {{{named}}}")
        for condition, code in zip(conditions, inline):
            if code is None:
                writer.refuse_unless(f"holds({writer.constant(condition)}, named)")
    returned = "".join(where[name] + ", " for name in guard.returns)
    body = "".join(f"            {line}\n" for line in writer.lines or ["pass"])
    names = "".join(f"c{i}, " for i in range(len(writer.constants)))
    unpacked = f"    {names}= constants\n" if names else ""
    source = ("def make(constants):\n" + unpacked
              + f"    def accept({', '.join(arguments)}):\n"
              + "        try:\n" + body
              + "        except Exception:\n"
              + "            return None\n"
              + f"        return ({returned})\n"
              + "    return accept\n")
    namespace: dict[str, Any] = {"Tensor": torch.Tensor, "same": same_constant, "holds": holds, **CONDITION_NAMES}
    exec(compile(source, "<autoshard input guard>", "exec"), namespace)  # noqa: S102 - our own text
    return namespace["make"](writer.constants)


_ARGUMENT = re.compile(r"L\['([^']+)'\]")


def _inlined(condition: str, argument_of: dict[str, str]) -> str | None:
    """``condition`` over the accept function's arguments (``L['x'].size()[0]`` as ``v0.size()[0]``),
    or None where it names something else; an exception it raises refuses the call, as ``holds`` does."""
    names = _ARGUMENT.findall(condition)
    if not names or any(name not in argument_of for name in names) or re.search(r"\bL\b", _ARGUMENT.sub("", condition)):
        return None
    return f"({_ARGUMENT.sub(lambda m: argument_of[m.group(1)], condition)})"


_SAME_SIZE = re.compile(r"L\['([^']+)'\]\.size\(\)\[(\d+)\] == L\['([^']+)'\]\.size\(\)\[(\d+)\]")


def _implied(condition: str, shapes: dict[str, Any]) -> bool:
    """Whether ``condition`` equates two sizes the shape checks already hold equal (one symbol)."""
    match = _SAME_SIZE.fullmatch(condition.strip())
    if match is None:
        return False
    first, i, second, j = match.groups()
    try:
        a, b = shapes[first][int(i)], shapes[second][int(j)]
    except (KeyError, IndexError):
        return False
    return a.size is None and b.size is None and bool(a.symbol) and a.symbol == b.symbol
