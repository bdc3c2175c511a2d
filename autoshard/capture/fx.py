"""torch.fx capture with leaf detection by trial tracing, at the least granular level.

fx cannot trace through Python control flow that reads tensor values. Rather than give up,
we trace, and when tracing fails we find the *innermost* thing that failed and keep only that
opaque, then trace again:

* a free function called from a forward (``F._canonical_mask``, a mask builder, a length check)
  becomes one ``call_function`` node, so the module around it stays splittable;
* otherwise the innermost module whose own forward failed becomes a leaf (``call_module``).

A module is therefore wrapped only if the model cannot be traced through it once its own
untraceable descendants are leaves. Primitive ``torch.nn`` modules (no children: Linear, Conv,
norms, activations, Embedding, Dropout) and TorchScript modules are always leaves; composite
``torch.nn`` modules (Sequential, TransformerEncoder, ...) are traced through whenever they trace.

With example inputs the tracer also runs the example alongside (``autoshard.capture.meta``), so
code that reads shapes, ranks and dtypes traces instead of forcing a leaf, and the model is traced
as the child of a generated call wrapper (``autoshard.capture.signature``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch import nn

from autoshard.capture.assemble import assemble, model_graph_module
from autoshard.capture.fast_paths import fused_modules, kept_whole_by_design, packs_padded_batch
from autoshard.capture.guard import SIZE_CHECKS, InputGuard, check_detached_mode, run_forward_hooks
from autoshard.capture.leaves import Leaves, ReturnedObjectError, capture_with_leaves, function_name, swapped
from autoshard.capture.meta import MetaTracer, guard_value, has_proxy, warn_checkpoints_traced
from autoshard.capture.result import TraceResult, WrappedLeaf
from autoshard.capture.signature import CallSignature
from autoshard.capture.structure import is_generation_cache
from autoshard.errors import TraceError
from autoshard.isolation import HeldModule, cloned, isolated, trace_value_slots

__all__ = ["TraceResult", "WrappedLeaf", "has_backward_hooks", "has_call_hooks", "is_primitive", "kept_whole_for_hooks",
           "refuse_backward_hooks_of", "trace_with_leaves"]


def is_primitive(module: nn.Module) -> bool:
    """A ``torch.nn`` module with no children: there is nothing inside worth splitting."""
    defined_in_torch = type(module).__module__.startswith(("torch.nn", "torch.ao.nn"))
    return defined_in_torch and next(module.children(), None) is None


def is_torchscript(module: nn.Module) -> bool:
    """A TorchScript module (``torch.jit.script`` or ``torch.jit.trace``): its code is compiled, with no
    Python forward to trace through, so its stage calls it whole and holds its weights (fx would record
    a call of its compiled method on an attribute, which holds none a stage could see)."""
    return isinstance(module, torch.jit.ScriptModule)


def has_backward_hooks(module: nn.Module) -> bool:
    """Backward hooks, which a module's call installs on its inputs and outputs: any capture that
    goes through the module drops them."""
    return bool(module._backward_hooks or module._backward_pre_hooks)


def refuse_backward_hooks_of(model: nn.Module) -> None:
    """The model's own backward hooks see the gradients of its whole call, which no stage makes:
    no capture can run them, and dropping them would change the gradients silently."""
    if has_backward_hooks(model):
        raise TraceError(
            f"the {type(model).__name__} being sharded has a backward hook of its own, which sees the gradients "
            "of its whole call: split into stages, no module makes them, so the stages cannot run it; register "
            "it on a submodule (the stage holding it runs it) or on the tensors (Tensor.register_hook on the "
            "inputs or the output)")


def has_call_hooks(module: nn.Module) -> bool:
    """Tracing through a module would run its hooks once, on traced values (forward ones), or drop
    them (backward ones, which its call installs on its outputs), so a module with hooks stays a
    leaf, its hooks run by its call in the stage. With ``trace_hooks`` (``kept_whole_for_hooks``)
    forward hooks alone do not keep it whole."""
    return bool(module._forward_hooks or module._forward_pre_hooks or has_backward_hooks(module))


def kept_whole_for_hooks(module: nn.Module, trace_hooks: bool) -> bool:
    """Whether ``module``'s hooks keep it a leaf. ``trace_hooks``: forward hooks alone do not; they
    run as a node after its traced body (``run_forward_hooks``), on every call with the real values.
    Forward pre-hooks (they may replace the inputs its body is traced on) and backward hooks still do."""
    if trace_hooks:
        return bool(module._forward_pre_hooks or has_backward_hooks(module))
    return has_call_hooks(module)


class _LeafTracer(MetaTracer):
    """An fx tracer with an explicit leaf set; the model itself is always traced through."""

    def __init__(self, leaves: set[int], model: nn.Module, examples: Mapping[str, Any] | None,
                 pin_sizes: bool, fused: Mapping[int, nn.Module], trace_hooks: bool = False) -> None:
        """``leaves``: ids of the modules to keep opaque; ``fused``: those kept whole for their
        fused inference path (``capture.fast_paths``; a padded ``nn.TransformerEncoder`` call is
        kept whole whatever it holds: tracing it would change its values); ``trace_hooks``: see
        ``kept_whole_for_hooks``."""
        super().__init__(examples, pin_sizes)
        # Buffers as graph values, so shape-dependent slicing (``self.pe[: x.size(0)]``) traces.
        self.proxy_buffer_attributes = True
        self.leaves = leaves | set(fused)
        self.fused = fused
        self.kept_fused: dict[int, nn.Module] = {}  # those the trace reached, kept whole
        self.model = model
        self.watched: dict[int, nn.Module] = {}  # modules outside the tree with a mode guard already
        self.trace_hooks = trace_hooks

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if m is self.model:
            return False
        return (id(m) in self.leaves or is_primitive(m) or is_torchscript(m)
                or kept_whole_for_hooks(m, self.trace_hooks))

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        """A module the forward builds and calls on the spot (``CrossEntropyLoss()(logits, labels)``,
        as Hugging Face heads compute their loss) is not installed under the model, so no node can
        name it: its forward is traced through, as the code it is, its mode watched (one kept in a
        list or a global can be switched later). One holding weights, buffers or hooks is not (the
        graph could not read them): fx's own error stands."""
        if not _installed(self, m) and not has_call_hooks(m) and next(m.parameters(), None) is None \
                and next(m.buffers(), None) is None:
            if id(m) not in self.watched:  # one guard per module, however often it is called
                self.watched[id(m)] = m
                self.create_proxy("call_function", check_detached_mode, (HeldModule(m), m.training), {})
            return forward(*args, **kwargs)
        if m is not self.model and (id(m) in self.fused or packs_padded_batch(m, args, kwargs)):
            self.leaves.add(id(m))
            self.kept_fused[id(m)] = m
        if m._forward_hooks and not self.is_leaf_module(m, ""):  # the body traced without them, then the hooks
            output = super().call_module(m, m.forward, args, kwargs)
            held = HeldModule(m, runs_hooks=True)
            return self.create_proxy("call_function", run_forward_hooks, (held, args, kwargs, output), {})
        return super().call_module(m, forward, args, kwargs)


