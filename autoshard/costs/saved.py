"""What training keeps of each node, probed on fake tensors: the bytes autograd saves for
backward, the bytes of the gradient its output receives and the most its backward adds at once.

Shape propagation runs the graph once (real or fake tensors, no gradients); beside each node it
runs, ``TrainingProbe`` runs the node again under ``FakeTensorMode`` with gradients on, on fake
twins of the values it receives (parameters as fake leaves that require grad, those of a module
handed to a function too), so nothing is allocated and no FLOP is spent; which weights its
backward gives a gradient is recorded (``apply_tf_padding(x, conv)`` reads none of the conv's):

* ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves, inside modules
  and functions kept whole too (attention probabilities, dropout masks, a loss's log-softmax).
  A saved storage is charged to the node that created it, once however many nodes save it, so
  the bytes add up over any set of nodes; weights and model inputs are not charged (the weight
  state and the received values count them);
* the node's backward runs under PyTorch's ``MemTracker``, which follows every fake storage as it
  is made and freed: ``backward`` is its peak above what was alive when the backward began
  (gradients of the inputs and weights, the kernels' temporaries, less what it frees). It starts
  from a gradient laid out as the node's consumers give it: first as a new tensor laid out as the
  output, then, once every node has run (in the hook on the graph's output, so inside the run whose
  isolation sets the model's state back), probed again last node first where a consumer's backward
  gave another layout (``_backwards_from_their_gradients``). The first peak stays as
  ``backward_when_sent``: a value sent to the next stage gets its gradient in a new receive buffer;
* the node's forward runs under the same tracker: ``forward`` is its peak above what was alive
  before it (its output, what it saves, and temporaries it frees before it returns).

A storage is told by ``StorageWeakRef`` (identity); every twin and every saved tensor stays
referenced until the probe ends, so no storage is freed and its address reused under another
node's name. Inputs that
require grad reach a node as clones (autograd refuses an in-place write to a leaf that requires
grad), each clone mapped back to the storage it copies; a value that is an autograd view in training
(a Linear's on a 3-D input) as that view of its base's clone, as an in-place write into it makes
autograd copy the base's gradient. Nodes alike (``probe_memo``: the same
function, method or module settings on the same argument layouts, as in a model's repeated blocks)
are probed once: the others get the first one's ``NodeEffect`` applied to their own arguments and a
fresh output of its layout. A node autograd records nothing of (a size, a mask, an index: code that
reads only arguments that want no gradient) is not probed at all: its effect is read off shape
propagation's run (``_untracked``). A node that fake tensors cannot run (control flow on a tensor's
values, as ``nn.TransformerEncoder``'s mask check) or size (a fused RNN's fake kernel saves its
workspace as an empty storage) is probed as any other on one real run, on the values shape propagation
gave it standing for the twins (``_probe_on_real_tensors``); so is a node that ran more kernels than
``REAL_PROBE_KERNELS`` (a recurrent layer runs its own each step), where fake tensors cost more than
a real run. Where shape propagation runs fake tensors, a node they cannot run gets a fake twin of
its value and no facts (the memory model counts its output bytes), and ``unprobed`` names it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import operator
from typing import AbstractSet, Any, Callable, Hashable, Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from autoshard.costs.execution import NodeCall
from autoshard.costs.gradient_order import gradient_order, weights_given_first
from autoshard.costs.layouts import (
    contiguous_in_its_order, dense_order, fills_storage, grad_contiguous, new_strides, obeys_layout_contract,
    order_undone, sent_as_copy)
from autoshard.costs.memory import SavedFacts
from autoshard.costs.probe_memo import (
    CONSTANTS, NodeEffect, OutputTensor, Uncacheable, constant_key, module_key, tensor_key)
from autoshard.costs.values import dense_parts, flat_leaves as _flat
from autoshard.fx_helpers import canonical_tensor_names, writes_in_place
from autoshard.isolation import isolated, values_restored


@contextlib.contextmanager
def without_cyclic_gc() -> Iterator[None]:
    """Python's cycle collector off: run at any allocation, it frees storages of garbage from before
    (an output its own backward saved: a cycle through autograd) at a moment that depends on what
    the process ran before. Entered before ``MemTracker``, which takes its first peak on entry: a
    collection after that peak and before the measurement's start made a node's backward peak
    the garbage's bytes higher (a plan's facts differed within one test run)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _tensors(value: Any) -> list[torch.Tensor]:
    """The strided tensors in ``value``: a sparse tensor has no storage of its own, its parts do."""
    return [part for t in _flat(value) if isinstance(t, torch.Tensor) for part in dense_parts(t)]


def _state(t: torch.Tensor) -> tuple:
    """What later nodes read of an argument that a node may write in place."""
    return t.requires_grad, t.grad_fn is None, tuple(t.shape), t.stride(), t.storage_offset()


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.is_conj(), t.is_neg()


#: Where the functions live that read nothing but their arguments (``_untracked``).
_ARGUMENTS_ONLY_MODULES = ("torch", "_operator", "operator", "builtins", "math")


def _reads_only_arguments(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``node`` computes from its arguments alone: a torch, operator or builtin function, a
    tensor method, or a ``torch.nn`` module (and submodules) without trainable weights or hooks.
    Model code kept whole may read weights it is not given; a user's module or hook may hold anything."""
    if node.op == "call_method":
        return True
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return all(type(m).__module__.startswith("torch.nn.") and not (m._forward_hooks or m._forward_pre_hooks)
                   for m in module.modules()) and not any(p.requires_grad for p in module.parameters())
    return (getattr(node.target, "__module__", None) or "").split(".")[0] in _ARGUMENTS_ONLY_MODULES


#: Tensor methods and attributes that read a tensor's metadata, never its values: autograd records nothing
#: of them whether or not the tensor wants a gradient (``_untracked``).
_METADATA_METHODS = frozenset({"size", "dim", "numel", "nelement", "ndimension", "stride", "storage_offset",
                               "is_contiguous", "element_size", "get_device"})
_METADATA_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "layout", "requires_grad", "is_cuda"})


def _reads_metadata(node: fx.Node) -> bool:
    """Whether ``node`` reads a tensor's metadata only (``x.size(1)``, ``x.shape``)."""
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    return node.op == "call_function" and node.target is getattr and len(node.args) == 2 \
        and node.args[1] in _METADATA_ATTRIBUTES


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _output_leaves(leaves: list[Any], position: dict[StorageWeakRef, int], new: dict[StorageWeakRef, int],
                   storage_of: Callable[[torch.Tensor], StorageWeakRef],
                   ) -> tuple[list[Any], list[tuple[int, torch.dtype]], bool]:
    """An output's ``leaves`` as a ``NodeEffect`` lists them, each tensor in an argument's storage
    (``position``: storage -> index of the first argument in it) or a new one (``new``: storage ->
    its index); the bytes and dtype of each new storage; and whether a replay makes the same:
    constants and plain strided tensors only, each new storage read in one dtype."""
    outputs: list[Any] = []
    storages: dict[int, tuple[int, torch.dtype]] = {}
    replayable = True
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            replayable &= isinstance(leaf, CONSTANTS)
            outputs.append(leaf)
            continue
        ref = storage_of(leaf) if leaf.layout == torch.strided else None
        if ref in new:
            stored = storages.setdefault(new[ref], (leaf.untyped_storage().nbytes(), leaf.dtype))
            replayable &= stored[1] == leaf.dtype and stored[0] % leaf.element_size() == 0
        else:
            replayable &= ref in position
        replayable &= not (leaf.is_conj() or leaf.is_neg())  # a replay makes plain tensors
        outputs.append(OutputTensor(tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype,
                                    leaf.device, leaf.requires_grad, position.get(ref), new.get(ref),
                                    _view_base(leaf)))
    replayable &= sorted(storages) == list(range(len(new)))
    return outputs, [storages[i] for i in sorted(storages)], replayable


def _kept_on_ctx(value: Any, stop: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors a custom ``torch.autograd.Function`` keeps as attributes of its ``ctx`` (``ctx.mask = m``)
    in the autograd graph from ``value`` down to the arguments ``stop``: autograd holds them until the
    graph is freed, as it holds what it saves, but ``saved_tensors_hooks`` never sees them."""
    ends = {t.grad_fn for t in stop if t.grad_fn is not None}
    seen, found, todo = set(), [], [t.grad_fn for t in _tensors(value) if t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen or fn in ends:
            continue
        seen.add(fn)
        if isinstance(fn, torch.autograd.function.BackwardCFunction):
            found += _tensors(list(vars(fn).values()))
        todo += [next_fn for next_fn, _ in fn.next_functions]
    return found


def _view_base(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """The layout of the tensor strided ``t`` is an autograd view of, None where it is none: an in-place
    write into a view makes autograd copy the base's gradient in backward (``CopySlices``)."""
    base = t._base if t.layout == torch.strided and t._is_view() else None
    return None if base is None else (tuple(base.shape), base.stride(), base.storage_offset())


class _Unsized(Exception):
    """A node whose fake run saved an empty storage of its own, and no real run to size it."""


def _reached(node: fx.Node, value: Any) -> tuple[bool, tuple[int, ...] | None]:
    """Where a gradient cannot reach ``node``'s output ``value``: autograd gives none to an item of a
    tuple that nothing reads (attention's averaged weights). Whether ``node`` is such an item (its
    backward then hands nothing back), and, for a tuple of tensors every reader takes one item of,
    the items read (the node's backward runs no part for the others); None for any other value."""
    users = list(node.users)
    unread = _is_item(node) and not users and isinstance(value, torch.Tensor)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value) \
            and users and all(_is_item(u) and isinstance(u.args[1], int) for u in users):
        return unread, tuple(sorted({u.args[1] for u in users if u.users}))
    return unread, None


