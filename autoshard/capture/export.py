"""The ``torch.export`` front end, with the same leaf detection by trial capture as fx.

``torch.export`` (non-strict) runs the model's Python with fake tensors, so it goes through the
top-level forwards fx cannot trace (mask builders, input checks, shape arithmetic); it fails on
control flow that reads tensor values. On a failure the innermost module (or the free function a
forward called) on the failing stack is kept opaque (``autoshard.capture.opaque``) and the export
retried.

Every dimension of every tensor input is exported as dynamic (``Dim.AUTO``), so the graph serves
other batch sizes and sequence lengths; where the model pins a size (a fixed image size, a
position table's length) the graph's input guard names the shapes it serves and refuses others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import sys
import warnings
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.fx as fx
from torch import nn
from torch.export import Dim
from torch.utils._pytree import BUILTIN_TYPES, SUPPORTED_NODES, _get_node_type, tree_map, tree_unflatten
from torch.utils._sympy.numbers import int_oo

from autoshard.capture.attribute_reads import AttributeReads
from autoshard.capture.assemble import assemble, leaves_of
from autoshard.capture.eager import swapped_attribute
from autoshard.capture.fast_paths import fused_modules, kept_whole_by_design
from autoshard.capture.fx import has_backward_hooks, refuse_backward_hooks_of
from autoshard.capture.grad_mode import GradModeReader
from autoshard.capture.guard import (
    FREE_SIZES_PIPELINE, DimSpec, InputGuard, check_asserted, check_detached_mode, check_grad_mode, layout_of,
    usable_conditions,
)
from autoshard.capture.layout_reads import LEAFNESS, LayoutReads
from autoshard.capture.leaves import Leaves, capture_with_leaves, function_name, swapped
from autoshard.capture.state import current_value, is_real_run, refusing_state_writes
from autoshard.capture.opaque import CALLS, forget_real_results, recording_real_results, rewrite_opaque_calls, stand_in
from autoshard.capture.result import TraceResult
from autoshard.capture.signature import MODEL_ATTR, CallSignature
from autoshard.emit import follow_input_device
from autoshard.errors import InvalidArgumentError
from autoshard.fx_helpers import resolve
from autoshard.isolation import HeldModule, cloned, holds, isolated

__all__ = ["export_with_leaves"]


@contextlib.contextmanager
def _opaque_modules(leaves: Mapping[int, tuple[nn.Module, str]], whole: Iterable[int]) -> Iterator[None]:
    """Route each leaf's forward through an opaque stand-in while exporting; restore it after. Its
    forward hooks are traced around the stand-in, as export traces them through any module, so what
    they hand the forward another way is the traced value (Hugging Face's output recorders fill a
    collector the forward returns); the graph then calls the module, which runs them again (a hook
    changing its output would change it twice: verification refuses that). Those in ``whole`` (ids),
    kept whole for backward hooks, which export would drop, stand in for their whole call instead
    (hooks with forward), run once a call. A compiled call (``module.compile()``) is set aside, as it
    would skip the stand-ins."""
    whole = set(whole)
    with contextlib.ExitStack() as stack:
        for module, path in leaves.values():
            stack.enter_context(swapped_attribute(module, "forward", stand_in(module, module.forward, path)))
            if id(module) in whole:
                whole_call = functools.partial(type(module)._call_impl, module)  # reads the forward stand-in
                stack.enter_context(swapped_attribute(module, "_call_impl", stand_in(module, whole_call, path)))
            stack.enter_context(swapped_attribute(module, "_compiled_call_impl", None))
        yield


def _compiled_branch_refused(exc: RuntimeError) -> bool:
    """Whether torch.compile's tracer refused a ``torch.cond`` or ``while_loop`` body (its module is
    loaded by then; importing it otherwise would cost seconds)."""
    dynamo = sys.modules.get("torch._dynamo.exc")
    return dynamo is not None and isinstance(exc, dynamo.UncapturedHigherOrderOpError)


class CustomBackward(Exception):
    """A custom ``torch.autograd.Function`` met by export with grad enabled."""


@contextlib.contextmanager
def _refusing_custom_backward() -> Iterator[None]:
    """``Function.apply`` raises ``CustomBackward`` for a model's own autograd Function while
    gradients are recorded: export records its forward's operations and drops its ``backward``
    (a gradient reversal would silently train the other way), so the module or function calling
    it is kept whole, where it runs as written. torch's own Functions (the reentrant checkpoint)
    are traced through, as under fx."""
    original = vars(torch.autograd.Function)["apply"]

    def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        if torch._C.is_grad_enabled() and not cls.__module__.startswith("torch."):
            raise CustomBackward(f"{cls.__qualname__} is a torch.autograd.Function with its own backward, "
                                 "which torch.export would drop")
        return original.__func__(cls, *args, **kwargs)

    with swapped_attribute(torch.autograd.Function, "apply", classmethod(apply)):
        yield


#: Loggers that report what the input guard and the wrapped leaves already say.
_NOISY_LOGS = ("torch.fx.experimental.symbolic_shapes", "torch._export.non_strict_utils",
               "torch._subclasses.fake_tensor")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence what a failing trial export prints (its partial graph, symbol warnings): failures
    are expected here, and the one that matters is reported in the wrapped leaf's reason."""
    logs = [logging.getLogger(name) for name in _NOISY_LOGS]
    levels = [log.level for log in logs]
    for log in logs:  # the failure that matters is raised, and reported where it is kept whole
        log.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            # capture/state.py judges attributes a forward assigns; export's advice to make them
            # buffers is not the user's to act on
            warnings.filterwarnings("ignore", message="The tensor attributes? .* (was|were) assigned during export")
            yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _registered_type(value: Any) -> bool:
    """Whether ``value`` is a container type registered with torch's pytree outside its builtins (a
    Hugging Face ``ModelOutput``)."""
    kind = _get_node_type(value)
    return kind in SUPPORTED_NODES and kind not in BUILTIN_TYPES


