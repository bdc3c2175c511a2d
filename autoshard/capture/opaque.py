"""Keeping a module or function opaque inside ``torch.export``.

``torch.export`` runs the model's Python with fake tensors, so a module that branches on tensor
values cannot be captured. While exporting, such a module (or free function) is replaced by a
stand-in that calls one custom op, ``autoshard::opaque``; the op's fake kernel learns the output
structure by running the original on zeros of the example's sizes, and maps each output size
back to the input size it equals, so the graph stays generic in batch and sequence length. After
export each op node is rewritten into a plain ``call_module`` / ``call_function`` of the
original, which runs eagerly inside its stage.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten

from autoshard.capture.guard import check_condition
from autoshard.capture.state import real_run
from autoshard.errors import TraceError
from autoshard.generators import generator_states

_IDS = itertools.count()
_TENSOR = object()  # marks where an opaque call's results hold a tensor


@dataclass
class _RealResults:
    """What each opaque call returned besides tensors in a real run of the model on the example,
    in call order: the fake kernel's runs on zeros and ones cannot see a result that depends on the
    values in another way (``_detect_is_causal_mask`` is False for both fills, True on a causal
    mask). ``recording`` while the real run makes them; export's calls then take them in turn."""

    results: list[tuple[Any, list[Any]]] = field(default_factory=list)
    recording: bool = False
    taken: int = 0

    def take(self, target: Any) -> list[Any] | None:
        """The next recorded results, if the call matches the one recorded there (else None, for good)."""
        if self.taken < len(self.results) and self.results[self.taken][0] is target:
            self.taken += 1
            return self.results[self.taken - 1][1]
        self.taken = len(self.results)  # the export went another way: stop matching
        return None


_REAL = _RealResults()


@contextlib.contextmanager
def recording_real_results() -> Iterator[None]:
    """Stand-ins run their originals for real inside and note what each returned besides tensors;
    the export after it compares its calls' results on zeros with these (see ``_RealResults``)."""
    _REAL.results, _REAL.recording, _REAL.taken = [], True, 0
    try:
        yield
    finally:
        _REAL.recording = False


def forget_real_results() -> None:
    _REAL.results, _REAL.recording, _REAL.taken = [], False, 0


@dataclass
class OpaqueCall:
    """One call of an opaque target during an export: how to rebuild its arguments and results.

    ``target`` is what the graph will call (a module or a function), ``run`` its original code,
    ``state`` a module's own parameters and buffers, taken before export swapped in fake ones.
    """

    target: Any
    run: Callable[..., Any]
    name: str
    in_flat: list[Any]
    in_spec: TreeSpec
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    out_constants: list[Any] = field(default_factory=list)
    out_spec: TreeSpec | None = None
    real: list[Any] | None = None  # its results besides tensors on the example, when recorded


#: Calls made during the export now running, by id; emptied when it ends.
CALLS: dict[int, OpaqueCall] = {}
#: Non-zero while a fake kernel runs originals for real: stand-ins inside them call through.
_RUNNING_FOR_REAL = [0]


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.SymInt)


@torch.library.custom_op("autoshard::opaque", mutates_args=())
def opaque(inputs: list[torch.Tensor], sizes: Sequence[int], call: int) -> list[torch.Tensor]:
    """Only ever traced: export rewrites every call into the original module or function."""
    raise TraceError("autoshard::opaque ran outside an export; the capture did not rewrite it")


def _hint(size: Any) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _sizes_like(value: int, position: int, rank: int, inputs: Sequence[torch.Tensor], sizes: Sequence[Any],
                name: str) -> Any:
    """The input size (symbolic where it is) an output size of ``value`` stands for."""
    for tensor in inputs:
        if tensor.dim() == rank and _hint(tensor.shape[position]) == value:
            return tensor.shape[position]
    candidates = [*(s for t in inputs for s in t.shape), *sizes]
    symbolic = {str(s): s for s in candidates if isinstance(s, torch.SymInt) and _hint(s) == value}
    if len(symbolic) > 1:
        raise TraceError(
            f"cannot tell which input size an output size {value} of opaque {name} follows "
            f"({', '.join(symbolic)} all equal {value} in the example); pass an example whose sizes differ")
    return next(iter(symbolic.values()), value)