#: Where ``FakeTensorMode`` logs, with its traceback, each kernel it could not run (Mixtral's
#: ``_grouped_mm`` wants bf16 on CPU) before it raises: 88 lines on a tiny Mixtral, for failures the
#: probe catches (``_probe_on_real_tensors``) or reports (``unprobed``).
_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")

#: Kernels past which a node is probed on shape propagation's real tensors, where it has them: on
#: fake ones each kernel costs milliseconds of Python dispatch, forward and backward, probed twice
#: where its consumers' gradient comes in another layout. A recurrent layer runs its kernels once a
#: step: a 2-layer GRU on 32 steps runs 916 (planning it took 25-39 s, 2-3 s on real tensors, the
#: same bytes predicted); the largest node of the Hugging Face zoo runs 59 (a SegFormer stage).
REAL_PROBE_KERNELS = 128


def _quiet(record: logging.LogRecord) -> bool:
    return False


def _zeros_strided(like: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    return torch.empty_strided(like.shape, strides, dtype=like.dtype, device=like.device).zero_()


def _is_item(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _at_argument(strides: tuple[int, ...] | None, wanted: torch.Tensor,
                 argument: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of ``argument``'s gradient, given as ``strides`` to ``wanted``: the base standing for a
    view argument (``TrainingProbe._clone_in_training``) gets its gradient laid out as the base is, which
    at the argument's place is laid out as the argument."""
    if strides is None or (wanted.shape, wanted.stride()) == (argument.shape, argument.stride()):
        return strides
    return argument.stride() if tuple(strides) == wanted.stride() else None


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in a storage of its own laid out as ``t`` is, gaps included (``clone`` packs a
    slice densely, so a view of it, the node's output, would fill its storage where the real one does not)."""
    if t.layout != torch.strided or fills_storage(t):
        return t.clone()
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


class _Handed(nn.Module):
    """The modules a function is handed (``apply_tf_padding(x, conv)``), as the children of one
    module, so that ``functional_call`` puts fake leaves in their weights' places while it runs."""

    def __init__(self, modules: list[nn.Module], call: NodeCall) -> None:
        super().__init__()
        for i, module in enumerate(modules):
            self.add_module(str(i), module)
        self.call = call

    def forward(self, args: tuple, kwargs: dict) -> Any:
        return self.call.run(args, kwargs)


class TrainingProbe:
    """Runs beside shape propagation: ``measure(call, value)`` after each node, ``facts()`` at the end."""

    def __init__(self, gm: fx.GraphModule, memo: bool = True) -> None:
        """``memo=False`` probes every node on its own, none applied from another or read off the run
        (``_untracked``): tests compare the two."""
        self.gm = gm
        self.fake: FakeTensorMode | None = None  # the run's own fake mode, or one of the probe's
        self.real_run = False  # whether shape propagation runs real tensors (``_probe_on_real_tensors``)
        self.twins: dict[fx.Node, Any] = {}  # fx node -> its fake value with gradients (kept: see above)
        self.sources: dict[fx.Node, tuple[str | None, ...]] = {}  # see ``_sources``
        self.owner: dict[StorageWeakRef, str | None] = {}  # storage -> node that made it (None: weight, input)
        self.nbytes: dict[StorageWeakRef, int] = {}
        self.copy_of: dict[StorageWeakRef, StorageWeakRef] = {}  # a clone's storage -> the one it copies
        self.saved_storages: set[StorageWeakRef] = set()
        self.savers: dict[StorageWeakRef, list[str]] = {}  # storage some node made -> the nodes saving it, in order
        self.saved: dict[str, int] = {}
        # node -> storages of its output it made, in the order its tensors come
        self.outputs: dict[str, tuple[StorageWeakRef, ...]] = {}
        self.releases: dict[str, dict[str, int]] = {}  # first saver -> node that made them -> bytes
        self.saves_from: dict[str, tuple[str, ...]] = {}  # node -> the nodes whose storages it saves of what it reads
        self.grad: dict[str, int] = {}
        self.backward: dict[str, int] = {}
        self.forward: dict[str, int] = {}
        self.backward_when_sent: dict[str, int] = {}  # node -> its first probe's backward, where it differs
        # node -> (order of a receive buffer handed to it, its backward from that buffer), where it differs
        self.backward_when_handed: dict[str, tuple[tuple[tuple[int, ...], int], ...]] = {}
        self.passes_on: dict[str, tuple[str, ...]] = {}  # node -> inputs it hands its gradient as it came
        self.views: dict[str, str] = {}  # node that made no storage -> the node whose storage its output is
        self.holds: dict[str, tuple[str, ...]] = {}  # node -> the other nodes whose storages its output holds too
        self.part: dict[str, tuple[int, ...]] = {}  # node -> the storages of ``views``' output it lives in (indices)
        self.input_grads: dict[str, tuple[tuple[str, bool], ...]] = {}  # node -> inputs its backward gives to
        self.strided_grads: dict[str, tuple[str, ...]] = {}  # node -> inputs it gives a non-contiguous gradient
        # node -> ``strided_grads`` of its first probe, from a gradient laid out as a new tensor (a receive buffer)
        self.strided_when_sent: dict[str, tuple[str, ...]] = {}
        self.when_contiguous: dict[str, tuple[int, int, int, tuple[str, ...]]] = {}  # see _when_received_contiguous
        self.order = {node.name: i for i, node in enumerate(gm.graph.nodes)}
        # id of a twin -> (order of the node whose backward gave it a gradient, the last to run forward; its strides)
        self.gradient_layouts: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.rerunnable: dict[str, tuple[NodeCall, Hashable | None]] = {}  # node -> its call, its key
        self.weights: dict[int, torch.Tensor] = {}  # id of a parameter or buffer -> its fake leaf
        self.leaves: set[int] = set()  # ids of those leaves
        self.names = canonical_tensor_names(gm)  # id of a parameter or buffer -> its name, as the DAG's
        self.leaf_names: dict[int, str] = {}  # id of a leaf -> that name
        self.weight_grads: dict[str, tuple[str, ...] | None] = {}  # node -> the weights its backward gives a gradient
        self.weights_first: set[str] = set()  # nodes whose weights get their gradients before their inputs
        self.gradients_kept: dict[str, int] = {}  # node -> what its backward's peak adds keeping its weights' ones
        self.gradient_copies: dict[str, int] = {}  # node -> bytes of those AccumulateGrad copies to keep them
        self.writes: dict[str, tuple[str, ...]] = {}  # node -> the inputs it writes into in place
        self.backward_alone: dict[str, int | None] = {}  # node -> its backward peak, its gradient freed when used
        self.kept: list[Any] = []
        self.stand_ins: dict[int, torch.Tensor] = {}  # id of a twin -> the real tensor standing for it
        # id of a twin (or stand-in) -> the layout of the base its value is an autograd view of in training
        self.bases: dict[int, tuple[tuple[int, ...], tuple[int, ...], int]] = {}
        self.unprobed: list[str] = []
        self.unrun: set[str] = set()  # the nodes whose forward fake tensors could not run: no facts
        from autoshard.costs.trackers import KeptGradientsTracker  # (its import is slow: see trackers)

        self.tracker = KeptGradientsTracker()
        self.memo: dict[Hashable, Any] | None = {} if memo else None  # a node's key -> its effect (or forward peak)

    # -- storages -------------------------------------------------------------------------
    def original(self, ref: StorageWeakRef) -> StorageWeakRef:
        while ref in self.copy_of:
            ref = self.copy_of[ref]
        return ref

    def own(self, value: Any, owner: str | None) -> None:
        for t in _tensors(value):
            ref = self.original(_storage(t))
            if ref not in self.owner:
                self.owner[ref] = owner
                self.nbytes[ref] = t.untyped_storage().nbytes()

    def release(self, saver: str, maker: str, nbytes: int) -> None:
        """``saver`` is the first to save ``nbytes`` of ``maker``'s: autograd frees them after its backward."""
        by_maker = self.releases.setdefault(saver, {})
        by_maker[maker] = by_maker.get(maker, 0) + nbytes

    def saved_output(self, name: str, unsaved: AbstractSet[StorageWeakRef] = frozenset()) -> int:
        """Bytes of the storages ``name``'s output made that some node saved (``unsaved``: but these)."""
        return sum(saved for _, saved in self.parts(name, unsaved))

    def parts(self, name: str, unsaved: AbstractSet[StorageWeakRef] = frozenset()) -> list[tuple[int, int]]:
        """Per storage ``name``'s output made, in order: its bytes and those of them some node saved
        (``unsaved``: but these)."""
        return [(self.nbytes[ref], self.nbytes[ref] if ref in self.saved_storages and ref not in unsaved else 0)
                for ref in self.outputs[name]]

    def _saved_by_the_used(self, unused: AbstractSet[str],
                           ) -> tuple[dict[str, int], dict[str, dict[str, int]], set[StorageWeakRef]]:
        """``saved`` and ``releases`` with what only ``unused`` nodes save left out, and the storages so left
        out. A storage is charged to its maker when first saved, and released after that first saver's backward;
        where that saver is unused, nothing holds its autograd node after the forward, so it keeps the storage
        no longer: the first used node saving it is the one that keeps it (and frees it after its backward),
        and where none does, nothing keeps it (a live value only a dropped node saved)."""
        saved = dict(self.saved)
        releases = {saver: dict(by_maker) for saver, by_maker in self.releases.items()}
        unsaved: set[StorageWeakRef] = set()
        for ref, savers in self.savers.items():
            first, owner = savers[0], self.owner.get(ref)
            if first not in unused or owner is None:
                continue
            nbytes = self.nbytes[ref]
            if owner != first:  # (an unused node's own charges count nothing: see ``facts``)
                saved[owner] = saved.get(owner, 0) - nbytes
                releases[first][owner] = releases[first].get(owner, 0) - nbytes
            keeper = next((saver for saver in savers if saver not in unused), None)
            if keeper is None:
                unsaved.add(ref)
                continue
            if owner == first:  # a storage no node made (a module's unregistered tensor): its first used saver's
                owner = keeper
            saved[owner] = saved.get(owner, 0) + nbytes
            by_maker = releases.setdefault(keeper, {})
            by_maker[owner] = by_maker.get(owner, 0) + nbytes
        return saved, releases, unsaved

    # -- running ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _tracked(self, *existing: torch.Tensor) -> Iterator[Callable[[], int]]:
        """``MemTracker`` on, with ``existing`` registered first (it counts a storage it has not seen
        when an operator first touches it, as if it were new); yields the peak above where it started."""
        self.tracker.track_external(*existing)
        with without_cyclic_gc(), self.tracker:  # in this order: see ``without_cyclic_gc``
            start = self.tracker.total("current")
            yield lambda: max(0, self.tracker.total("peak") - start)

    @contextlib.contextmanager
    def _in_fake_mode(self) -> Iterator[FakeTensorMode]:
        """The fake mode the probe runs in, with every other mode (the FLOP counter) set aside, and
        without its dispatch cache, which every fake mode of the process shares: a plan's facts once
        differed by a few bytes after other plans were made in the same test run, and the cache is
        the state plans share (not proven the cause; the flake did not come back in reruns)."""
        assert self.fake is not None
        cached, self.fake.cache_enabled = self.fake.cache_enabled, False
        _FAKE_TENSOR_LOG.addFilter(_quiet)  # a kernel fake tensors cannot run is the probe's to handle
        try:
            with _disable_current_modes(), self.fake:
                yield self.fake
        finally:
            self.fake.cache_enabled = cached
            _FAKE_TENSOR_LOG.removeFilter(_quiet)

    def twin(self, t: torch.Tensor) -> torch.Tensor:
        """A fake tensor of ``t``'s shape in the probe's mode (``t`` itself when it is one)."""
        assert self.fake is not None
        return t if isinstance(t, FakeTensor) and t.fake_mode is self.fake else self.fake.from_tensor(t)

    def wrapped(self, meta: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Meta tensor ``meta`` as a fake tensor of the probe's mode on ``device``: wrapped, not made by
        an operator run through the fake mode, which costs about a millisecond each."""
        assert self.fake is not None
        return self.fake.fake_tensor_converter.from_meta_and_device(self.fake, meta, device)

    def fresh(self, like: torch.Tensor, strides: tuple[int, ...] | None = None) -> torch.Tensor:
        """A fake tensor of strided ``like``'s shape, dtype and device in a storage of its own (``wrapped``),
        with ``strides`` (``like``'s own by default)."""
        with _disable_current_modes():
            meta = torch.empty_strided(like.shape, like.stride() if strides is None else strides,
                                       dtype=like.dtype, device="meta")
            return self.wrapped(meta, like.device)

    def weight(self, t: torch.Tensor) -> torch.Tensor:
        """The fake leaf standing for parameter or buffer ``t``, one per tensor."""
        if id(t) not in self.weights:
            plain = t.layout == torch.strided and type(t) in (torch.Tensor, nn.Parameter)
            twin = self.fresh(t) if plain else self.twin(t).detach()
            leaf = twin.requires_grad_(t.requires_grad and (t.is_floating_point() or t.is_complex()))
            self.weights[id(t)] = leaf
            self.leaves.add(id(leaf))
            if id(t) in self.names:
                self.leaf_names[id(leaf)] = self.names[id(t)]
            self.kept.append((t, leaf))
            self.own(leaf, None)
        return self.weights[id(t)]

    def measure(self, call: NodeCall, value: Any, kernels: int = 0) -> None:
        """Probe ``call``'s node; ``value`` is what shape propagation computed for it, running
        ``kernels`` operators (``REAL_PROBE_KERNELS``)."""
        node = call.node
        if self.fake is None:  # chosen while the run is on: a fake run's own mode, if it is one
            self.real_run = active_fake_mode() is None
            self.fake = active_fake_mode() or FakeTensorMode(allow_non_fake_inputs=True)
        if node.op == "output":  # every node has run; the model's state is set back after this hook
            self._backwards_from_their_gradients()
            self._backwards_from_receive_buffers()
            return
        if node.op in ("get_attr", "placeholder"):
            with self._in_fake_mode():
                if node.op == "get_attr":
                    twin = tree_map_only(torch.Tensor, self.weight, value)
                else:
                    twin = tree_map_only(torch.Tensor, lambda t: self.twin(t).detach(), value)
                    self.own(twin, None)
        else:
            twin = self._compute(call, value, kernels)
        self.twins[node] = twin
        self.kept.append(twin)

    def _inputs(self, args: tuple, kwargs: dict,
                ) -> tuple[tuple, dict, list[tuple[torch.Tensor, torch.Tensor, int | None]]]:
        """The node's arguments, those that require grad cloned (in-place writes stay legal), one
        clone per tensor however often it is given (``q is k`` decides attention's path), laid out as
        training has them (``_clone_in_training``); for each tensor that wants a gradient, the tensor
        standing for it before the node runs, its clone (the same for a weight), and the index of the
        tensor argument it first stands for (None: a weight, which no other node makes)."""
        wanted: dict[int, tuple[torch.Tensor, torch.Tensor, int | None]] = {}  # id -> before, clone, index
        index = itertools.count()

        def prepare(t: torch.Tensor) -> torch.Tensor:
            i = next(index)  # the tensors come in ``tree_flatten``'s order, as ``arguments`` lists them
            if not t.requires_grad:
                return t
            if id(t) not in wanted:
                if id(t) in self.leaves:
                    wanted[id(t)] = (t, t, None)
                else:
                    before, copy = self._clone_in_training(t)
                    self.copy_of[_storage(copy)] = self.original(_storage(t))
                    self.kept.append((before, copy))
                    wanted[id(t)] = (before, copy, i)
            return wanted[id(t)][1]

        args, kwargs = tree_map_only(torch.Tensor, prepare, (args, kwargs))
        return args, kwargs, list(wanted.values())

    def _clone_in_training(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A clone of ``t`` (``_clone``), and ``t`` itself, which the clone's backward hands its gradient.
        Where ``t``'s value is an autograd view of a base filling its storage (``bases``: a Linear on
        a 3-D input returns one of its ``addmm``), the clone is that view of a clone of the base, and
        the base, a leaf in ``t``'s storage, stands for ``t``: an in-place write into the view makes
        autograd copy the base's gradient in backward (``CopySlices``, ``AsStridedBackward``), which a
        write into a dense clone does not."""
        layout = self.bases.get(id(t))
        if layout is not None and not layout[2]:
            base = t.detach().as_strided(*layout)
            if fills_storage(base) and base.numel() * base.element_size() == t.untyped_storage().nbytes():
                base.requires_grad_()
                order = dense_order(t)
                if base.is_contiguous() and order is not None and [t.shape[d] for d in order] == list(base.shape):
                    # a permute's view (a channels-last map received as the wire sends it), whose backward copies
                    # nothing, where ``as_strided``'s makes a buffer of the base's size
                    return base, base.clone().permute(order_undone(order))
                return base, base.clone().as_strided(t.shape, t.stride(), t.storage_offset())
        return t, _clone(t)

    def _run(self, call: NodeCall, args: tuple, kwargs: dict, real: bool = False) -> tuple[Any, list[torch.Tensor]]:
        """Run the node; a module, or a function handed modules, runs on fake leaves for their weights
        (``real``: real leaves standing for them; returned: they want gradients)."""
        node = call.node
        leaves = self._weights(node, real)
        if node.op == "call_module":
            value = torch.func.functional_call(self.gm.get_submodule(str(node.target)), leaves, args, kwargs)
        elif leaves:
            handed = _Handed(self._handed(node), call)
            self.kept.append(handed)  # ``MemTracker``'s backward hooks look it up
            value = torch.func.functional_call(handed, leaves, (args, kwargs))
        else:
            return call.run(args, kwargs), []
        return value, [t for t in {id(t): t for t in leaves.values()}.values() if t.requires_grad]

    def _handed(self, node: fx.Node) -> list[nn.Module]:
        """The modules among the arguments of ``node`` (a function handed ``conv``), once each."""
        twins = [self.twins.get(a) for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]
        return list({id(m): m for m in twins if isinstance(m, nn.Module)}.values())

    def _weights_by_name(self, node: fx.Node) -> dict[str, torch.Tensor]:
        """The parameters and buffers themselves, by name, of a module node's module, or of the modules
        another node is handed (under ``_Handed``'s names)."""
        if node.op == "call_module":
            modules = {"": self.gm.get_submodule(str(node.target))}
        else:
            modules = {f"{i}.": module for i, module in enumerate(self._handed(node))}
        return {prefix + name: t for prefix, module in modules.items()
                for name, t in [*module.named_parameters(remove_duplicate=False),
                                *module.named_buffers(remove_duplicate=False)]}

    def _weights(self, node: fx.Node, real: bool = False) -> dict[str, torch.Tensor]:
        """The parameters and buffers by name, as fake leaves (``real``: real leaves standing for them),
        of a module node's module, or of the modules another node is handed (under ``_Handed``'s names)."""
        named = self._weights_by_name(node)
        if real:
            return {name: self._stand_in(t, self.weight(t)) for name, t in named.items()}
        return {name: self.weight(t) for name, t in named.items()}

    @contextlib.contextmanager
    def _gradients_written(self, node: fx.Node, real: bool,
                           ) -> Iterator[tuple[list[nn.Parameter], list[torch.Tensor], set[int]]]:
        """The trainable parameters of ``node``'s modules (``_weights``; autograd refuses a hook on a frozen
        one), the fake tensors the fake mode reads them as (none on real tensors), and, filled in on exit,
        the ids of the leaves standing for those its backward gave a gradient outside the graph it walks: a
        custom Function whose backward runs a backward of its own (Reformer's reversible layers recompute
        theirs) adds into ``.grad`` of the modules' own parameters, which autograd's result never shows,
        but ``torch.optim`` keeps state for. Their ``.grad`` is set aside meanwhile, so that the backward
        makes each anew, as a weight's, and given back: the user's model keeps its own, not one added into."""
        params = [t for t in self._weights_by_name(node).values() if isinstance(t, nn.Parameter) and t.requires_grad]
        grads = [p.grad for p in params]
        read_as = [] if real or self.fake is None else [self.fake.from_tensor(p) for p in params]
        written: set[int] = set()
        for p in params:
            p.grad = None
        try:
            yield params, read_as, written
            for p in params:
                if p.grad is not None:
                    leaf = self.weight(p)
                    written.add(id(self.stand_ins.get(id(leaf), leaf) if real else leaf))
        finally:
            for p, grad in zip(params, grads):
                p.grad = grad

    def weight_leaves(self, node: fx.Node, arguments: list[torch.Tensor], real: bool = False) -> list[torch.Tensor]:
        """The fake leaves of the weights ``node`` may give a gradient, once each, in an order nodes
        probed alike share: those among its tensor arguments, then its module's or those of the
        modules it is handed (``_weights``)."""
        leaves = [*(t for t in arguments if id(t) in self.leaves), *self._weights(node, real).values()]
        return list({id(t): t for t in leaves if t.requires_grad}.values())

    def _key(self, node: fx.Node, flat: list[Any], spec: Any, value: Any) -> Hashable | None:
        """What decides ``node``'s probe (``probe_memo``), or None where it cannot be told by value."""
        if self.memo is None:
            return None
        storages: dict[StorageWeakRef, int] = {}
        objects: dict[int, int] = {}  # which arguments are one tensor (``q is k`` decides attention's path)
        try:
            arguments = tuple(tensor_key(x, storages, lambda t: self.original(_storage(t)))
                              + (id(x) in self.leaves, objects.setdefault(id(x), len(objects)), self.bases.get(id(x)))
                              if isinstance(x, torch.Tensor) else constant_key(x) for x in flat)
            target = module_key(self.gm.get_submodule(str(node.target))) if node.op == "call_module" else node.target
            key = (node.op, target, spec, arguments, _reached(node, value))
            hash(key)
            return key
        except (Uncacheable, TypeError):  # TypeError: a value that cannot be hashed
            return None

    def _compute(self, call: NodeCall, real: Any, kernels: int) -> Any:
        name = call.node.name
        args, kwargs = fx.node.map_arg((call.node.args, call.node.kwargs), self.twins.__getitem__)
        flat, spec = tree_flatten((args, kwargs))
        arguments = [x for x in flat if isinstance(x, torch.Tensor)]
        key = self._key(call.node, flat, spec, real)
        effect = None if key is None else self.memo.get(key)
        if effect is None and self.memo is not None:
            effect = self._untracked(call, real, arguments, (args, kwargs), key)
        reusable = effect is not None
        if effect is not None:
            value = self._replay(effect, arguments)  # outside the fake mode: entering it costs more than a replay
        else:
            real_first = kernels > REAL_PROBE_KERNELS
            probed = self._probe_on_real_tensors(call, args, kwargs) if real_first else None
            if probed is None:
                try:
                    with self._in_fake_mode():
                        effect, value, reusable = self._probe(call, args, kwargs, arguments)
                except Exception:  # noqa: BLE001 - what fake tensors cannot run: probed on real ones, or unprobed
                    probed = None if real_first else self._probe_on_real_tensors(call, args, kwargs)  # (tried once)
                    if probed is None:
                        self.unprobed.append(name)
                        self.unrun.add(name)
                        self.outputs[name], self.grad[name], self.backward[name] = (), 0, 0
                        with self._in_fake_mode():
                            twin = tree_map_only(torch.Tensor, lambda t: self.twin(t).detach(), real)
                        self.own(twin, name)
                        return twin
            if probed is not None:
                (effect, value), reusable = probed, False
            if reusable and key is not None:
                self.memo[key] = effect  # key is None whenever memo is
        self._apply(name, effect, [self.original(_storage(arguments[i])) for i in effect.saved_arguments], value)
        for leaf, made in zip(_flat(value), effect.leaves):
            if isinstance(made, OutputTensor) and made.base is not None:
                self.bases[id(leaf)] = made.base
        if effect.written:
            sources = self._sources(call.node)
            self.writes[name] = tuple(dict.fromkeys(s for i in effect.written if (s := sources[i]) is not None))
        self._record_gradients(call.node, effect, arguments)
        self._record_passes_on(call.node, effect, arguments, value)
        self._record_weight_gradients(call.node, effect, arguments)
        self._when_received_contiguous(call, args, kwargs, arguments, effect, key)
        if reusable and effect.grad and effect.input_grads is not None:  # it may run again, as a replay would
            self.rerunnable[name] = (call, key)
        return value

    def _when_received_contiguous(self, call: NodeCall, args: tuple, kwargs: dict, arguments: list[torch.Tensor],
                                  effect: NodeEffect, key: Hashable | None) -> None:
        """Probe the node again where an input another node made has gaps in its storage (a slice), or is
        one the node writes into in place, with that input as a later stage receives it: a new contiguous
        tensor (the wire sends a contiguous copy; the stage reads it through ``contiguous_grad``), or, for
        one filling its storage in another order (channels-last), a permute of one, as it crosses. An
        ``nn.Linear`` on a sliced 3D input copies it and saves the copy, on a contiguous one neither;
        ``mul_`` into a Linear's 3-D output, an autograd view, makes autograd copy the base's gradient
        (``CopySlices``), into a received one not, and into a received channels-last map it does. Recorded
        in ``when_contiguous``: the change in what it saves of its own, its forward and backward peaks, and
        the inputs it then gives a non-contiguous gradient."""
        if effect.input_grads is None or not any(t.requires_grad for t in arguments) or _reads_metadata(call.node):
            return  # (a node no gradient reaches, or that reads a size, saves nothing and has no backward)
        strided = {i for i, t in enumerate(arguments)
                   if (sent_as_copy(t) or i in effect.written and (id(t) in self.bases or dense_order(t)))
                   and self.owner.get(self.original(_storage(t)))}
        if not strided:
            return
        memo_key = None if key is None else ("contiguous", key)
        alike = None if memo_key is None else self.memo.get(memo_key)
        if alike is None:
            index = itertools.count()

            def contiguous(t: torch.Tensor) -> torch.Tensor:
                if next(index) not in strided:
                    return t
                order = None if sent_as_copy(t) else dense_order(t)
                sent = t if order is None else t.permute(order)  # what the wire sends, as a new contiguous tensor
                with _disable_current_modes():
                    strides = torch.empty(sent.shape, device="meta").stride()
                received = self.fresh(sent, strides)
                if order is None:
                    return received.requires_grad_(t.requires_grad)
                view = received.permute(order_undone(order)).requires_grad_(t.requires_grad)
                self.bases[id(view)] = (tuple(received.shape), received.stride(), 0)
                return view

            with self._in_fake_mode():
                copies = tree_map_only(torch.Tensor, contiguous, (args, kwargs))
            given = [x for x in tree_flatten(copies)[0] if isinstance(x, torch.Tensor)]
            self.kept.append(copies)
            unprobed = len(self.unprobed)
            try:
                with self._in_fake_mode():
                    alike, _, _ = self._probe(call, *copies, given)
            except Exception:  # noqa: BLE001 - it ran once: a second run that fails leaves the first's facts
                return
            finally:
                del self.unprobed[unprobed:]  # a backward that fails here is no news of the node
            if memo_key is not None:
                self.memo[memo_key] = alike
        if alike.input_grads is None:
            return
        sources = self._sources(call.node)  # (a contiguous copy has its argument's shape, all grad_contiguous reads)
        given_strided = tuple(dict.fromkeys(sources[i] for i, _, strides in alike.input_grads
                                            if sources[i] is not None and not grad_contiguous(arguments[i], strides)))
        own = sum(nbytes for nbytes, _ in alike.saved_new) - sum(nbytes for nbytes, _ in effect.saved_new)
        self.when_contiguous[call.node.name] = (own, alike.forward, alike.backward, given_strided)

    def _record_gradients(self, node: fx.Node, effect: NodeEffect, arguments: list[torch.Tensor]) -> None:
        """Which inputs ``node``'s backward gives a gradient (``input_grads``), and in what layout: kept per
        argument for the backward of the node that made it, unless a node that ran later gave it one (its
        backward runs first, and autograd adds the others into that buffer)."""
        if effect.input_grads is None:
            return
        sources, given = self._sources(node) if effect.input_grads else [], {}
        order = self.order[node.name]
        strided: dict[str, None] = {}
        for i, handed, strides in effect.input_grads:
            if self.gradient_layouts.get(id(arguments[i]), (order,))[0] <= order:
                self.gradient_layouts[id(arguments[i])] = (order, strides)
            if sources[i] is not None:  # two tensors of one value (a tuple's) get a sum: a new buffer
                given[sources[i]] = handed and sources[i] not in given
                if not contiguous_in_its_order(arguments[i], strides):
                    strided[sources[i]] = None
        self.input_grads[node.name] = tuple(given.items())
        self.strided_grads[node.name] = tuple(strided)
        self.strided_when_sent.setdefault(node.name, tuple(strided))  # (the first probe's: see ``_probe``)

    def _record_passes_on(self, node: fx.Node, effect: NodeEffect, arguments: list[torch.Tensor], value: Any) -> None:
        """The inputs ``node``'s backward hands the gradient it got itself, laid out as it came (an addition's
        addends, an identity's input; not a view's, which hands a view laid out anew): a receive buffer
        reaches them as it is (``passes_on``). Read off the first probe, whose gradient is a new tensor. A
        container of tensors (a ``ModelOutput``) hands each its gradient itself: those of its inputs it holds."""
        if not effect.input_grads:
            return
        if isinstance(value, torch.Tensor):  # the inputs given a gradient of its shape, laid out as it came
            incoming = new_strides(value)
            as_it_came = {i for i, _, strides in effect.input_grads if arguments[i].shape == value.shape
                          and strides is not None and tuple(strides) == incoming}
        else:  # its items that are an argument itself: no view of it
            as_it_came = {made.argument for made in effect.leaves if isinstance(made, OutputTensor)
                          and made.argument is not None and (made.shape, made.stride, made.offset) == (
                              tuple(arguments[made.argument].shape), arguments[made.argument].stride(),
                              arguments[made.argument].storage_offset())}
        sources = self._sources(node)
        passes_on = tuple(dict.fromkeys(sources[i] for i, handed, _ in effect.input_grads
                                        if handed and sources[i] is not None and i in as_it_came))
        if passes_on:
            self.passes_on[node.name] = passes_on

    def _record_weight_gradients(self, node: fx.Node, effect: NodeEffect, arguments: list[torch.Tensor]) -> None:
        """Which weights ``node``'s backward gives a gradient (``weight_grads``), by their names in the DAG:
        a function handed a module may read no weight of it (``apply_tf_padding`` reads the conv's settings);
        and whether it gives them theirs before its inputs (``weights_first``)."""
        if effect.weights_first:
            self.weights_first.add(node.name)
        if not effect.weight_grads:  # None (its backward did not run) or none
            self.weight_grads[node.name] = effect.weight_grads
            return
        leaves = self.weight_leaves(node, arguments)
        self.weight_grads[node.name] = tuple(dict.fromkeys(
            self.leaf_names[id(leaves[p])] for p in effect.weight_grads if id(leaves[p]) in self.leaf_names))

    def _untracked(self, call: NodeCall, real: Any, arguments: list[torch.Tensor], twins: tuple,
                   key: Hashable | None) -> NodeEffect | None:
        """The effect of a node autograd records nothing of, read off shape propagation's run of it, or
        None to probe it. Such a node reads only its arguments (a torch or builtin function, a tensor
        method, a ``torch.nn`` module without trainable weights; tensors and constants only among the
        arguments, no object that may hide tensors or code) and no argument wants a gradient, or it reads
        metadata only (a size, a shape: 19 of a 12-layer GPT-2's 78 probes were those): it saves
        nothing and has no backward (a size, a mask, an index), and its output has the layout
        the run made from arguments laid out as these. Not memoised: the run's output may depend on
        values (``nonzero``, ``arange(n.item())``), which a key of layouts does not see. Its forward
        peak is the run's output or, where it makes one, ``_forward_without_gradients``'s."""
        if any(t.requires_grad for t in arguments) and not _reads_metadata(call.node) \
                or not _reads_only_arguments(call.node, self.gm):
            return None
        flat, _ = tree_flatten((call.args, call.kwargs))
        if not all(isinstance(x, (torch.Tensor, slice, *CONSTANTS)) for x in flat):
            return None
        run_arguments = [x for x in flat if isinstance(x, torch.Tensor)]
        if len(run_arguments) != len(arguments):
            return None
        position: dict[StorageWeakRef, int] = {}
        groups: dict[StorageWeakRef, int] = {}
        for i, (ran, twin) in enumerate(zip(run_arguments, arguments)):
            if ran.layout != torch.strided or _layout(ran) != _layout(twin):
                return None
            position.setdefault(_storage(ran), i)
            if position[_storage(ran)] != groups.setdefault(self.original(_storage(twin)), i):
                return None  # the arguments share storages otherwise than the twins do
        leaves, spec = tree_flatten(real)
        if any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves):
            return None
        new: dict[StorageWeakRef, int] = {}
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and _storage(leaf) not in position:
                new.setdefault(_storage(leaf), len(new))
        outputs, storages, replayable = _output_leaves(leaves, position, new, _storage)
        if not replayable:
            return None
        made = sum(nbytes for nbytes, _ in storages)  # nothing else: no gradient, so nothing saved
        forward = max(made, self._forward_without_gradients(call, *twins, key)) if made else 0
        return NodeEffect((), (), tuple(storages), spec, tuple(outputs), 0, 0, (), forward)

    def _forward_without_gradients(self, call: NodeCall, args: tuple, kwargs: dict, key: Hashable | None) -> int:
        """The forward peak of a node autograd records nothing of, which shape propagation's run does not
        show: the temporaries it frees before it returns (``F.cosine_similarity`` expands both inputs to
        their broadcast shape, 70x its output). Run under the tracker on fake copies of its arguments,
        so an in-place write changes no twin; 0 where fake tensors cannot run it (an output that
        depends on values: its bytes stand). Memoised by ``key``: a fake run reads layouts only."""
        memo_key = None if key is None else ("forward", key)
        if memo_key in self.memo:
            return self.memo[memo_key]
        with self._in_fake_mode():
            copies = tree_map_only(torch.Tensor, lambda t: self.fresh(t) if t.layout == torch.strided else t,
                                   (args, kwargs))
            self.tracker.forget_modules()
            try:
                with self._tracked(*_tensors(copies), *self._weights(call.node).values()) as peak:
                    self.kept.append(self._run(call, *copies))  # kept: see the class's note on storages
                    found = peak()
            except Exception:  # noqa: BLE001 - a value-dependent output fake tensors cannot make
                found = 0
        self.kept.append(copies)
        if memo_key is not None:
            self.memo[memo_key] = found
        return found

    def _sources(self, node: fx.Node) -> list[str | None]:
        """For each tensor argument of ``node``, in ``tree_flatten``'s order, the node whose value it is
        part of (None: a constant tensor written into the graph). Counted, not marked in place: a
        container may refuse a marker for a tensor (a ``PackedSequence`` checks its fields). Kept per
        node (asked up to four times a node; its arguments' twins are set once)."""
        if node in self.sources:
            return list(self.sources[node])
        sources: list[str | None] = []
        for leaf in tree_flatten((node.args, node.kwargs))[0]:
            if isinstance(leaf, fx.Node):
                tensors = sum(isinstance(t, torch.Tensor) for t in _flat(self.twins[leaf]))
                sources += [leaf.name] * tensors
            elif isinstance(leaf, torch.Tensor):
                sources.append(None)
        self.sources[node] = tuple(sources)
        return sources

    def _new_storages(self, value: Any) -> list[tuple[StorageWeakRef, int]]:
        """The storages of ``value`` no earlier value owns, in the order its tensors come."""
        found: dict[StorageWeakRef, int] = {}
        for t in _tensors(value):
            ref = self.original(_storage(t))
            if ref not in self.owner:
                found.setdefault(ref, t.untyped_storage().nbytes())
        return list(found.items())

    def _probe(self, call: NodeCall, args: tuple, kwargs: dict, arguments: list[torch.Tensor],
               layouts: list[tuple[int, ...] | None] | None = None, real: bool = False,
               ) -> tuple[NodeEffect, Any, bool]:
        """Run the node with gradients under the saved-tensor hooks and ``MemTracker``: its effect
        (relative to ``arguments``), its output as fake leaves, and whether the effect may serve
        another node of the same key. ``layouts``: per tensor of the output, the strides of the
        gradient its backward starts from (None: laid out as ``torch.empty_like`` lays out a new one).
        ``real``: the arguments are real tensors standing for the twins (``_probe_on_real_tensors``)."""
        packed: dict[StorageWeakRef, int] = {}  # storage saved -> its bytes, in the order saved
        held: list[torch.Tensor] = []  # the tensors saved, until it is known which are the node's own temporaries

        foreign: dict[StorageWeakRef, int] = {}  # saved storages the probe's mode did not make (a module's
        # unregistered tensor): the first node to save one is charged, as for any value made before

        def pack(t: torch.Tensor) -> torch.Tensor:
            held.append(t)
            ref = self.original(_storage(t))
            mine = real or isinstance(t, FakeTensor) and t.fake_mode is self.fake
            (packed if mine or ref in self.owner else foreign).setdefault(ref, t.untyped_storage().nbytes())
            return t

        before = [_state(t) for t in arguments]
        self.tracker.forget_modules()
        with torch.enable_grad():
            args, kwargs, inputs = self._inputs(args, kwargs)
            versions = [copy._version for _, copy, _ in inputs]
            with self._tracked(*_tensors((args, kwargs)), *self._weights(call.node, real).values()) as peak, \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                value, weights = self._run(call, args, kwargs, real)
                on_ctx = _kept_on_ctx(value, _tensors((args, kwargs)))
                on_ctx_refs = {ref for t in on_ctx if (ref := self.original(_storage(t))) not in packed}
                for kept in on_ctx:  # no saved-tensors hook sees them
                    pack(kept)
                forward = peak()
        self._charge_first_saver(call.node.name, foreign)
        # An in-place write to an argument that wants no gradient (``zeros.add_(x)``) changes what later
        # nodes receive: a replay, which makes only the output, would miss it
        reusable = not foreign and before == [_state(t) for t in arguments]
        outputs = _tensors(value)
        # a weight the node returns as it is (``w.float()`` of an fp32 one) gets a gradient too
        grad = sum(t.numel() * t.element_size() for t in outputs if t.requires_grad)
        returned = {id(t) for t in outputs if t.requires_grad and t.grad_fn is None}
        unread, items = _reached(call.node, value)
        items = items if items is None or len(outputs) == len(value) else None  # (a sparse item has parts)
        reached = [not unread and (items is None or i in items) for i in range(len(outputs))]
        sent = [t for t, r in zip(outputs, reached) if r and t.requires_grad and t.grad_fn is not None]
        sent_layouts = [strides for t, strides, r in zip(outputs, layouts or [None] * len(outputs), reached)
                        if r and t.requires_grad and t.grad_fn is not None]
        # A clone the node wrote into (``nn.ReLU(inplace=True)``, ``y.tanh_()``, ``y[:, 0] = 0``) is the value
        # its readers get, the written one, whatever it returns: the backward runs from it too, down to the
        # tensor standing for it before the write, as the op's backward makes its gradient anew
        wrote = [copy._version != version for (_, copy, _), version in zip(inputs, versions)]
        for (_, copy, _), written in zip(inputs, wrote):
            if written and copy.grad_fn is not None and not any(copy is t for t in outputs):
                sent.append(copy)
                sent_layouts.append(None)
        wanted = [before if written else copy for (before, copy, _), written in zip(inputs, wrote)]
        indices = [i for _, _, i in inputs]
        position: dict[StorageWeakRef, int] = {}
        for i, t in enumerate(arguments):
            position.setdefault(self.original(_storage(t)), i)
        new = {ref: i for i, (ref, _) in enumerate(self._new_storages(value))}
        held_to_the_end = 0
        saved_arguments, saved_new = [], []
        for ref, nbytes in packed.items():
            if ref in position:
                saved_arguments.append(position[ref])
            elif ref not in self.owner:
                saved_new.append((nbytes, new.get(ref)))
                held_to_the_end += nbytes if ref in on_ctx_refs else 0
            elif self.owner[ref] is not None:  # no path reaches another node's value but its arguments
                reusable = False
        # What is saved stays referenced to the end (a freed storage's address may come back as another's),
        # but for the node's own temporaries: only autograd holds them, and frees each as soon as the part of
        # the backward that reads it has run (attention's probabilities), as it does in training
        self.kept += [t for t in held if self.original(_storage(t)) in position.keys() | new.keys() | self.owner.keys()]
        held.clear()  # no name may hold a temporary past here: its backward frees it (a loop variable once did)
        # a fake kernel that could not size its workspace (a backward probed again keeps only its peak)
        if layouts is None and not real and any(nbytes == 0 for nbytes, _ in saved_new):
            raise _Unsized(call.node.name)  # probed on real tensors where there are some, else left unprobed
        backward, input_grads, weight_grads, weights_first, kept, copies, alone = 0, (), (), False, 0, 0, 0
        try:
            if sent and (wanted or weights):
                with self._gradients_written(call.node, real) as (params, read_as, written):
                    backward, given, weights_first, kept, copies, alone = self._backward(
                        sent, sent_layouts, wanted + weights, (args, kwargs), real, params, read_as)
                input_grads = tuple((i, given[id(t)][0], _at_argument(given[id(t)][1], t, arguments[i]))
                                    for i, t in zip(indices, wanted) if i is not None and id(t) in given)
                candidates = self.weight_leaves(call.node, arguments, real)
                weight_grads = tuple(p for p, t in enumerate(candidates) if id(t) in given or id(t) in written)
        except Exception:  # noqa: BLE001 - a backward fake tensors cannot run: its peak unknown
            self.unprobed.append(call.node.name)
            backward, input_grads, weight_grads, reusable = 0, None, None, False
        if returned and weight_grads is not None:  # its gradient is the one its readers give it
            candidates = self.weight_leaves(call.node, arguments, real)
            weight_grads = tuple(p for p, t in enumerate(candidates) if p in weight_grads or id(t) in returned)
        leaves, spec = tree_flatten(value)  # (before they are detached: a view's base is read)
        outputs, storages, replayable = _output_leaves(leaves, position, new, lambda t: self.original(_storage(t)))
        value = tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), value)
        reusable &= replayable
        effect = NodeEffect(tuple(saved_arguments), tuple(saved_new), tuple(storages), spec, tuple(outputs),
                            grad, backward, input_grads, forward, weight_grads, weights_first, kept, copies,
                            tuple(i for (_, _, i), written in zip(inputs, wrote) if written and i is not None),
                            None if alone == backward else alone, held_to_the_end)
        return effect, value, reusable

    def _probe_on_real_tensors(self, call: NodeCall, args: tuple, kwargs: dict) -> tuple[NodeEffect, Any] | None:
        """The effect of a node fake tensors cannot run (control flow on a tensor's values, as the
        ``branched`` example's blocks), size (the fused RNN kernels' fake twins, ``mkldnn_rnn_layer``
        on CPU and ``_cudnn_rnn``, return an empty workspace the real kernel fills: most of what an
        LSTM saves) or run cheaply (``REAL_PROBE_KERNELS``), probed by ``_probe`` on one real run
        where shape propagation runs real tensors: on the values it gave the node standing for the
        twins ``args`` / ``kwargs``, with the model's state and randomness set back after it. Returns
        the effect and the output as fake twins in the real output's storages; None without a real
        run, or where the values do not line up."""
        if not self.real_run:
            return None
        flat, spec = tree_flatten((call.args, call.kwargs))
        twins = tree_flatten((args, kwargs))[0]  # (fx makes a dict immutable: the specs differ)
        if len(flat) != len(twins) or not all(
                isinstance(x, torch.Tensor) and x.layout == torch.strided and (x.shape, x.dtype) == (t.shape, t.dtype)
                for x, t in zip(flat, twins) if isinstance(t, torch.Tensor)):
            return None
        try:
            stand_ins = [self._stand_in(x, t) if isinstance(t, torch.Tensor) else x for x, t in zip(flat, twins)]
            # shape propagation's values are set back too: the node ran on them already, and later
            # nodes read them (a second in-place write into one would be seen by them, and by verify)
            real_inputs = [x for x in flat if isinstance(x, torch.Tensor)]
            # a module kept whole changes its own state (and what it holds outside its tree, which ``isolated``
            # finds): the whole graph module's, walked once per probed node, took time growing with nodes x
            # modules (MobileViT's 32 batch norms over 315 modules: 0.6 s of its 4.7 s)
            owner = self.gm.get_submodule(str(call.node.target)) if call.node.op == "call_module" else self.gm
            with _disable_current_modes(), isolated(owner, seed=None), values_restored(real_inputs):
                effect, value, _ = self._probe(call, *tree_unflatten(stand_ins, spec),
                                               [x for x in stand_ins if isinstance(x, torch.Tensor)], real=True)
        except Exception:  # noqa: BLE001 - what the real run refuses too, or values shared otherwise, stays unprobed
            return None
        self.kept.append(value)  # its storages stand for the twins' until the probe ends
        with self._in_fake_mode():
            twin = tree_map_only(torch.Tensor, lambda t: self.twin(t).detach().requires_grad_(t.requires_grad), value)
        for fake, t in zip(_tensors(twin), _tensors(value)):
            self.copy_of[_storage(fake)] = self.original(_storage(t))
        return effect, twin

    def _stand_in(self, t: torch.Tensor, twin: torch.Tensor) -> torch.Tensor:
        """Real tensor ``t`` detached, wanting a gradient as ``twin`` does and counted as its storage is
        (a weight's fake leaf: a leaf too): one per twin, kept to the end of the probe."""
        if id(twin) not in self.stand_ins:
            leaf = t.detach().requires_grad_(twin.requires_grad)
            if self.copy_of.setdefault(_storage(leaf), self.original(_storage(twin))) != self.original(_storage(twin)):
                raise ValueError("real values share a storage their twins do not")
            if id(twin) in self.leaves:
                self.leaves.add(id(leaf))
            if id(twin) in self.bases:
                self.bases[id(leaf)] = self.bases[id(twin)]
            self.stand_ins[id(twin)] = leaf
            self.kept.append((t, twin, leaf))
        return self.stand_ins[id(twin)]

    def _replay(self, effect: NodeEffect, arguments: list[torch.Tensor]) -> Any:
        """The output of a node whose key was probed before: fake leaves laid out as ``effect``'s, in
        new storages or in its arguments' as that node's were, made as meta tensors (``wrapped``)."""
        with _disable_current_modes():
            bases = [torch.empty(nbytes // dtype.itemsize, dtype=dtype, device="meta").untyped_storage()
                     for nbytes, dtype in effect.new_storages]

            def made(leaf: Any) -> Any:
                if not isinstance(leaf, OutputTensor):
                    return leaf
                storage = bases[leaf.new] if leaf.new is not None else arguments[leaf.argument].untyped_storage()
                meta = torch.empty(0, dtype=leaf.dtype, device="meta").set_(storage, leaf.offset, leaf.shape,
                                                                            leaf.stride)
                return self.wrapped(meta, leaf.device).requires_grad_(leaf.requires_grad)

            return tree_unflatten([made(leaf) for leaf in effect.leaves], effect.spec)

    def _charge_first_saver(self, name: str, storages: dict[StorageWeakRef, int]) -> None:
        """``name`` saved ``storages``, which no node made: the first node to save one is charged for it."""
        for ref, nbytes in storages.items():
            if ref in self.savers:
                self.savers[ref].append(name)
            if ref not in self.saved_storages:
                self.saved_storages.add(ref)
                self.savers[ref] = [name]
                self.owner[ref], self.nbytes[ref] = name, nbytes
                self.saved[name] = self.saved.get(name, 0) + nbytes
                self.release(name, name, nbytes)

    def _apply(self, name: str, effect: NodeEffect, saved_arguments: list[StorageWeakRef], value: Any) -> None:
        """Charge what ``name`` saved: an argument's storage to the node that made it, the first time
        any node saves it; a storage of its own (a temporary, or one its output lives in) to itself."""
        new = self._new_storages(value)
        self.saves_from[name] = tuple(sorted({owner for ref in saved_arguments if (owner := self.owner.get(ref))}))
        for ref in saved_arguments:
            if self.owner.get(ref) is not None:
                self.savers.setdefault(ref, []).append(name)
            if ref not in self.saved_storages:
                self.saved_storages.add(ref)
                owner = self.owner[ref]
                if owner is not None:
                    self.saved[owner] = self.saved.get(owner, 0) + self.nbytes[ref]
                    self.release(name, owner, self.nbytes[ref])
        for nbytes, index in effect.saved_new:
            if index is not None:
                self.saved_storages.add(new[index][0])
                self.savers[new[index][0]] = [name]
            self.release(name, name, nbytes)
        self.release(name, name, -effect.held_to_the_end)  # (freed with the graph, after the whole backward)
        self.saved[name] = self.saved.get(name, 0) + sum(nbytes for nbytes, _ in effect.saved_new)
        for ref, nbytes in new:
            self.owner[ref], self.nbytes[ref] = name, nbytes
        self.outputs[name] = tuple(ref for ref, _ in new)
        self.grad[name], self.backward[name], self.forward[name] = effect.grad, effect.backward, effect.forward
        self.backward_alone[name] = effect.backward_alone
        self.gradients_kept[name] = effect.gradients_kept
        self.gradient_copies[name] = effect.gradient_copies
        found = {self.original(_storage(t)): t.untyped_storage().nbytes() for t in _tensors(value)}
        if not new and found:  # the widest storage its output lives in, made by another node ('' for input or weight)
            self.views[name] = self.owner.get(max(found, key=found.__getitem__)) or ""
            # some of the storages of a maker that made several (an item of ``sort``'s values and indices): the
            # others die when their own readers are done, not when this one's are
            made = self.outputs.get(self.views[name], ())
            part = tuple(i for i, ref in enumerate(made) if ref in found)
            if len(part) < len(made):
                self.part[name] = part
        # a container of values other nodes made (a ModelOutput of the last hidden state and the pooled output)
        # keeps each of their storages alive, not only the widest
        makers = dict.fromkeys(self.owner.get(ref) for ref in found)
        self.holds[name] = tuple(m for m in makers if m and m not in (name, self.views.get(name)))

    def _backward(self, sent: list[torch.Tensor], layouts: list[tuple[int, ...] | None], wanted: list[torch.Tensor],
                  inputs: Any, real: bool = False, params: Sequence[nn.Parameter] = (),
                  existing: Sequence[torch.Tensor] = (),
                  ) -> tuple[int, dict[int, tuple[bool, tuple[int, ...]]], bool, int, int, int]:
        """The peak ``MemTracker`` sees while ``sent`` back-propagates from gradients of ``layouts``'
        strides, above where it started, and for each ``wanted`` tensor that gets a gradient (by id)
        whether that gradient is one of ``sent``'s itself (handed on, as a view's or an addition's
        backward does, not a new buffer), and its strides. What
        existed before is registered first: the tracker counts a storage it has not seen when an
        operator first touches it, as if it were new. A weight's gradient counts as dropped as soon as it
        is made, as training's in-place accumulation into ``.grad`` frees it; whether autograd did so
        for every weight before it handed any input its gradient (``gradient_order``); and what the
        peak adds where each is kept instead (the step's first backward), and the bytes of those
        ``AccumulateGrad`` would copy to keep them (``obeys_layout_contract``); and the peak where autograd
        frees each gradient it starts from once the first function has run, as it does where nothing
        else holds it (an in-place write into a view: ``AsStridedBackward`` makes the base's gradient,
        then ``CopySlices`` runs). ``real``: ``sent`` are real tensors. ``params``: parameters a backward the
        node runs itself may give a gradient, counted as weights' (``_gradients_written``); ``existing``: other
        tensors that exist already (the fake tensors a fake mode reads them as)."""
        new = _zeros_strided if real else self.fresh  # a fake run reads no values
        gradients = [new(t, new_strides(t) if strides is None else strides) for t, strides in zip(sent, layouts)]
        weights = [t for t in wanted if id(t) in self.leaves]
        tracker, seen = self.tracker, set()

        copies: list[int] = []

        def kept(weight: torch.Tensor, g: torch.Tensor) -> None:
            # training adds it into the gradient it has and frees it at once; kept instead (no gradient yet),
            # one not laid out as its weight is gets copied into that layout (``AccumulateGrad``), then freed
            if _storage(g) not in seen:
                seen.add(_storage(g))
                tracker.kept += g.untyped_storage().nbytes()
                if not obeys_layout_contract(g, weight):
                    copies.append(g.untyped_storage().nbytes())

        def consumed(g: torch.Tensor, grad_inputs: tuple, grad_outputs: tuple) -> None:
            if not any(isinstance(x, torch.Tensor) and x.layout == torch.strided and _storage(x) == _storage(g)
                       for x in grad_inputs):  # (a view's backward gives a view of it: its storage lives on)
                tracker.released += g.untyped_storage().nbytes()
        hooks = [t.register_hook(functools.partial(kept, t)) for t in [*weights, *params]]
        hooks += [t.grad_fn.register_hook(functools.partial(consumed, g)) for t, g in zip(sent, gradients)]
        try:
            with self._tracked(*gradients, *wanted, *_tensors(inputs), *existing) as peak, \
                    gradient_order(sent, [t for t in _tensors(inputs) if t.requires_grad and id(t) not in self.leaves],
                                   weights) as order:
                start = tracker.total("current")
                tracker.kept, tracker.released, tracker.freed_peak, tracker.alone_peak = 0, 0, start, start
                with torch.enable_grad():
                    grads = torch.autograd.grad(sent, wanted, gradients, allow_unused=True)
                backward, keeping, alone = max(0, tracker.freed_peak - start), peak(), tracker.alone_peak - start
        finally:
            for hook in hooks:
                hook.remove()
        received = {_storage(g) for g in gradients}
        given = {id(t): (g.layout == torch.strided and _storage(g) in received,
                         g.stride() if g.layout == torch.strided else None)
                 for t, g in zip(wanted, grads) if g is not None}
        del grads
        return backward, given, weights_given_first(order), keeping - backward, sum(copies), alone

    def _backwards_from_their_gradients(self) -> None:
        """Probe again the backward of each node whose consumers give its output a gradient laid out
        otherwise than the probe assumed (a new tensor laid out as the output): attention's backward
        copies a transposed gradient before its first matrix product, a buffer the size of its
        output. Last node first, as autograd runs them: the layout a node hands its inputs may
        follow the one it got (a view's). A node in place or otherwise not replayable keeps its
        first probe. Where a stage boundary falls between a node and its consumers, its gradient
        comes in a receive buffer laid out as a new tensor: the first probe's peak stays for that
        (``backward_when_sent``)."""
        for name, (call, key) in reversed(self.rerunnable.items()):
            layouts = [self._gradient_layout(t) for t in _tensors(self.twins[call.node])]
            if not any(layouts):
                continue
            probed = self._probed_from(call, key, layouts)
            if probed is None:
                continue
            effect, arguments = probed
            if effect.input_grads is not None and effect.backward != self.backward[name]:
                self.backward_when_sent[name] = self.backward[name]
                self.backward[name], self.backward_alone[name] = effect.backward, effect.backward_alone
            self._record_gradients(call.node, effect, arguments)  # nothing where its backward did not run

    def _backwards_from_receive_buffers(self) -> None:
        """Probe again the backward of each node that a receive buffer can reach handed on unchanged (an
        addition hands its gradient to each addend, ``passes_on``) in another layout than its own: the buffer
        is laid out as the value sent (``dense_order``), which its makers' consumers would not have given it. A
        Linear whose gradient comes as Whisper's permuted residual stream copies it before its matrix
        products (8,192 bytes over a plan's budget, not seen by either earlier probe). Last node first,
        the orders of the buffers that reach a node flow to the inputs it hands its own to; its peak
        from each is kept where it differs from ``backward`` (``SavedFacts.backward_when_handed``)."""
        orders: dict[str, set[tuple[int, ...]]] = {}  # node -> orders of the receive buffers reaching it
        for node in reversed(self.twins):
            value, name = self.twins[node], node.name
            if not isinstance(value, torch.Tensor) or self.input_grads.get(name) is None:
                continue
            reaching = orders.get(name, set())
            for source in self.passes_on.get(name, ()):  # its own buffer's, where it is sent, and those handed to it
                orders.setdefault(source, set()).update(reaching, [dense_order(value) or ()])
            if name in self.rerunnable:
                peaks = {order: self._backward_from(name, value, order) for order in sorted(reaching)}
                self.backward_when_handed[name] = tuple(
                    (order, peak) for order, peak in peaks.items() if peak is not None and peak != self.backward[name])

    def _backward_from(self, name: str, value: torch.Tensor, order: tuple[int, ...]) -> int | None:
        """The backward peak of node ``name`` from a gradient of its output laid out in ``order`` (outermost
        dimension first; () for contiguous); None where it cannot run again."""
        if order == (dense_order(value) or ()):  # laid out as a new tensor: its first probe's
            return self.backward_when_sent.get(name, self.backward[name])
        strides, size = [0] * value.dim(), 1
        for d in reversed(order or range(value.dim())):
            strides[d], size = size, size * value.shape[d]
        probed = self._probed_from(*self.rerunnable[name], [tuple(strides)])
        return None if probed is None or probed[0].input_grads is None else probed[0].backward

    def _probed_from(self, call: NodeCall, key: Hashable | None, layouts: list[tuple[int, ...] | None],
                     ) -> tuple[NodeEffect, list[torch.Tensor]] | None:
        """The node's effect with its backward run from gradients of ``layouts`` (memoised by its key), and
        its tensor arguments; None where it cannot run again (it ran once: the first probe's facts stay)."""
        args, kwargs = fx.node.map_arg((call.node.args, call.node.kwargs), self.twins.__getitem__)
        arguments = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        memo_key = None if key is None else ("backward", key, tuple(layouts))
        effect = None if memo_key is None else self.memo.get(memo_key)
        if effect is None:
            try:
                with self._in_fake_mode():
                    effect, _, _ = self._probe(call, args, kwargs, arguments, layouts)
            except Exception:  # noqa: BLE001 - what fake tensors ran once may fail run again
                return None
            if memo_key is not None:
                self.memo[memo_key] = effect
        return effect, arguments

    def _gradient_layout(self, t: torch.Tensor) -> tuple[int, ...] | None:
        """The strides of the gradient ``t`` gets, where not those of a new tensor laid out as ``t``."""
        found = self.gradient_layouts.get(id(t))
        return found[1] if found is not None and found[1] is not None and found[1] != new_strides(t) else None

    def _unused(self) -> set[str]:
        """The nodes whose value no output depends on (a result computed and dropped), by the graph's uses,
        and that write in place into nothing that outlives the forward (``_kept_written``: a write into a
        dropped value, ``t = lin(x); t.add_(1)``, is dropped with it; by what they call, into a buffer, kept):
        nothing holds their autograd nodes once the forward has run,
        so what they save is freed with them (counted, a dead branch's activations were 1.2x measured)."""
        live: set[str] = set()
        read: set[StorageWeakRef] = set()  # the storages the live nodes read (after the node at hand)
        probed = {node.name: node for node in self.twins}
        for node in reversed(self.gm.graph.nodes):
            if node.op == "output" or writes_in_place(self.gm, node) and node.name not in self.writes \
                    or any(user.name in live for user in node.users) \
                    or any(self._kept_written(probed.get(source), read) for source in self.writes.get(node.name, ())):
                live.add(node.name)
                read.update(self.original(_storage(t)) for a in node.all_input_nodes if a in self.twins
                            for t in _tensors(self.twins[a]))
        return {node.name for node in self.gm.graph.nodes if node.name not in live}

    def _kept_written(self, source: fx.Node | None, read: AbstractSet[StorageWeakRef]) -> bool:
        """Whether what a node writes in place into ``source``'s value (None: one not probed) outlives the
        forward: a storage no node made (an input, a weight or buffer) or one a live node reads after it (a
        write into a value computed and dropped is dropped with it: ``t = lin(x); t.add_(1)``)."""
        if source is None:
            return True
        storages = {self.original(_storage(t)) for t in _tensors(self.twins[source])}
        return not storages or any(self.owner.get(ref) is None or ref in read for ref in storages)

    def facts(self) -> dict[str, SavedFacts]:
        """``SavedFacts`` of every compute node probed so far; none for a node fake tensors could not
        run, so the memory model falls back to its output's bytes rather than count nothing saved."""
        values = {node.name: value for node, value in self.twins.items()}
        unused = self._unused()
        saved, releases, unsaved = self._saved_by_the_used(unused)

        def storages(name: str) -> tuple[tuple[int, int], ...]:  # ``SavedFacts.parts``: where it made several
            made = self.parts(name, unsaved)
            return tuple((nbytes, 0 if name in unused else saved) for nbytes, saved in made) if len(made) > 1 else ()
        return {name: SavedFacts(0 if name in unused else saved.get(name, 0),
                                 0 if name in unused else self.saved_output(name, unsaved), self.grad[name],
                                 self.backward[name], tuple(sorted((maker, nbytes) for maker, nbytes in releases.get(
                                     name, {}).items() if nbytes)),
                                 self.views.get(name), self.input_grads.get(name), self.backward_when_sent.get(name),
                                 self.forward.get(name), self.strided_grads.get(name, ()),
                                 sent_as_copy(values.get(name)), self.when_contiguous.get(name),
                                 dense_order(values.get(name)), self.weight_grads.get(name),
                                 self.holds.get(name, ()), name in self.weights_first, self.saves_from.get(name),
                                 self.gradients_kept.get(name, 0), self.gradient_copies.get(name, 0),
                                 self.writes.get(name, ()), self.backward_alone.get(name),
                                 self.backward_when_handed.get(name, ()), self.passes_on.get(name, ()),
                                 self.strided_when_sent.get(name), storages(name), self.part.get(name))
                for name in self.grad if name not in self.unrun}