def _dynamic(value: Any) -> Any:
    """Every dimension of every tensor in ``value`` left for export to keep generic. A registered
    container type gets the list of its children's specs, which is what export matches it with (it
    cannot assume the type holds specs: a ``BaseModelOutput`` built from a dict reads it as fields)."""
    def spec(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {i: Dim.AUTO for i in range(v.dim())}
        if _registered_type(v):
            return [_dynamic(child) for child in SUPPORTED_NODES[_get_node_type(v)].flatten_fn(v)[0]]
        return None

    return tree_map(spec, value, is_leaf=_registered_type)


def _dim_spec(size: Any, ranges: Mapping[Any, Any]) -> DimSpec:
    if not isinstance(size, torch.SymInt):
        return DimSpec(size=int(size))
    expr = size.node.expr
    if expr.is_number:
        return DimSpec(size=int(expr))
    bounds = ranges.get(expr)
    low = _finite(bounds.lower) if bounds is not None else None
    high = _finite(bounds.upper) if bounds is not None else None
    # torch.export reports a lower bound of 2 for sizes it keeps generic but still serves 0 and 1.
    return DimSpec(symbol=str(expr), low=low if low is not None and low > 2 else 0, high=high)


def _finite(bound: Any) -> int | None:
    return None if bound in (int_oo, -int_oo) or not bound.is_finite else int(bound)


#: Why an exported plan refuses another size, and the way out.
FIXED_SIZE_ADVICE = (
    " (torch.export fixed that size while capturing: the model's code needs it, or turns it into a "
    "Python number; if the model itself serves other sizes, the fx front end may keep it free, "
    f"keeping whole the modules whose code it cannot trace: shard with pipeline='{FREE_SIZES_PIPELINE}')")


def _input_guard(graph: fx.Graph, signature: CallSignature, ep: torch.export.ExportedProgram,
                 layout_read: set[tuple[str, str]]) -> InputGuard:
    """Sizes within the ranges export kept them in, and its other guards on them (the code
    branched on ``x.shape[0] % 2``) checked as they are; the layouts export answered from the example,
    and the strides and storage offsets the model's code asked of it (``layout_read``: ``LayoutReads``)
    where contiguity does not tell them (strides of a tensor that is not contiguous; a copy's offset, 0)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    paths = {name: structure.paths for name, structure in signature.containers.items()}
    shapes = {}
    for node, (name, leaf) in zip(placeholders, leaves_of(signature)):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):  # a tensor in a container by its path (d['x'])
            shapes[name if leaf is None else name + paths[name][leaf]] = tuple(
                _dim_spec(s, ep.range_constraints) for s in value.shape)
    example = {a.name: a.value for a in signature.graph_inputs}
    conditions = usable_conditions(getattr(ep, "_guards_code", None) or (), example)
    guard = signature.guard(shapes)
    tensors = signature.tensors()
    layouts = {name: layout_of(tensors[name]) for name in shapes}
    strides = {name: tuple(tensors[name].stride()) for name, asked in layout_read
               if asked == "stride" and name in shapes and not tensors[name].is_contiguous()}
    offsets = {name: 0 for name, asked in layout_read if asked == "storage_offset" and name in shapes}
    return dataclasses.replace(guard, fixed_size_advice=FIXED_SIZE_ADVICE, conditions=conditions, layouts=layouts,
                               strides=strides, offsets=offsets)


def _pinned(guard: InputGuard) -> tuple[str, ...]:
    """The input sizes the export fixed, which a generic capture would have kept symbolic."""
    return tuple(f"{name}.shape[{axis}] == {dim.size}" for name, dims in guard.shapes.items()
                 for axis, dim in enumerate(dims) if dim.size is not None)


def _graph_module(ep: torch.export.ExportedProgram, wrapper: nn.Module, model: nn.Module,
                  signature: CallSignature, layout_read: set[tuple[str, str]]) -> tuple[fx.GraphModule, InputGuard]:
    unlifted = ep.module()
    graph = unlifted.graph
    graph._codegen = fx.graph.CodeGen()  # plain arguments: assemble gives the graph its signature
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":  # replaced by the input guard
            graph.erase_node(node)
        elif _checks_what_the_guards_fix(node):
            node.replace_all_uses_with(node.args[0])  # (an assertion has no users)
            graph.erase_node(node)
        elif node.target is torch.ops.aten._assert_scalar.default:  # a refusal a sharded model can act on
            node.target = check_asserted
        elif node.target is torch.ops.aten.sym_size.int:  # x.size(d), as fx records it: a read of metadata
            node.op, node.target = "call_method", "size"  # alone, so a zero-byte carrier crosses, not x
        elif node.target is torch.ops.higher_order.wrap_with_autocast and node.args[3] is False:
            # export turns the autocast cache off while it traces; the model's region has it on (a
            # weight used twice is cast once, so its gradient sums in the lower precision)
            node.args = (*node.args[:3], None, *node.args[4:])
    paths = {id(m): f"{MODEL_ATTR}.{p}" if p else MODEL_ATTR for p, m in model.named_modules()}
    constants = rewrite_opaque_calls(graph, lambda obj: paths.get(id(obj)))
    output = next(n for n in graph.nodes if n.op == "output")
    spec = ep.call_spec.out_spec
    if spec is not None and not spec.is_leaf():
        constants["_autoshard_output_spec"] = spec
        with graph.inserting_before(output):
            spec_node = graph.create_node("get_attr", "_autoshard_output_spec")
            output.args = (graph.call_function(tree_unflatten, (list(output.args[0]), spec_node)),)
    elif spec is not None:
        output.args = (output.args[0][0],)
    for node in graph.nodes:  # lifted constants live on the exported module, not on the model
        if node.op == "get_attr" and node.target not in constants:
            try:
                resolve(wrapper, str(node.target))
            except AttributeError:
                constants[str(node.target)] = resolve(unlifted, str(node.target))
    _bodies_follow_input_device(unlifted)
    guard = _input_guard(graph, signature, ep, layout_read)
    placeholders = iter(leaves_of(signature))
    input_of = {n: next(placeholders) for n in graph.nodes if n.op == "placeholder"}
    return assemble(graph, wrapper, model, signature, input_of.__getitem__, guard, constants), guard


def _checks_what_the_guards_fix(node: fx.Node) -> bool:
    """Whether ``node`` only checks or keeps a dtype the plan's guards already fix: export's
    ``_assert_tensor_metadata`` of a ``.to()``, and an ``aten.to.dtype`` to the dtype its input has
    (returning that input). The plan's input dtypes, weight dtypes and autocast state are checked on every
    call, so these cost a call of the sharded model time the model's own ``.to()`` does not: 1.19x the
    model's time on a Llama captured by export, 1.05x without them."""
    if node.target is torch.ops.aten._assert_tensor_metadata.default:
        return True
    if node.target is not torch.ops.aten.to.dtype or any(node.args[3:]) or any(node.kwargs.values()):
        return False  # (a copy asked for, or a memory format)
    source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return isinstance(source, torch.Tensor) and source.dtype == node.args[1]


def _bodies_follow_input_device(module: fx.GraphModule) -> None:
    """Read the device in the body of each higher-order op (an autocast region), nested ones too, from
    the body's inputs, as ``emit`` makes each stage read it: export wrote the capture's device into
    the body's ``ones(device=...)`` and ``_assert_tensor_metadata(device=...)``, so a plan captured on
    the CPU failed on a GPU."""
    for node in module.graph.nodes:
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            bodies = (resolve(module, str(arg.target)) for arg in node.args
                      if isinstance(arg, fx.Node) and arg.op == "get_attr")
            for body in bodies:
                if isinstance(body, fx.GraphModule):
                    _bodies_follow_input_device(body)
                    follow_input_device(body.graph)
                    body.recompile()


def _guard_grad_mode(gm: fx.GraphModule, captured: bool, sites: list[str]) -> None:
    """A ``check_grad_mode`` guard at the start of the graph for each place the model's code asked
    for the grad mode (export records no node there)."""
    if not sites:
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(placeholders[-1]) if placeholders else gm.graph.inserting_before():
        for site in reversed(dict.fromkeys(sites)):
            gm.graph.call_function(check_grad_mode, (captured, site))
    gm.recompile()


@contextlib.contextmanager
def _noting_detached_modules(model: nn.Module, wrapper: nn.Module, found: dict[int, nn.Module]) -> Iterator[None]:
    """Note in ``found`` every module called inside that is not in ``model``'s tree (a dropout kept
    in a list or a global, a loss built in the forward): export traces through them, fixing what
    they read from ``self.training``, and the model's ``eval()`` never reaches them."""
    installed = {id(m) for m in (*model.modules(), wrapper)}

    def note(module: nn.Module, args: Any) -> None:
        if id(module) not in installed:
            found.setdefault(id(module), module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(note)
    try:
        yield
    finally:
        handle.remove()


def _guard_detached_modes(gm: fx.GraphModule, modules: Iterable[nn.Module]) -> None:
    """A ``check_detached_mode`` guard at the start of the graph for each module outside the
    model's tree that the export traced through (as fx puts one where it traces through one)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, module in enumerate(modules):
        name = f"_autoshard_detached_{index}"
        setattr(gm, name, HeldModule(module))
        with gm.graph.inserting_after(placeholders[-1]) if placeholders else gm.graph.inserting_before():
            held = gm.graph.create_node("get_attr", name)  # a plain attribute: get_attr would warn
        with gm.graph.inserting_after(held):
            gm.graph.call_function(check_detached_mode, (held, module.training))
    gm.graph.lint()
    gm.recompile()


def _computed_in_export(module: nn.Module, name: str, value: Any) -> bool:
    """Whether export's run of a forward stores a tensor on its module other than the one there
    (an in-place update such as ``self.steps += 1`` rebinds the same tensor, which export keeps)."""
    return holds(value, torch.Tensor) and value is not current_value(module, name)


def _record_real_results(wrapper: nn.Module, model: nn.Module, inputs: Mapping[str, Any], reader: Any) -> None:
    """Run the model on the example with its opaque parts as stand-ins, noting what each returns
    besides tensors (see ``opaque.recording_real_results``). Best effort: a failure here leaves
    nothing recorded, and the export reports its own."""
    try:
        with recording_real_results(), isolated(model), _quiet(), torch.enable_grad(), \
                swapped_attribute(torch, "is_grad_enabled", reader):
            wrapper(**cloned(dict(inputs)))
    except Exception:  # noqa: BLE001 - the export that follows runs the same code and reports it
        forget_real_results()


def export_with_leaves(
    model: nn.Module,
    example_args: tuple[Any, ...] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    fused_paths: bool = True,
) -> TraceResult:
    """Capture ``model`` with ``torch.export``, keeping the fewest, innermost modules or functions opaque
    (and, with ``fused_paths``, modules with a fused inference path whole in eval mode, as fx does)."""
    refuse_backward_hooks_of(model)
    example_kwargs = dict(example_kwargs or {})
    if not example_args and not example_kwargs:
        raise InvalidArgumentError(
            "the 'export' front end runs the model, so it needs example inputs; pass example_inputs "
            "(or use the 'trace' front end)")
    signature = CallSignature.of(model, tuple(example_args), example_kwargs)
    layout_reads = LayoutReads()
    wrapper = signature.wrapper(model, around=layout_reads.watching)
    inputs = cloned({a.name: a.value for a in signature.graph_inputs})  # (one tensor passed twice: one copy)
    dynamic = {name: _dynamic(value) for name, value in inputs.items()}

    caller_grad = torch.is_grad_enabled()
    grad_mode_sites: list[str] = []  # where the model's code asked for the grad mode

    hooked = {id(m): m for m in model.modules() if m is not model and has_backward_hooks(m)}
    fused = fused_modules(model, fused_paths, calls_unknown=True)
    detached: dict[int, nn.Module] = {}  # modules the export ran that are not in the model's tree
    reads: list[AttributeReads] = []  # the plain attributes the last attempt's code read

    def attempt(leaves: Leaves) -> torch.export.ExportedProgram:
        CALLS.clear()
        layout_reads.read.clear()
        forget_real_results()
        grad_mode_sites.clear()
        reader = GradModeReader(caller_grad, grad_mode_sites.append)
        stand_ins = [(site, stand_in(site.function, site.function, function_name(site.function)))
                     for site in leaves.functions]
        # modules with backward hooks run whole, as under fx: export would drop the hooks (it
        # traces through forward hooks, which Hugging Face's output recorders use to return what
        # they record: they fill a collector the forward reads, which a whole call would not)
        modules = {i: (m, leaves.paths[i]) for i, m in {**hooked, **fused, **leaves.modules}.items()}
        # With grad enabled, as fx traces too: a ``no_grad`` block in the model is then recorded
        # even when the capture was called under ``no_grad``.
        with _opaque_modules(modules, hooked), swapped(stand_ins):
            if modules or stand_ins:  # what the opaque parts return on the example itself
                _record_real_results(wrapper, model, inputs, reader)
                grad_mode_sites.clear()
            detached.clear()
            with isolated(model), _quiet(), refusing_state_writes(
                    _computed_in_export, kept_whole=lambda module: id(module) in modules,
                    replayed=lambda module, name, value: module is model and bool(reads) and reads[0].write_back(
                        module, name, value)) as writes, \
                    torch.enable_grad(), swapped_attribute(torch, "is_grad_enabled", reader), \
                    _refusing_custom_backward(), _noting_detached_modules(model, wrapper, detached):
                reads[:] = [AttributeReads(wrapper, is_real_run, writes.written, writes.set_by_runs)]
                try:
                    with reads[0].recording():
                        return torch.export.export(wrapper, (), inputs, dynamic_shapes=dynamic, strict=False)
                except RuntimeError as exc:
                    if not _compiled_branch_refused(exc):
                        raise
                    # torch.cond compiles its branches with torch.compile's tracer, which refuses a module
                    # class's own __getattribute__: exported without the recorder, no attribute is checked
                    reads.clear()
                    return torch.export.export(wrapper, (), inputs, dynamic_shapes=dynamic, strict=False)

    try:
        ep, leaves = capture_with_leaves(model, attempt, "export")
        gm, guard = _graph_module(ep, wrapper, model, signature, layout_reads.read)
        _guard_grad_mode(gm, caller_grad, grad_mode_sites)
        _guard_detached_modes(gm, detached.values())
    finally:
        CALLS.clear()
        forget_real_results()
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    called = {key: m for key, m in fused.items() if leaves.paths[key] in targets}
    return TraceResult(gm, (*leaves.wrapped, *kept_whole_by_design(leaves, called)), front_end="export",
                       specialized=_pinned(guard),
                       input_guard=guard.describe(), attributes_read=reads[0].kept() if reads else (),
                       leafness_asked=frozenset(name for name, asked in layout_reads.read if asked in LEAFNESS))
