"""Checks on sizes the forward computes, written over the inputs' sizes and checked first.

A check on a value's size stays after the layer computing that value (``check_order``): a branch on
a batch norm's output width (``if x.shape[-1] > 32:``) refuses another image size only once the
batch norm has updated its statistics, so in training mode that call cannot be run again on
another plan. Run once on fake tensors whose sizes are symbols (torch's ``ShapeEnv``, as
torch.export does), the graph gives each such check's condition over the inputs' sizes
(``L['x'].size()[3] > 32``); the input guard checks those first, before anything computes, and
the check itself stays where it is. A condition the run cannot give (code that reads tensor values,
a size the run fixed, a container's tensor) is left to the check alone.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._pytree import MappingKey, keystr, tree_leaves, tree_map_with_path
from torch.utils._sympy.printers import PythonPrinter

from autoshard.capture.check_order import condition_and_operands
from autoshard.capture.guard import ASSUMED_OF_EVERY_SIZE, SIZE_CHECKS, check_inputs, check_site, holds
from autoshard.capture.reruns import rerun_of_nodes
from autoshard.costs.execution import placeholder_values
from autoshard.inputs import ExampleInputs
from autoshard.isolation import PlainInterpreter, grad_mode_unchecked, isolated

#: The nodes that only unpack the inputs (the input guard's check and what it returns).
_UNPACKING = (operator.getitem, tree_leaves, check_inputs)


def _late_checks(gm: fx.GraphModule) -> list[fx.Node]:
    """The size checks that read a value some layer computed, not only the inputs and weights. A call one
    refuses has run the stages before it; where they may run again on another plan (they update no buffer;
    random draws are set back: ``reruns``), the first check of each site is enough, checked first so that
    the call is refused before anything computes. A line of code checked in every layer (Hugging Face's SDPA:
    ``q_length > 1``) mostly checks the same there, and the run stops after the last check taken, so a
    12-layer GPT-2 runs one layer, not twelve (0.5 s, not 1.8 s). Where the graph updates buffers (a batch
    norm; ``check_early`` is given graphs in training mode), a call a check refuses late is refused for good,
    so every check: a later one of a site may check another condition (one ``gate(h)`` given two widths)."""
    unpacked: set[fx.Node] = set()
    late: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr") or (
                node.op == "call_function" and node.target in _UNPACKING and unpacked.issuperset(node.all_input_nodes)):
            unpacked.add(node)
        elif node.op == "call_function" and node.target in SIZE_CHECKS:
            if not unpacked.issuperset(condition_and_operands(node)[1]):
                late.append(node)
    first: dict[str | None, fx.Node] = {}
    for node in late:
        first.setdefault(check_site(node), node)
    if len(first) == len(late) or rerun_of_nodes(gm, gm.graph.nodes, training=True).holds(rewound=True):
        return list(first.values())
    return late


class _Stop(Exception):
    """Raised after the last late check ran: the rest of the graph need not."""


class _SymbolicRun(PlainInterpreter):
    """Runs the graph on fake inputs with symbolic sizes, the input guard passed by, and records the value
    each late check is given instead of checking it."""

    def __init__(self, gm: fx.GraphModule, late: list[fx.Node]) -> None:
        super().__init__(gm)
        self.late, self.last = set(late), late[-1]
        self.given: dict[fx.Node, tuple[Any, ...]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_function" and n.target is check_inputs:
            guard, *values = self.fetch_args_kwargs_from_env(n)[0]
            return guard.returned(dict(zip(guard.names, values)))
        if n.op == "call_function" and n.target in SIZE_CHECKS:
            args = self.fetch_args_kwargs_from_env(n)[0]
            if n in self.late:
                self.given[n] = args
            if n is self.last:
                raise _Stop
            return None
        return super().run_node(n)


def early_conditions(gm: fx.GraphModule, values: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """``(condition, refusal)`` for each late size check of ``gm`` whose condition the symbolic run writes
    over the inputs' sizes (``InputGuard.early``); ``values``: the example's arguments by name, which each
    condition must hold of. Empty where there is no late check or the run fails before the first (code
    reading tensor values)."""
    late = _late_checks(gm)
    if not late:
        return ()
    shapes = ShapeEnv(duck_shape=False)  # (a size equal to another in the example is not the same size)
    mode = FakeTensorMode(shape_env=shapes, allow_non_fake_inputs=True)
    names: dict[sympy.Symbol, sympy.Symbol] = {}

    def symbolic(path: tuple[Any, ...], value: torch.Tensor) -> torch.Tensor:
        """A fake of ``value`` whose every size is a symbol, named by its argument and path (``L['d']['x']``)."""
        fake = mode.from_tensor(value, symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC] * value.dim()))
        for axis, size in enumerate(fake.shape):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                names[size.node.expr] = sympy.Symbol(f"L{keystr(path)}.size()[{axis}]")
        return fake

    placeholders = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [tree_map_with_path(lambda path, v: symbolic((MappingKey(name), *path), v) if isinstance(v, torch.Tensor)
                                else v, values.get(name)) for name in placeholders]
    run = _SymbolicRun(gm, late)
    try:
        with isolated(gm), mode, torch.no_grad(), grad_mode_unchecked():
            run.run(*fakes)
    except Exception:  # noqa: BLE001 - _Stop, or code fake tensors cannot run: the checks after it stay alone
        pass  # (those it reached are written: a batch norm's graph runs on past the first check of a site)
    found = []
    for args in run.given.values():
        written = _written(args, names)
        if written is not None and holds(written[0], values):
            found.append(written)
    if run.given:  # each condition holds where the run's own guards do: those too (but a size's not being 0 or 1)
        found += _guarded(shapes, names, values)
    return tuple(dict.fromkeys(found))


def _guarded(shapes: ShapeEnv, names: dict[sympy.Symbol, sympy.Symbol],
             values: dict[str, Any]) -> list[tuple[str, str]]:
    """The guards the symbolic run made on the inputs' sizes, over them: a check's condition is written under
    them (``s - 2 < 2`` made a width ``Max(0, s - 4)`` the constant 0; ``4*s == 12`` replaced ``s`` by 3 in
    ``(b*s) // 3 > 3``), so a call breaking one may break the check where the conditions said it would not."""
    guarded = []
    for guard in shapes.guards:
        text = _over_inputs(guard.expr, names)
        if text is not None and not ASSUMED_OF_EVERY_SIZE.fullmatch(text.strip()) and holds(text, values):
            guarded.append((text, "the conditions the plan checks first were written for inputs of sizes like "
                                  "the example's, and these are not"))
    return guarded


def _over_inputs(expression: sympy.Expr, names: dict[sympy.Symbol, sympy.Symbol]) -> str | None:
    """``expression`` as Python over the inputs' sizes (``L['x'].size()[3] > 32``), or None where it is
    not an expression of them alone."""
    if not expression.free_symbols or not expression.free_symbols.issubset(names):
        return None
    return PythonPrinter().doprint(expression.xreplace(names))


def _written(args: tuple[Any, ...], names: dict[sympy.Symbol, sympy.Symbol]) -> tuple[str, str] | None:
    """A check's condition over the inputs' sizes and what the check says when it fails, or None where its
    value is not a symbolic expression of the inputs' sizes alone."""
    value = args[0]
    if not isinstance(value, (torch.SymBool, torch.SymInt)):
        return None
    text = _over_inputs(value.node.expr, names)
    if text is None:
        return None
    if isinstance(value, torch.SymBool):
        expected, condition = args[1], args[2]
        return (text if expected else f"not ({text})",
                f"{condition} is {not expected} for these inputs, but was {expected} when the sharded plan was "
                "captured")
    expected, site = args[1], args[2]
    return (f"{text} == {expected}",
            f"the code at {site} turns a size into a Python number, which fixed it to {expected} when the sharded "
            "plan was captured, and these inputs change it")


def check_early(gm: fx.GraphModule, inputs: ExampleInputs) -> None:
    """Give ``gm``'s input guard, where it has one, the ``early_conditions`` of its late size checks, on the
    example ``inputs`` (the fx front end gives one to a graph in training mode that checks sizes)."""
    check = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target is check_inputs), None)
    if check is None:
        return
    names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    early = early_conditions(gm, dict(zip(names, placeholder_values(gm, inputs))))
    if early:
        target = str(check.args[0].target)
        setattr(gm, target, dataclasses.replace(getattr(gm, target), early=early))