class OpaqueResult(RuntimeError):
    """An opaque call returned something the graph cannot keep as a constant: what a random draw
    chose (the layers to drop), or an object holding tensors. Not a ``TraceError``: the module
    that makes the call is kept whole instead."""


def _holds_tensors(value: Any) -> bool:
    """Whether tensors hide in ``value``'s attributes (an object pytree does not open)."""
    return any(isinstance(v, torch.Tensor) or (hasattr(v, "__dict__") and not isinstance(v, nn.Module) and
                                               any(isinstance(a, torch.Tensor) for a in vars(v).values()))
               for v in [value, *getattr(value, "__dict__", {}).values()])


@opaque.register_fake
def _opaque_fake(inputs: list[torch.Tensor], sizes: Sequence[int], call: int) -> list[torch.Tensor]:
    record = CALLS[call]
    _RUNNING_FOR_REAL[0] += 1
    with unset_fake_temporarily():
        before = generator_states()
    try:
        result = _run_filled(record, inputs, sizes)
    finally:
        _RUNNING_FOR_REAL[0] -= 1
    flat_out, record.out_spec = tree_flatten(result)
    kept = [type(v).__name__ for v in flat_out if not isinstance(v, torch.Tensor) and v is not None]
    with unset_fake_temporarily():
        drew = before != generator_states()
    if kept and drew:
        raise OpaqueResult(f"opaque {record.name} draws random numbers and returns {', '.join(kept)}: the graph "
                           "would keep what it returned at capture, the same on every call")
    holding = [type(v).__name__ for v in flat_out if not isinstance(v, torch.Tensor) and _holds_tensors(v)]
    if holding:
        raise OpaqueResult(f"opaque {record.name} returns {', '.join(holding)} holding tensors, which the graph "
                           "would keep as computed at capture (on zeros)")
    if kept and (_non_tensors(flat_out) != _non_tensors(tree_leaves(_run_filled(record, inputs, sizes, 1.0)))
                 or record.real not in (None, _non_tensors(flat_out))):
        raise OpaqueResult(f"opaque {record.name} returns {', '.join(kept)} computed from the values of its tensor "
                           "inputs, which the graph would keep as computed at capture (on zeros)")
    record.out_constants = [_TENSOR if isinstance(v, torch.Tensor) else v for v in flat_out]
    return [torch.empty([_sizes_like(size, axis, t.dim(), inputs, sizes, record.name)
                         for axis, size in enumerate(t.shape)], dtype=t.dtype, device=t.device)
            for t in flat_out if isinstance(t, torch.Tensor)]


def _non_tensors(flat: list[Any]) -> list[Any]:
    """The literal results among ``flat`` (objects by identity), to compare two runs by."""
    return [v if _is_literal(v) else id(v) for v in flat if not isinstance(v, torch.Tensor)]


def _run_filled(record: OpaqueCall, inputs: list[torch.Tensor], sizes: Sequence[int], fill: float = 0.0) -> Any:
    """The original's result on real tensors of the example's sizes filled with ``fill``: its
    structure and sizes (with another fill: whether its other results follow the values)."""
    with unset_fake_temporarily(), torch.no_grad(), real_run():
        tensors = iter(torch.full([_hint(s) for s in t.shape], fill, dtype=t.dtype, device=t.device)
                       for t in inputs)
        hints = iter(_hint(s) for s in sizes)
        flat = [next(tensors) if isinstance(v, torch.Tensor) else next(hints) if _is_size(v) else v
                for v in record.in_flat]
        args, kwargs = tree_unflatten(flat, record.in_spec)
        if not isinstance(record.target, nn.Module):
            return record.run(*args, **kwargs)
        # its real weights (a condition may read what they compute), and what it stands for run, not its
        # call: ``torch.func.functional_call`` would run its hooks too, which export traces around a forward's
        # stand-in (a hook recording the output would record this run's zeros first)
        with _reparametrize_module(record.target, record.state):
            return record.run(*args, **kwargs)