def _installed(tracer: fx.Tracer, module: nn.Module) -> bool:
    """Whether ``module`` is the traced root or one of its submodules."""
    try:
        tracer.path_of_module(module)
    except NameError:
        return False
    return True


def _opaque(fn: Callable[..., Any], tracer_ref: list[MetaTracer]) -> Callable[..., Any]:
    """A stand-in that records ``fn`` as one call_function node whenever it sees a Proxy.

    A result that is not a tensor (a mask builder returning None) is used as its example value,
    with a guard in the graph that refuses inputs for which it would differ.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tracer = tracer_ref[0]
        if not has_proxy((args, kwargs)):
            return fn(*args, **kwargs)
        proxy = tracer.create_proxy("call_function", fn, args, kwargs)
        return guard_value(tracer, proxy, f"{function_name(fn)}(...)")

    return wrapper


def trace_with_leaves(
    model: nn.Module,
    example_args: tuple[Any, ...] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    pin_sizes: bool = False,
    fused_paths: bool = True,
    trace_hooks: bool = False,
) -> TraceResult:
    """Trace ``model`` with fx, wrapping the fewest, innermost modules or functions needed.

    Without example inputs the model's own forward is traced symbolically. With them, the model
    is traced as it was called: non-tensor arguments become constants checked on every call.
    ``pin_sizes`` lets code that turns a size into a Python number (``int(n)``, ``range(n)``)
    trace with the example's number, guarded, instead of keeping that code whole: the graph then
    serves that size only. ``fused_paths`` keeps modules with a fused inference path whole in eval
    mode (``capture.fast_paths``); false traces through them, for a finer split. ``trace_hooks``
    traces through modules with forward hooks (``kept_whole_for_hooks``).
    """
    refuse_backward_hooks_of(model)
    example_kwargs = dict(example_kwargs or {})
    has_example = bool(example_args or example_kwargs)
    signature = CallSignature.of(model, tuple(example_args), example_kwargs) if has_example else None
    root = signature.wrapper(model) if signature else model

    def attempt(leaves: Leaves) -> tuple[fx.Graph, MetaTracer]:
        # Fresh copies each time: a forward that writes to its inputs must not see its last run.
        examples = cloned({a.name: a.value for a in signature.graph_inputs}) if signature else None
        tracer = _LeafTracer(set(leaves.modules), model, examples, pin_sizes,
                             fused_modules(model, fused_paths), trace_hooks)
        tracer_ref = [tracer]
        stand_ins = [(site, _opaque(site.function, tracer_ref)) for site in leaves.functions]
        with swapped(stand_ins), isolated(model):
            return tracer.trace(root), tracer

    (graph, tracer), leaves = capture_with_leaves(model, attempt, "trace")
    warn_checkpoints_traced(type(model).__name__, tracer.checkpoints)
    refuse_emptied_outputs(graph, tracer.constants, type(model).__name__)
    tracer.forget_examples(graph)
    guard = _guard(signature, tracer, model.training and any(n.target in SIZE_CHECKS for n in graph.nodes))
    if signature is None:  # traced from the model itself: names are already the model's own
        gm = model_graph_module(model, graph, tracer.constants)
    else:
        gm = assemble(graph, root, model, signature, lambda n: (str(n.target), None), guard, tracer.constants)
    return TraceResult(gm, (*leaves.wrapped, *kept_whole_by_design(leaves, tracer.kept_fused)),
                       specialized=tuple(tracer.specialized),
                       input_guard=guard.describe() if guard else "", attributes_read=tracer.attribute_reads.kept(),
                       leafness_asked=frozenset(tracer.leafness_asked))


def refuse_emptied_outputs(graph: fx.Graph, constants: Mapping[str, Any], model_name: str) -> None:
    """Refuse an output the trace kept as a constant object though the forward filled it with computed
    values (a ``SimpleNamespace``, a plain class, a generation cache): fx rebuilds tensors, tuples,
    lists, dicts and dataclasses on each call, but such an object is returned as it was made, the same
    object on every call, with those values cleared (``clear_trace_values``): a wrong answer that only
    the values' check would catch, and a plan made without it returned."""
    pending, seen = [graph.output_node()], set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        value = constants.get(str(node.target)) if node.op == "get_attr" else None
        if value is not None and next(trace_value_slots(value), None) is not None:
            advice = ("it is a generation cache: call the model with use_cache=False" if is_generation_cache(value) else
                      "return its tensors in tuples, NamedTuples, lists, dicts or dataclasses instead")
            raise ReturnedObjectError(
                f"{model_name} returns a {type(value).__name__} holding values its forward computed, an object the "
                "capture cannot rebuild on each call: the plan would return it emptied, the same object on every "
                f"call; {advice}")
        if node.op == "output" or (node.op == "call_function" and isinstance(node.target, type)):
            pending.extend(node.all_input_nodes)  # (a ModelOutput or OrderedDict rebuilt around it)


def _guard(signature: CallSignature | None, tracer: MetaTracer, sizes_checked: bool) -> InputGuard | None:
    """fx graphs serve any shape; constants baked in, the layout of container arguments (the trace
    answered ``d.get("mask") is not None`` from the example), mutable defaults left out, and input
    dtypes once the trace relied on them, need checking. A graph that relied on none of these takes
    its inputs unchecked, but for one in training mode that checks sizes (``sizes_checked``), whose
    guard checks them first (``size_conditions``: a refusal after a batch norm ran would be final)."""
    if signature is None or not (signature.constants or tracer.read_static_facts or signature.containers
                                 or signature.default_snapshots() or sizes_checked):
        return None
    return signature.guard(dtypes=bool(signature.constants or tracer.read_static_facts),
                           ranks=tracer.read_static_facts)