def stand_in(target: Any, run: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A callable that records one ``autoshard::opaque`` op in place of running ``run``."""

    state = {**dict(target.named_parameters(remove_duplicate=False)),
             **dict(target.named_buffers(remove_duplicate=False))} if isinstance(target, nn.Module) else {}

    def call(*args: Any, **kwargs: Any) -> Any:
        if _RUNNING_FOR_REAL[0]:
            return run(*args, **kwargs)
        if _REAL.recording:
            _RUNNING_FOR_REAL[0] += 1  # calls inside run for real in the export too: not recorded
            try:
                result = run(*args, **kwargs)
            finally:
                _RUNNING_FOR_REAL[0] -= 1
            _REAL.results.append((target, _non_tensors(tree_leaves(result))))
            return result
        flat, spec = tree_flatten((args, kwargs))
        call_id = next(_IDS)
        CALLS[call_id] = record = OpaqueCall(target, run, name, flat, spec, state, real=_REAL.take(target))
        outputs = iter(torch.ops.autoshard.opaque([v for v in flat if isinstance(v, torch.Tensor)],
                                                  [v for v in flat if _is_size(v)], call_id))
        rebuilt = [next(outputs) if c is _TENSOR else c for c in record.out_constants]
        return tree_unflatten(rebuilt, record.out_spec)

    return call


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a nested value, in pytree order (how an opaque op returned them)."""
    return [v for v in tree_leaves(value) if isinstance(v, torch.Tensor)]


def _is_literal(value: Any) -> bool:
    """Whether fx can write ``value`` into generated code as it is."""
    if isinstance(value, (tuple, list)):
        return all(_is_literal(v) for v in value)
    return isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
                              torch.memory_format))


def _same_results(value: Any, expected: list[Any]) -> bool:
    """Whether the non-tensor results of an opaque call are those it gave at capture: equal
    literals, the very same objects otherwise."""
    found = [v for v in tree_leaves(value) if not isinstance(v, torch.Tensor)]
    return len(found) == len(expected) and all(
        (type(v) is type(e) and v == e) if _is_literal(e) else v is e for v, e in zip(found, expected))


def rewrite_opaque_calls(graph: fx.Graph, module_path: Callable[[Any], str | None]) -> dict[str, Any]:
    """Replace each ``autoshard::opaque`` node by a call of the original module or function.

    ``module_path(obj)`` is the qualified name of a module of the captured root, or None. Other
    objects the original is called with are returned as constants, read by ``get_attr``.
    """
    constants: dict[str, Any] = {}

    def argument(value: Any) -> Any:
        if _is_literal(value):
            return value
        path = module_path(value)
        if path is None:
            path = f"_autoshard_opaque_constant_{len(constants)}"
            constants[path] = value
        return graph.create_node("get_attr", path)

    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.autoshard.opaque.default:
            continue
        tensors, sizes, call_id = node.args
        record = CALLS[call_id]
        inputs, size_nodes = iter(tensors), iter(sizes)
        with graph.inserting_before(node):
            flat = [next(inputs) if isinstance(v, torch.Tensor) else next(size_nodes) if _is_size(v)
                    else argument(v) for v in record.in_flat]
            args, kwargs = tree_unflatten(flat, record.in_spec)
            path = module_path(record.target)
            if path is not None:  # create_node: the exported module need not hold the leaf
                called = graph.create_node("call_module", path, tuple(args), dict(kwargs))
            else:
                called = graph.call_function(record.target, tuple(args), dict(kwargs))
            flat_out = graph.call_function(tensor_leaves, (called,))
            kept = [c for c in record.out_constants if c is not _TENSOR]
            if any(c is not None for c in kept):  # the graph goes on with these: refuse calls returning others
                same = graph.call_function(_same_results, (called, [argument(c) for c in kept]))
                graph.call_function(check_condition, (same, True, f"what {record.name} returns besides tensors"))
        called.meta = dict(node.meta)
        flat_out.meta = dict(node.meta)
        node.replace_all_uses_with(flat_out)
        graph.erase_node(node)
    return constants
