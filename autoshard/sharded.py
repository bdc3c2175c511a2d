"""``ShardedModel``: the k stages chained, called exactly like the original model."""

from __future__ import annotations

import inspect
import operator
import types
import weakref
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules import module as module_state
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_iter, tree_map

from autoshard.isolation import PLAIN_VALUES
from autoshard.capture.attribute_reads import ABSENT, AttributeRead, looked_up
from autoshard.capture.guard import (
    PLACED_ON, FixedDtypes, InputGuard, check_condition, check_inputs, check_mode, one_tensor_groups,
    refuse_mode_switch, tensor_class,
)
from autoshard.capture.held_state import (
    ATTRIBUTE, HOLDS, LENGTH, NO_KEY, Read, assigned_anew, code_reads)
from autoshard.capture.hooks_since import HooksAtCapture
from autoshard.capture.result import WrappedLeaf
from autoshard.capture.signature import argument_names, bind_as_called, is_default, parameter_default
from autoshard.capture.structure import same_constant
from autoshard.costs.memory_model import MemoryModel
from autoshard.costs.models import DAG_COST_MODELS, held_weight_bytes, measured, stage_totals
from autoshard.costs.ties import SharedWeight, shared_weights
from autoshard.costs.values import ValueMeta
from autoshard.emit import HELD_STATE
from autoshard.errors import (
    NO_SPECIALISATIONS, CallRefusedError, InputMismatchError, PlanError, SpecializationMismatch, brief, first_few,
    shown)
from autoshard.graph.partition import SplitInfo

_training = operator.attrgetter("training")
#: How the operations written in the model's own forward, outside any submodule, are listed among a
#: stage's modules (``StagePlan.modules``, and the reports' tables and pictures). Not ``<root>``: in a
#: ``no-split=<root>`` or ``pin`` rule that names the whole model.
ROOT_LABEL = "(root)"
#: Boundary values ``moved_to`` passes on without looking inside (a tensor: when on the device).
_PASSED_AS_THEY_ARE = (torch.Tensor, *PLAIN_VALUES)


@dataclass(frozen=True)
class BoundaryValue:
    """A value sent from one stage to the next: its producer's name, structure and size.

    ``meta`` is None (and ``nbytes`` a placeholder of 1) when shapes were not propagated.
    """

    name: str
    meta: ValueMeta | None
    nbytes: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.meta.to_dict() if self.meta is not None else None,
                "text": str(self.meta) if self.meta is not None else None, "bytes": self.nbytes}


@dataclass(frozen=True)
class StagePlan:
    """What the split decided, kept beside the stages for reports and checks.

    Everything beyond the assignment and boundaries is read from the DAG: per-stage costs under
    each cost model whose measurements it holds, the structure of every boundary value, and the
    weights shared between nodes (tied weights), with the stages that hold them. ``split_info``
    is what the splitter knew about its result (strategy, bound, whether ``exact`` proved it
    optimal, the tied-weight groups it had to separate); None when the split came from elsewhere.
    ``memory_model`` is the optimizer and microbatch cap its training memory was planned for.
    ``training`` is the model's mode at capture: code that reads ``self.training`` (attention
    dropout rates, batch-norm branches) was fixed to it.
    """

    assignment: dict[str, int]
    boundaries: tuple[tuple[str, ...], ...]
    wrapped: tuple[WrappedLeaf, ...]
    dag: Any
    split_info: SplitInfo | None = None
    memory_model: MemoryModel = MemoryModel()
    training: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) + 1

    def stage_nodes(self, stage: int) -> list[str]:
        """The non-input nodes of ``stage`` in program order."""
        return [n for n, s in self.assignment.items() if s == stage and not self.dag.nodes[n].get("input")]

    def modules(self, stage: int) -> list[str]:
        """Owning module paths of the nodes in ``stage``, in program order, without repeats; the model's
        own operations as ``ROOT_LABEL``."""
        return list(dict.fromkeys(self.dag.nodes[n]["module"] or ROOT_LABEL for n in self.stage_nodes(stage)))

    def weights(self, stage: int) -> tuple[str, ...]:
        """Canonical names of the distinct parameters and buffers ``stage`` holds, in program order."""
        return tuple(dict.fromkeys(w for n in self.stage_nodes(stage) for w in self.dag.nodes[n]["weights"]))

    def param_bytes(self, stage: int) -> int:
        """Bytes of the parameters and buffers ``stage`` holds; a shared one counts once per stage."""
        if "weights" not in self.dag.graph:  # a DAG built by hand: charge each node what it was charged
            return sum(self.dag.nodes[n]["param_bytes"] for n in self.stage_nodes(stage))
        return int(held_weight_bytes(self.dag, self.assignment, self.num_stages)[stage])

    def boundary_values(self, boundary: int) -> tuple[BoundaryValue, ...]:
        """The values crossing from stage ``boundary`` to the next, with shape, dtype and bytes."""
        return tuple(BoundaryValue(name, self.dag.nodes[name].get("value_meta"), float(self.dag.nodes[name]["bytes"]))
                     for name in self.boundaries[boundary])

    def boundary_bytes(self) -> list[float]:
        """Per boundary, the bytes one microbatch sends across it."""
        return [sum(v.nbytes for v in self.boundary_values(j)) for j in range(self.num_stages - 1)]

    @cached_property
    def shared_weights(self) -> tuple[SharedWeight, ...]:
        """Weights read by several nodes or tied under several names, with the stages holding them."""
        return shared_weights(self.dag, self.assignment)

    @property
    def gradient_sync(self) -> tuple[SharedWeight, ...]:
        """Trainable shared parameters held by several stages: those stages must sum their gradients."""
        return tuple(w for w in self.shared_weights if w.needs_gradient_sync)

    def stage_costs(self, cost: str | Mapping[str, float], memory: MemoryModel | None = None) -> list[float]:
        """Per-stage cost under a built-in cost model's name, or of explicit per-node costs;
        ``memory`` (default: the plan's own) is the training-memory model ``memory`` uses."""
        return stage_totals(self.dag, self.assignment, self.num_stages, cost, memory or self.memory_model)

    def cost_models(self) -> tuple[str, ...]:
        """The built-in cost models whose measurements this plan's DAG holds."""
        return tuple(name for name in DAG_COST_MODELS if measured(self.dag, name))


_STAGES = "stages."


def _under_model_keys(sharded: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    """``state_dict``'s hook: each stage's keys are the model's own (stages hold the model's modules
    under their paths), so ``stages.1.h.0.attn.weight`` is saved as ``h.0.attn.weight``, a weight
    several stages hold once: the sharded model's checkpoint is the model's, in the model's order."""
    marker = prefix + _STAGES
    for table in (state, getattr(state, "_metadata", {})):
        for key in [key for key in table if key.startswith(marker)]:
            value = table.pop(key)
            table.setdefault(_model_name(key, prefix), value)
    _in_model_order(sharded, state, prefix)


def _model_name(name: str, prefix: str) -> str:
    """A stage's ``prefix + "stages.1.h.0.attn.weight"`` as the model's ``prefix + "h.0.attn.weight"``."""
    marker = prefix + _STAGES
    return prefix + name[len(marker):].partition(".")[2] if name.startswith(marker) else name


def _from_model_keys(sharded: nn.Module, state: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                     strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """``load_state_dict``'s hook: a key of the model's given to each stage holding it (a stage's own
    key, ``stages.1.``..., as ``nn.Module`` saves it, is taken as it is), and one no stage holds
    loaded into the model's own tensor (``_load_model_only``)."""
    holders: dict[str, list[str]] = {}
    for index, stage in sharded.stages._modules.items():
        for key in stage.state_dict(keep_vars=True):
            holders.setdefault(key, []).append(f"{prefix}{_STAGES}{index}.{key}")
    for key in [key for key in state if key.startswith(prefix) and key[len(prefix):] in holders]:
        value = state.pop(key)
        for stage_key in holders[key[len(prefix):]]:
            state[stage_key] = value
    _load_model_only(sharded, holders.keys(), state, prefix, local_metadata, missing_keys, error_msgs)


class _ModelHeld:
    """The model a sharded model was made from, whose modules and tensors its stages hold: its keys no
    stage holds (a weight only a branch the capture did not take reads, a buffer no forward reads, a
    second name of a tied weight, BERT's ``cls.predictions.bias``) are still the model's, so the
    sharded model's ``state_dict`` takes them from the model and ``load_state_dict`` loads them into
    it: a checkpoint moves between the model and its sharded model both ways, strictly. A copy
    (``materialize_stage``, ``copy.deepcopy``) holds tensors of its own and a pickle lives in another
    process: neither holds the model, so they keep to their stages' keys."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model

    def __deepcopy__(self, memo: dict[int, Any]) -> _ModelHeld:
        return _ModelHeld()

    def __reduce__(self) -> tuple[Any, ...]:
        return _ModelHeld, ()


def _held_model(sharded: nn.Module) -> nn.Module | None:
    """The model whose tensors ``sharded``'s stages hold (``_ModelHeld``), or None."""
    held = sharded.__dict__.get("_model_held")
    return held.model if held is not None else None


def _stage_keys(sharded: nn.Module) -> set[str]:
    """The model's keys some stage holds (a stage's ``state_dict`` keys are the model's)."""
    return {key for stage in sharded.stages for key in stage.state_dict(keep_vars=True)}


def _model_only(sharded: nn.Module, keep_vars: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The entries of the held model's ``state_dict`` no stage holds, in the model's order, and the
    model's metadata (module versions its modules' loading reads); nothing without a held model."""
    model = _held_model(sharded)
    if model is None:
        return {}, {}
    state = model.state_dict(keep_vars=keep_vars)
    held = _stage_keys(sharded)
    return {key: value for key, value in state.items() if key not in held}, getattr(state, "_metadata", {})


def _joined(prefix: str, path: str) -> str:
    """The module ``path`` of the model under ``prefix`` (a ``_metadata`` key: no trailing dot)."""
    return prefix + path if path else prefix[:-1]


def _in_model_order(sharded: nn.Module, state: dict[str, Any], prefix: str) -> None:
    """Put the sharded model's entries of ``state`` in the held model's ``state_dict`` order (its stages
    save in stage order, the model's own entries no stage holds first), in place: ``state`` may be a
    module's that holds the sharded model, whose other entries stay where they are."""
    model = _held_model(sharded)
    if model is None:
        return
    order = {prefix + key: index for index, key in enumerate(model.state_dict(keep_vars=True))}
    for key in sorted((key for key in state if key in order), key=order.__getitem__):
        state[key] = state.pop(key)


def _load_model_only(sharded: nn.Module, held: Any, state: dict[str, Any], prefix: str,
                     local_metadata: dict[str, Any], missing_keys: list[str], error_msgs: list[str]) -> None:
    """Load the held model's keys no stage holds (``held`` lists those some stage does) from ``state``
    into the model's own tensors, each by the module owning it (its shape checks, ``assign``, version
    metadata), and list those ``state`` lacks as missing: the model's checkpoint loads strictly."""
    model = _held_model(sharded)
    if model is None:
        return
    metadata = getattr(state, "_metadata", {})
    by_owner: dict[str, dict[str, Any]] = {}
    for key in model.state_dict(keep_vars=True):
        if key in held:
            continue
        if prefix + key in state:
            by_owner.setdefault(key.rpartition(".")[0], {})[prefix + key] = state.pop(prefix + key)
        else:
            missing_keys.append(prefix + key)
    assign = {"assign_to_params_buffers": local_metadata.get("assign_to_params_buffers", False)}
    for owner, entries in by_owner.items():
        module_metadata = {**metadata.get(_joined(prefix, owner), {}), **assign}
        model.get_submodule(owner)._load_from_state_dict(  # its keys the stages hold are not asked for here
            entries, prefix + owner + "." if owner else prefix, module_metadata, True, [], [], error_msgs)


class StateAtCapture:
    """What the code a plan runs read from the model at capture, checked on every call by the first
    stage, before any computes (``HeldState.model_state``): the modes of the modules whose code it
    runs (what they read from ``self.training`` was fixed then; ``model.eval()`` switches them
    without the stages seeing it where a stage calls none of them, as with ``torch.export`` graphs;
    not submodules: the stages hold what they compute with), and the plain attributes its traced
    code read (``capture.attribute_reads``: ``config.output_hidden_states``, ``self.scale``). A mode
    switched is refused (``check_mode``); an attribute set to another value raises
    ``SpecializationMismatch``, so the model is captured again with it. A copy of the sharded model
    keeps watching the same model; a pickled one watches nothing (another process has its own model).

    The first stage's check compares what ``reads_now()`` lists by identity, in the code written for
    its own reads (``kept_check``), and runs ``check_in_full`` on a difference (``after_difference``)."""

    def __init__(self, modules: tuple[nn.Module, ...] = (), attributes: tuple[AttributeRead, ...] = (),
                 hooks: HooksAtCapture | None = None) -> None:
        self.modules = modules
        self.captured = list(map(_training, modules))
        self.attributes = attributes
        #: what the traced code wrote on settings objects where it read (``AttributeRead.written``)
        self.writes = tuple((read.holder, read.name, read.written) for read in attributes if read.written is not ABSENT)
        self.hooks = hooks if hooks is not None else HooksAtCapture()
        #: per module traced through, what its code is found by at capture (``code_reads``: its own and its
        #: class's ``forward``, its class), which the graph holds; and per module whose submodules the traced
        #: code reached (``HooksAtCapture.reaching``), their names (a loop over a ``ModuleList`` called the ones
        #: it held) and those of them it reached or calls (an activation module traced through, assigned anew: its
        #: code is in the graph; a Linear swapped through ``_modules``, which ``capture.rebinding`` does not see)
        self.code = [(module, code_reads([module])[1]) for module in self.hooks.traced_through]
        reached = {id(module) for module in (*self.hooks.reaching, *self.hooks.called)}
        self.children = [(module, frozenset(module._modules),
                          tuple((name, child) for name, child in module._modules.items() if id(child) in reached))
                         for module in self.hooks.reaching]

    def check_in_full(self, training: bool) -> None:
        now = list(map(_training, self.modules))
        if now != self.captured:
            check_mode(training, training, tuple(now), tuple(self.captured))
        for module, code in self.code:
            if any(now is not was for now, was in zip(code_reads([module])[1], code)):
                raise SpecializationMismatch(
                    f"{self._named(module)} runs other code now than when the stages were captured through it (its "
                    "forward patched, or its class swapped), and they hold the code it ran then", before_compute=True)
        called = {id(module) for module in self.hooks.called}
        for module, names, reached in self.children:
            replaced = next((name for name, child in reached
                             if id(child) in called and module._modules.get(name) is not child), None)
            if replaced is not None:  # as ``capture.rebinding`` refuses it (here also through ``_modules``)
                raise InputMismatchError(assigned_anew(module, replaced, module._modules.get(replaced)))
            if module._modules.keys() != names or any(module._modules[name] is not child for name, child in reached):
                raise SpecializationMismatch(
                    f"{self._named(module)} holds other submodules now than when the stages were captured through the "
                    "model's code (one added, removed, inserted or assigned anew: a layer pruned, an activation "
                    "swapped), and they run the ones it held then", before_compute=True)
        changed = self.hooks.changed()
        if changed is not None:
            module, kind, held = changed
            where = self._named(module)
            raise SpecializationMismatch(
                f"{where} holds other {kind}s now than when the stages were captured through its code, so they "
                "would run the ones it held then" if held else
                f"{where} has a {kind} now, where the stages were captured through the model's code without one, "
                "so they would not run it", before_compute=True)
        for read in self.attributes:
            value = looked_up(read.holder, read.name)[1]
            if (isinstance(read.value, torch.Tensor) or read.by_identity) and value is not read.value:
                raise SpecializationMismatch(
                    f"the model's {self._where(read.holder, read.name)} was set to another "
                    f"{'tensor' if isinstance(read.value, torch.Tensor) else 'object'} since the stages were "
                    "captured, and they compute with the one it held then", before_compute=True)
            if not same_constant(value, read.contents):
                raise SpecializationMismatch(
                    f"the model's {self._where(read.holder, read.name)} {_reading(value)} now, but the stages were "
                    f"captured when it {_reading(read.contents, past=True)}, and its traced code took the path that "
                    "value chose",
                    before_compute=True)

    def write_back(self, as_run: bool = False) -> None:
        """Write what the traced code wrote on the model's settings objects, as a call of the model would
        (a Hugging Face model sets ``config.problem_type`` on its first call with labels): the graph holds
        no attribute writes, and a later capture would read the old value and take another path. ``as_run``:
        also what the code it runs whole leaves (``AttributeRead.left``), which a served call's own run
        writes: the model as a call leaves it, where no stage runs (``Specializer.settled``)."""
        for holder, name, value in self.writes:
            setattr(holder, name, value)
        for read in self.attributes if as_run else ():
            if read.left is not ABSENT:
                setattr(read.holder, read.name, read.left)

    def moved_by_each_call(self) -> tuple[str, ...]:
        """The attributes each call this capture serves writes back with another value than the one it
        read (``count=0 -> 1``), or that code it runs whole moves on before its traced code reads them:
        the call itself makes the next one need another capture."""
        return tuple(self._where(holder, name) for holder, name, value in self.writes
                     if not same_constant(value, next(r.contents for r in self.attributes
                                                      if r.holder is holder and r.name == name))) + tuple(
            self._where(read.holder, read.name) for read in self.attributes if read.left is not ABSENT)

    def unlike(self, other: StateAtCapture) -> tuple[str, ...]:
        """``path=value`` for each attribute this capture read with another value than ``other`` did, the
        mode of the model's modules where other than ``other``'s (``eval mode``), and the hooks it held
        that ``other``'s did not (``forward hooks on h.3``)."""
        theirs = {(id(read.holder), read.name): read.contents for read in other.attributes}
        by_kind: dict[str, list[str]] = {}
        for module, kind in self.hooks.held_unlike(other.hooks):
            by_kind.setdefault(kind, []).append(self._where(module, "") or "the model")
        hooks = tuple(f"{kind}s on {first_few(paths, 3)}" for kind, paths in by_kind.items())
        if self.captured != other.captured:  # (``model.eval()``: every module; a frozen batch norm: some)
            hooks = (f"{'eval' if not any(self.captured) else 'train' if all(self.captured) else 'mixed'} mode",
                     *hooks)
        changed = [read for read in self.attributes
                   if not same_constant(read.contents, theirs.get((id(read.holder), read.name), read.contents))]
        return tuple(f"{self._where(read.holder, read.name)}={read.contents!r}" for read in changed) + hooks

    def reads_now(self, traced: bool = False) -> tuple[list[Read], list[Any]]:
        """What a passing check reads, and what it finds there now: the modes, each attribute where it
        is held (its holder's ``__dict__``; else that it is not there, and its class's value), and the
        hook id counter (``HooksAtCapture.counter_read``); ``traced``: each hook dict watched instead
        (``HooksAtCapture.dict_reads``), for a call torch.compile traces (``HeldState.traced_check``)."""
        reads: list[Read] = [(module, NO_KEY, "training") for module in self.modules]
        seen: list[Any] = list(map(_training, self.modules))
        for read in self.attributes:
            own = vars(read.holder)
            where, value = looked_up(read.holder, read.name)
            if where is not own:
                reads.append((own, read.name, HOLDS))
                seen.append(False)
            if where is not None:
                reads.append(_where_read(read.holder, where, read.name, value))
                seen.append(value)
                inside = read.content_reads(value)
                reads += inside[0]
                seen += inside[1]
        if not traced:  # (not where torch.compile traces: it does not trace these modules)
            code = code_reads(self.hooks.traced_through)
            reads += code[0]
            seen += code[1]
            for module, names, reached in self.children:  # the same dict of submodules, the same names and modules
                held = module._modules  # its names as many as then, each still there (``LENGTH``: no keys compared)
                reads += [(vars(module), "_modules", ""), (held, NO_KEY, LENGTH)]
                seen += [held, len(names)]
                reads += [(held, name, "") for name, _ in reached]
                seen += [child for _, child in reached]
                unreached = names.difference(name for name, _ in reached)
                reads += [(held, name, HOLDS) for name in unreached]
                seen += [True] * len(unreached)
        hooks = self.hooks.dict_reads() if traced else self.hooks.counter_read()
        return [*reads, *hooks[0]], [*seen, *hooks[1]]

    def after_difference(self, full: Callable[[Any], Any], again: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """What the check runs on a difference: ``full``, unless only the hook counter moved
        (``HooksAtCapture.after_difference``)."""
        return self.hooks.after_difference(full, again)

    def _named(self, module: nn.Module) -> str:
        """``the model's transformer.h`` (``the model`` itself)."""
        path = self._where(module, "")
        return f"the model's {path}" if path else "the model"

    def _where(self, holder: Any, name: str) -> str:
        """``holder.name`` by its path in the model (``transformer.h.0.attn.scale``, ``config.use_cache``;
        no ``name``: the holder's own path, ``transformer.h.0``)."""
        root = self.modules[0] if self.modules else None
        for path, module in root.named_modules() if root is not None else ():
            if module is holder:
                return ".".join(filter(None, (path, name)))
            owner = next((key for key, value in vars(module).items() if value is holder), None)
            if owner is not None:
                return ".".join(filter(None, (path, owner, name)))
        return ".".join(filter(None, (type(holder).__name__, name)))

    def __deepcopy__(self, memo: dict[int, Any]) -> StateAtCapture:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy in another process watches nothing (that process has its own model). Not one whose calls
        write a module's flag back (the top-level forward's): it would take the first call's path forever."""
        written = [self._where(holder, name) for holder, name, _ in self.writes if isinstance(holder, nn.Module)]
        if written:
            raise PlanError(
                f"these stages write {', '.join(written)} back to the model on each call, and the next call with the "
                "value written takes another path, which a pickled copy (watching no model) cannot follow; build "
                "the stages in each process (shard_model, or load_plan)")
        return StateAtCapture, ()


def _where_read(holder: Any, where: Mapping[str, Any], name: str, value: Any) -> Read:
    """The read of ``holder.name`` where ``looked_up`` found it: in ``where``, the holder's ``__dict__``, or
    through the holder's class (``ATTRIBUTE``; a class's ``__dict__`` is a mapping proxy), which also sees
    one set since on a class before the one holding it, unless the value is a descriptor, which reading
    through the class would call (a function, a method of the class, reads as itself)."""
    if where is vars(holder) or (hasattr(type(value), "__get__") and type(value) is not types.FunctionType):
        return where, name, ""
    return type(holder), name, ATTRIBUTE


def _reading(value: Any, past: bool = False) -> str:
    """``is float 3.0`` / ``is unset`` (``was`` in the ``past``)."""
    return f"{'was' if past else 'is'} {'unset' if value is ABSENT else shown(value)}"


class ShardedModel(FixedDtypes):
    """An ``nn.Module`` whose forward runs ``stages`` in order.

    ``stages[0]`` takes the model's inputs; every stage but the last returns a tuple of the
    values crossing its boundary, which the next stage takes positionally (moved to the device
    of its weights when it has been placed elsewhere); the last stage returns what the model
    returns. Its ``state_dict()`` is the model's, under the model's keys (a weight several stages
    hold, once), and ``load_state_dict`` takes the model's checkpoint: ``model``, whose tensors the
    stages hold, gives and takes the keys no stage holds (``_ModelHeld``).
    """

    def __init__(self, stages: list[fx.GraphModule], plan: StagePlan,
                 model_signature: inspect.Signature | None = None,
                 modules_run: tuple[nn.Module, ...] = (), attributes_read: tuple[AttributeRead, ...] = (),
                 hooks: HooksAtCapture | None = None, model: nn.Module | None = None) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.plan = plan
        self.training = plan.training  # its own flag only: the stages share the model's modules
        #: the model's own call signature, when known: an argument the example left out may be
        #: passed with its default value (``mask=None``), which the plan computes with
        self.model_signature = model_signature
        self._state_at_capture = StateAtCapture(modules_run, attributes_read, hooks)
        held = getattr(stages[0], HELD_STATE, None) if stages else None
        if held is not None:
            held.watch_model_state(self._state_at_capture)
        self._first_held = held
        self._kept_binder = _KeptBinder(stages[0] if stages else None, model_signature)
        self._model_held = _ModelHeld(model)
        #: whether the plan was made from a model on the meta device (``materialize_stage`` gives stages real
        #: tensors): a stage of it still on meta refuses real tensors (a stage moved there by hand takes them)
        self.made_on_meta = any(t.is_meta for stage in stages for t in stage.parameters())
        self.register_state_dict_post_hook(_under_model_keys)
        self.register_load_state_dict_pre_hook(_from_model_keys)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """Save the model's entries no stage holds (``_ModelHeld``) as the model does; the stages save
        the rest, and ``state_dict``'s hook puts them all in the model's order."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        only, model_metadata = _model_only(self, keep_vars)
        metadata = getattr(destination, "_metadata", None)
        for path, value in model_metadata.items() if metadata is not None else ():
            metadata.setdefault(_joined(prefix, path), value)
        destination.update((prefix + key, value) for key, value in only.items())

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters under the model's own names (``h.0.attn.weight``, not
        ``stages.1.h.0.attn.weight``), as ``state_dict`` keys them: code that picks parameters by name
        (optimizer groups, freezing) finds them as in the model. (A module holding the sharded model
        walks its modules itself, so there they keep their stages' names.)"""
        for name, parameter in super().named_parameters(prefix, recurse, remove_duplicate):
            yield _model_name(name, prefix + "." if prefix else ""), parameter

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's buffers under the model's own names, as ``named_parameters``."""
        for name, buffer in super().named_buffers(prefix, recurse, remove_duplicate):
            yield _model_name(name, prefix + "." if prefix else ""), buffer

    def train(self, mode: bool = True) -> ShardedModel:
        """Switch the model to ``mode`` (``model.train(mode)``, whose modules the stages hold), so that
        later calls are served by a capture made in that mode: the plan itself, or one made for it
        (``autoshard.specialize``). The stages' own flags stay as captured (their check compares
        them). Without re-specialisation (``respecialize=False``, a copy) a switch away from the plan's
        mode is refused before anything switches: the plan serves only the mode it was captured in."""
        specializer = self.__dict__.get("specializer")
        if specializer is None:
            refuse_mode_switch(self.plan.training, mode)
            return super().train(mode)
        specializer.model.train(mode)
        self.training = bool(mode)
        return self

    def check_model_state(self) -> None:
        """Raise where the model is not as the plan's code read it at capture (``StateAtCapture``): a
        module in another mode or a weight converted to another dtype (``InputMismatchError``: a model
        converted after sharding is sharded again, as each stage's own check says, not captured again
        for some calls only), a plain attribute set to another value (``SpecializationMismatch``:
        another capture serves it)."""
        self.__dict__["_state_at_capture"].check_in_full(self.plan.training)
        for stage in self.stages:
            held = getattr(stage, HELD_STATE, None)
            if held is not None:
                held.check_dtypes()

    def state_holds(self) -> bool:
        """Whether the first stage's check of the model's state passes as it stands, asked without
        raising or checking in full (False on any difference, even one a full check would pass, such as
        a hook registered anywhere, and before the plan's first call)."""
        held = self._first_held
        return held is not None and held.holds(held.owner.training)

    def served_inputs(self) -> str | None:
        """What a call must pass to be served by these stages: as their input guard checks it
        (``InputGuard.describe``: each argument's dtype and shape, named sizes with their ranges, the
        constants fixed, the conditions on sizes), then the conditions of the model's code the stages
        check as they run, which that guard could not say over the inputs (a condition on a size a view
        computed, a capture by ``torch.fx``); None where the plan checks nothing (no example)."""
        guard = _input_guard(self.stages[0])
        checked = dict.fromkeys(f"{node.args[2]} is {node.args[1]}" for stage in self.stages
                                for node in stage.graph.nodes if node.op == "call_function"
                                and node.target is check_condition)
        said = ([guard.describe()] if guard is not None else []) + (
            [f"as the stages run, {'; '.join(checked)}"] if checked else [])
        return "; ".join(said) or None

    def inputs_accepted(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the first stage's input guard passes these inputs, asked without running a stage:
        their shapes, constants, dtypes and layouts (``pipeline_stage`` chooses a plan so, up front).
        The conditions the stages check as they run (``served_inputs``) are not asked: a call breaking one
        is refused where a stage reaches it."""
        first = self.stages[0]
        guard = _input_guard(first)
        try:
            fitted = self.fit_call(args, kwargs)
            if guard is not None:
                check_inputs(guard, *inspect.signature(first.forward).bind(*fitted[0], **fitted[1]).arguments.values())
        except (InputMismatchError, TypeError):
            return False
        return True

    def attributes_unlike(self, other: ShardedModel) -> tuple[str, ...]:
        """``path=value`` for each plain attribute of the model this plan's code read with another
        value than ``other``'s did (``config.output_hidden_states=True``), and the hooks its modules
        held that ``other``'s did not (``forward hooks on transformer.h.0``)."""
        return self.__dict__["_state_at_capture"].unlike(other.__dict__["_state_at_capture"])

    def hooks_hold(self) -> bool:
        """Whether the modules this plan's capture traced through hold the hooks they held then (none
        registered or removed since): a plan failing this serves no call until they do again."""
        return self.__dict__["_state_at_capture"].hooks.changed() is None

    def holds_other_hooks_than(self, other: ShardedModel) -> bool:
        """Whether this plan was captured with hooks on the model's modules that ``other``'s capture did not
        see (registered since: Transformers' output recorders, installed on the first call asking for them)."""
        return bool(self.__dict__["_state_at_capture"].hooks.held_unlike(other.__dict__["_state_at_capture"].hooks))

    def attributes_moved_by_each_call(self) -> tuple[str, ...]:
        """The model's attributes each call of this plan sets to another value than the one its capture
        read (a count the forward moves on: ``StateAtCapture.moved_by_each_call``)."""
        return self.__dict__["_state_at_capture"].moved_by_each_call()

    def write_settings_back(self) -> None:
        """Write on the model's settings what a call of this plan writes there (``config.problem_type``, filled
        in on a Hugging Face classifier's first call with labels: ``StateAtCapture.write_back``), leaving the
        model as such a call leaves it, without running a stage."""
        self.__dict__["_state_at_capture"].write_back(as_run=True)

    def fit_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A call of the model as ``stages[0]`` takes it (see ``fitted_call``): every runtime binds
        through here, so an argument reaches the parameter the model gives it, or is refused
        (``InputMismatchError``) when the plan does not serve it. The model's state (modes,
        attributes read) is checked by the first stage (``StateAtCapture``)."""
        held = self.__dict__  # read once: each attribute of a module goes through its __getattr__ hook
        first = held["_modules"]["stages"]._modules["0"]
        kept = held["_kept_binder"]
        if kept.first is not first or kept.binder.model_signature is not held["model_signature"]:
            kept.first, kept.binder = first, _untraced_binder(first, held["model_signature"])
        return kept.binder.bind(args, kwargs, keep_positions=True)

    #: Serves the calls a capture's guards refuse by capturing the model again (``autoshard.specialize``);
    #: ``shard_model`` sets it, None refuses such calls.
    specializer: Any = None

    #: The call the plan was captured for (``autoshard.specialize.CapturedFor``), kept by copies of the
    #: stages, which keep no specializer; None without example inputs.
    captured_for: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        specializer = self.specializer
        if specializer is not None:
            return specializer.serve(self, args, kwargs)
        try:
            return self.run_stages(args, kwargs)
        except SpecializationMismatch as exc:
            raise exc.where_nothing_captures() from None

    def run_stages(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of these stages, in order: what ``forward`` runs once it has chosen the plan.

        A stage's ``forward`` is called straight when ``nn.Module.__call__`` would do nothing else
        (its own fast path's conditions): no hooks on every module and no JIT trace, tested once
        for the call, and none on the stage and not compiled, tested per stage on its ``__dict__``
        (where a module keeps them; reading them as attributes goes through its ``__getattr__``
        hook). A stage is called once per microbatch, and ``__call__`` with ``GraphModule``'s
        wrapper around it cost about as much as small layers compute."""
        values, keywords = self.fit_call(args, kwargs)
        plain = not (module_state._global_forward_hooks or module_state._global_forward_pre_hooks
                     or module_state._global_backward_hooks or module_state._global_backward_pre_hooks
                     or torch._C._get_tracing_state())
        received = False  # the first stage takes the call as bound; each later one what the one before sent
        on_meta = self.__dict__.get("made_on_meta", False)
        try:
            for stage in self.__dict__["_modules"]["stages"]._modules.values():
                held = stage.__dict__
                if received:
                    values = moved_to(_device_of(held, stage), values, refuse_meta=on_meta)
                if plain and not (held["_forward_hooks"] or held["_forward_pre_hooks"] or held["_backward_hooks"]
                                  or held["_backward_pre_hooks"] or held.get("_compiled_call_impl") is not None):
                    values = stage.forward(*values, **keywords)
                else:
                    values = stage(*values, **keywords)
                received, keywords = True, _NO_KEYWORDS
        except SpecializationMismatch as exc:
            exc.stage = stage  # the stages after it did not run (``specialize.rerun_of``)
            raise
        except RuntimeError as exc:  # (torch's: 'Tensor on device meta is not on the expected device cpu!')
            if on_meta and not received and getattr(_device_of(stage.__dict__, stage), "type", None) == "meta":
                raise PlanError(ON_META) from exc
            raise
        return values

    @property
    def specializations(self) -> tuple[Any, ...]:
        """The further captures made for calls the first one's guards refused, oldest first: each
        with the argument shapes it was made for and how long it took (``autoshard.specialize``)."""
        return () if self.specializer is None else tuple(self.specializer.specializations)

    def specialize(self, *args: Any, **kwargs: Any) -> ShardedModel:
        """Capture the model for inputs like these ahead of a call, running no stage, and keep the
        plan for the calls it serves (in training mode, the way to serve inputs whose guard would
        fail after a stage computed); the plan made for inputs of exactly this structure already,
        where there is one (the example's own: these stages). A call refused before is tried again (the model
        may have changed where a call's refusal is not told). Needs ``shard_model(..., respecialize=True)``."""
        if self.specializer is None:
            raise PlanError(_NO_SPECIALIZER)
        return self.specializer.plan_for(self, args, kwargs, guard="made ahead with sharded.specialize", retry=True)

    def save_plan(self, path: Any) -> Any:
        """Write the plan file ``autoshard split --out`` writes (JSON) to ``path`` (a str or path) and
        return its ``Path``; ``autoshard.load_plan(path, model)`` rebuilds these stages from it. The file
        format lives above this module: ``shard_model`` and ``load_plan`` give the stages the
        ``plan_origin`` (``autoshard.plan_io.PlanOrigin``) that writes it."""
        origin = getattr(self, "plan_origin", None)
        if origin is None:
            raise PlanError("these stages were made by running a pipeline directly, which records no pipeline "
                            "spec for a plan file; make them with autoshard.shard_model(model, k, pipeline=...) "
                            "or autoshard.load_plan, or save autoshard.plan_io.plan_from_program(program, ...)")
        return origin.save(self, path)


#: Why stages without a specializer capture nothing, and what does: a copy's own ``specialize`` cannot.
_NO_SPECIALIZER = (
    f"{NO_SPECIALISATIONS}, nor do stages made without example inputs. Call specialize on the sharded "
    "model autoshard.shard_model(model, k, example_inputs) (with respecialize=True, the default) or load_plan "
    "returned, before copying or materialising it, and use the plan it returns "
    "(materialize_stage(sharded.specialize(*inputs), ...))")


def fitted_call(first: fx.GraphModule, model_signature: inspect.Signature | None, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call as the first stage takes it: bound as the model binds it (the stage's arguments are
    the example's, by the model's names), then matched to the example's arguments.

    An argument the example left out is fixed at its default in the plan: passed with that same
    value (``mask=None``) it is dropped, with another it is refused, naming what the plan takes. An
    argument the example passed and the call leaves out gets the model's default, as in the model
    (the plan's guard then says whether it serves that value). Without the model's signature (a
    plan rebuilt from a file) the call is bound to the stage's own arguments.

    How a call of one structure (how many positional arguments, which keywords) binds is worked
    out once and kept (``_Binding``): a later call of that structure only moves its values into
    place and checks those the binding cannot decide (a left-out default, a tensor where one is due).
    """
    return _binder(first, model_signature).bind(args, kwargs)


def _binder(first: fx.GraphModule, model_signature: inspect.Signature | None) -> _Binder:
    binder = _BINDERS.get(first)
    if binder is None or binder.model_signature is not model_signature:
        binder = _BINDERS[first] = _Binder(first, model_signature)
    return binder


#: ``_binder`` for ``fit_call``, where torch.compile may trace a call that makes one: making it reads the stage's
#: graph, which torch.compile does not trace, and a function it is told to skip is one clean graph break.
_untraced_binder = torch.compiler.disable(_binder)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, itself one or a dict, list or tuple of them (else by pytree), in order."""
    kind = type(value)
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        return [value]
    if kind is dict or kind is list or kind is tuple:
        return [t for item in (value.values() if kind is dict else value) for t in _tensors_in(item)]
    return [leaf for leaf in tree_iter(value) if isinstance(leaf, torch.Tensor)]


def _holds_a_tensor(value: Any) -> bool:
    """Whether pytree finds a tensor among ``value``'s leaves. The dicts, lists and tuples calls pass
    are read without it, up to the first tensor (pytree's walk of a dict of two tensors: 6 us a call)."""
    kind = type(value)
    if kind is dict or kind is list or kind is tuple:
        items = value.values() if kind is dict else value
        return any(isinstance(v, torch.Tensor) or _holds_a_tensor(v) for v in items)
    return any(isinstance(v, torch.Tensor) for v in tree_iter(value))


class _KeptBinder:
    """A sharded model's ``_Binder``, with the first stage it binds for: read with the model's
    other state (``fit_call``) instead of looked up by stage. Made with the sharded model, and for a
    copy with its copied first stage, so that ``torch.compile`` traces a first call that only reads
    it (making one reads the stage's graph: a graph break); a pickle finds its own on its first call."""

    def __init__(self, first: fx.GraphModule | None = None, model_signature: inspect.Signature | None = None) -> None:
        self.first = first
        self.binder = None if first is None else _binder(first, model_signature)

    def __deepcopy__(self, memo: dict[int, Any]) -> _KeptBinder:
        first = memo.get(id(self.first))  # copied before it: a module copies its ``_modules`` first
        if first is None or self.binder is None:
            return _KeptBinder()
        return _KeptBinder(first, memo.get(id(self.binder.model_signature), self.binder.model_signature))

    def __reduce__(self) -> tuple[Any, ...]:
        return _KeptBinder, ()


#: The keywords of every stage call but the first (read, never written).
_NO_KEYWORDS: dict[str, Any] = {}


@dataclass(frozen=True)
class _Slot:
    """A stand-in for a call's value while a structure is bound: its index among the call's
    positional values followed by its keyword values, in the call's order."""

    index: int


@dataclass(frozen=True)
class _Binding:
    """How calls of one structure reach the first stage: ``moved`` (stage argument, index of its
    value), ``left_out`` (model arguments the stage fixed at their defaults, indices of their
    values), ``fills`` (defaults of the model given to the stage), the arguments that must hold
    tensors (with the indices of their values), and the error a call of this structure gets from
    the stage's own signature (raised after the left-out values are checked, as binding it would;
    ``another_capture``: the error is only that the call leaves out what the example passed, or
    passes the model's ``**kwargs`` in another order, which another capture serves).
    ``as_is``: the stage takes the call as it was made (the same values in the same places):
    positional values for its first parameters in order, or any call when there is no model
    signature (the call is bound to the stage's own)."""

    moved: tuple[tuple[str, int], ...]
    left_out: tuple[tuple[str, int], ...]
    fills: dict[str, Any]
    #: (stage argument, index of its value, the example's class there, whether a leaf where the code asked
    #: (else None); a tensor without an example: ``_Binder._check_tensor`` then compares neither)
    tensors: tuple[tuple[str, int, type, bool | None], ...]
    error: TypeError | None
    as_is: bool = False
    another_capture: bool = False
    #: of the tensor arguments ``compared`` (two or more), which the example's were one tensor
    #: (``one_tensor_groups`` by argument name); for two, the indices of their values (one ``is``), and
    #: whether they were
    groups: tuple[tuple[str, ...], ...] | None = None
    compared: tuple[tuple[str, int], ...] = ()
    pair: tuple[int, int] | None = None
    paired: bool = False


#: In a first stage's ``meta``: what the example's tensor arguments were besides their dtypes and shapes
#: (``ExampleTensors``), which the capture answered the model's code from.
EXAMPLE_TENSORS_KEY = "autoshard_example_tensors"


@dataclass(frozen=True)
class ExampleTensors:
    """What a capture answers about the example's tensor arguments without a guard of its own, whatever its
    front end: their class (``isinstance(x, nn.Parameter)``; fx's proxies are no Parameter), which are
    computed by autograd where the code asked (``x.grad_fn is None``; fx's proxies say they are) and
    which are one tensor (``y is x``; fx's are two). By the first stage's argument names; checked by the
    binder on every call, a difference captured again (``_Binder.bind``)."""

    classes: Mapping[str, type]
    #: whether each argument whose ``grad_fn`` or ``is_leaf`` the capture's code asked was a leaf
    leaves: Mapping[str, bool]
    #: per argument, the first argument that is the same tensor (itself where none before it is)
    groups_of: Mapping[str, str]
    #: where a list or dict argument held a tensor: the groups of every tensor that are one, by path
    #: (``d['p']``), which a call's are compared with (``_Binder._check_nested``); else None
    nested: tuple[tuple[str, ...], ...] | None = None
    #: whether one of those groups holds more than one
    nested_one: bool = False
    #: the capture had no example inputs (``shard_model(model, k)``, ``of_proxies``): the stage takes every
    #: argument of the model's forward as a tensor, and refusals say so, not "the example"
    from_proxies: bool = False

    @classmethod
    def of(cls, named: Mapping[str, Any], leafness_asked: frozenset[str] = frozenset()) -> ExampleTensors:
        tensors = {name: value for name, value in named.items() if isinstance(value, torch.Tensor)}
        first = {name: group[0] for group in one_tensor_groups(tensors) for name in group}
        every = one_tensor_groups({name + keystr(path): leaf for name, value in named.items()
                                   for path, leaf in tree_flatten_with_path(value)[0]
                                   if isinstance(leaf, torch.Tensor)})
        in_containers = any(name not in tensors for group in every for name in group)
        return cls({name: tensor_class(t) for name, t in tensors.items()},
                   {name: t.is_leaf for name, t in tensors.items() if name in leafness_asked}, first,
                   every if in_containers else None, any(len(group) > 1 for group in every))

    @classmethod
    def of_proxies(cls, names: Iterable[str], leafness_asked: frozenset[str] = frozenset()) -> ExampleTensors:
        """What a capture without example inputs answered from fx's proxies: each argument a tensor of its
        own, no Parameter, computed by autograd (``x.grad_fn`` a proxy, not None) where the code asked."""
        names = tuple(names)
        return cls(dict.fromkeys(names, torch.Tensor), {name: False for name in names if name in leafness_asked},
                   {name: name for name in names}, from_proxies=True)


class _Binder:
    """``fitted_call`` for one first stage and model signature, with its bindings by call structure."""

    def __init__(self, first: fx.GraphModule, model_signature: inspect.Signature | None) -> None:
        self.signature = inspect.signature(first.forward)
        self.model_signature = model_signature
        self.example: ExampleTensors | None = getattr(first, "meta", {}).get(EXAMPLE_TENSORS_KEY)
        self.without_example = self.example is not None and self.example.from_proxies
        inputs = _graph_inputs(first)
        self.inputs = tuple(self.signature.parameters) if inputs is None else inputs
        self.bindings: dict[tuple[Any, ...], _Binding | TypeError] = {}

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any],
             keep_positions: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call as the first stage takes it: by name, or with ``keep_positions`` as it was made
        when that is the same call (``ShardedModel``'s own; PyTorch's pipeline takes only tensors
        by position, and a runtime names each value)."""
        structure = (len(args), *kwargs)
        binding = self.bindings.get(structure)
        if binding is None:
            binding = self._binding(len(args), tuple(kwargs))
            if not torch.compiler.is_compiling():  # kept from a traced call, it changes a dict the graph's guards
                self.bindings[structure] = binding  # read: the next call of these inputs would compile it all again
        if isinstance(binding, TypeError):  # the model itself refuses the call (or, without its signature, the plan)
            if self.model_signature is None:
                raise self._refusal(binding)
            takes = ", ".join(self.model_signature.parameters)
            raise CallRefusedError(f"the model's forward({takes}) refuses these arguments ({binding}), as calling "
                                   "the model would: call the sharded model as the model takes them")
        values = (*args, *kwargs.values()) if kwargs else args
        if binding.left_out:
            self._check_left_out(binding, values)
        if binding.error is not None:
            raise self._refusal(binding.error, binding.another_capture)
        for name, index, kind, leaf in binding.tensors:
            value = values[index]
            if type(value) is not kind or leaf is not None and value.is_leaf is not leaf:
                self._check_tensor(name, value, kind, leaf)
        if binding.groups is not None and (
                (values[binding.pair[0]] is values[binding.pair[1]]) is not binding.paired if binding.pair is not None
                else _groups_differ(binding, values)):
            raise self._unlike(_one_tensor(
                "arguments", one_tensor_groups({name: values[index] for name, index in binding.compared}),
                binding.groups or ()))
        if self.example is not None and self.example.nested is not None:
            self._check_nested(binding, values)
        if binding.as_is and (keep_positions or self.model_signature is None):
            return args, kwargs
        call = {name: values[index] for name, index in binding.moved}
        call.update(binding.fills)
        return (), call

    def _check_tensor(self, name: str, value: Any, kind: type, leaf: bool | None) -> None:
        """Refuse ``value`` for a tensor argument unless it is one (or a container holding one), of the
        example's class, a leaf where the example's was (``leaf`` None: not asked; where there was an
        example)."""
        if not isinstance(value, torch.Tensor):
            if not _holds_a_tensor(value):
                raise self._refusal(TypeError(
                    f"{name} is {brief(value)}, but the plan was captured with tensors there"), another_capture=True)
            return
        if self.example is None or (tensor_class(value) is kind and leaf in (None, value.is_leaf)):
            return
        raise self._unlike(  # (leafness said only where compared)
            f"{name} is {_tensor_kind(tensor_class(value), value.is_leaf or leaf is None)}, but the plan was "
            f"captured with {_tensor_kind(kind, leaf is not False)} there, from which the capture answered the "
            "model's code (isinstance(x, nn.Parameter), x.grad_fn is None)")

    def _check_nested(self, binding: _Binding, values: tuple[Any, ...]) -> None:
        """Where the example passed tensors in a list or dict (``{"p": x, "q": x}``), compare which of a call's
        tensors, in its containers too, are one (``ExampleTensors.nested``): by a count of the distinct ones
        first, by path only where the example's or the call's were not all distinct."""
        expected = self.example.nested
        tensors = [t for _, index in binding.moved for t in _tensors_in(values[index])]
        if not self.example.nested_one and len({id(t) for t in tensors}) == len(tensors):
            return  # none is one with another, as in the example (other containers: the input guard's to say)
        now = one_tensor_groups({name + keystr(path): leaf for name, index in binding.moved
                                 for path, leaf in tree_flatten_with_path(values[index])[0]
                                 if isinstance(leaf, torch.Tensor)})
        if sorted(n for group in now for n in group) != sorted(n for group in expected for n in group):
            return  # other keys or lengths: the input guard's to say
        if now != expected:
            raise self._unlike(_one_tensor("tensors", now, expected))

    def _unlike(self, reason: str) -> InputMismatchError:
        """The refusal of a call whose tensors are not as the capture's (``ExampleTensors``): another capture
        serves it, or for a plan captured without example inputs, one with an example like it."""
        if self.without_example:
            return _not_fitting_the_signature(self.signature, TypeError(reason), another_capture=True)
        return _unlike_the_example(reason)

    def _refusal(self, reason: TypeError, another_capture: bool = False) -> InputMismatchError:
        """``_not_fitting``, or for a plan captured without example inputs, ``_not_fitting_the_signature``."""
        if self.without_example:
            return _not_fitting_the_signature(self.signature, reason, another_capture)
        return _not_fitting(self.signature, reason, another_capture)

    def _check_left_out(self, binding: _Binding, values: tuple[Any, ...]) -> None:
        """Refuse a value other than the default for an argument the example left out."""
        changed = [(name, values[index]) for name, index in binding.left_out
                   if not is_default(self.model_signature, name, values[index])]
        if changed:
            defaults = [parameter_default(self.model_signature, name) for name, _ in changed]
            given = ", ".join(f"{name}={brief(value)}" if not isinstance(value, torch.Tensor) else name
                              for name, value in changed)
            reason = (f"the example left {', '.join(f'{n}={brief(d)}' for (n, _), d in zip(changed, defaults))} at the "
                      f"default, which the plan computes with, and these inputs give {given}"
                      if inspect.Parameter.empty not in defaults
                      else f"the example did not pass {', '.join(repr(name) for name, _ in changed)}")
            raise self._refusal(TypeError(reason), another_capture=True)

    def _left_out(self, dropped: list[str]) -> str:
        """Why a call leaving out ``dropped`` (names, quoted) is refused: the example passed them, or the
        plan, made without an example, takes every argument."""
        if self.without_example:
            return f"they leave out {', '.join(dropped)}"
        return (f"the example passed {', '.join(dropped)}, which these inputs leave out; pass "
                f"{'it' if len(dropped) == 1 else 'them'} as the example did")

    def _binding(self, count: int, keywords: tuple[str, ...]) -> _Binding | TypeError:
        slots = [_Slot(i) for i in range(count)]
        keyed = {key: _Slot(count + i) for i, key in enumerate(keywords)}
        if self.model_signature is None:
            try:
                bound = bind_as_called(self.signature, slots, keyed)
            except TypeError as exc:
                return exc
            moved = {name: slot.index for name, slot in bound.items()}
            return _Binding(tuple(moved.items()), (), {}, error=None, as_is=True,
                            **self._tensors_checked([(n, moved[n]) for n in self.inputs if n in moved]))
        try:
            bound = bind_as_called(self.model_signature, slots, keyed)
        except TypeError as exc:
            return exc
        named = argument_names(self.model_signature, bound)
        parameters = self.signature.parameters
        moved = {name: slot.index for name, slot in named.items() if name in parameters}
        fills = {name: parameter_default(self.model_signature, name) for name in parameters
                 if name not in moved and name not in self.inputs
                 and parameter_default(self.model_signature, name) is not inspect.Parameter.empty}
        # an argument the example passed, which the model would default (or, one of its ``**kwargs``,
        # not see): not 'missing a required argument', nor the stage's own default, the example's value
        dropped = [repr(name) for name in parameters if name not in moved and name not in fills]
        error: TypeError | None = TypeError(self._left_out(dropped)) if dropped else None
        # the model's ``**kwargs`` in another order than the example's: its code may read them in order
        var_keyword = next((value for name, value in bound.items()
                            if self.model_signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD), {})
        passed = [key for key in var_keyword if key in parameters]
        reordered = passed != [name for name in parameters if name in var_keyword]
        if reordered and error is None:
            error = TypeError(f"the model takes {', '.join(passed)} as **kwargs, in another order than the "
                              "example's, and its code may read them in order, which the capture fixed")
        try:
            self.signature.bind(**moved, **fills)
        except TypeError as exc:
            error = error or exc
        left_out = tuple((name, slot.index) for name, slot in named.items() if name not in parameters)
        positional = [name for name, p in parameters.items()
                      if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        as_is = (not keywords and not left_out and not fills and error is None
                 and list(moved.items()) == [(name, index) for index, name in enumerate(positional[:count])])
        return _Binding(tuple(moved.items()), left_out, fills, error=error, as_is=as_is,
                        another_capture=bool(dropped) or reordered,
                        **self._tensors_checked([(n, moved[n]) for n in self.inputs if n in moved]))

    def _tensors_checked(self, tensors: list[tuple[str, int]]) -> dict[str, Any]:
        """A ``_Binding``'s fields checking its tensor arguments (``(name, index)``) as the example's
        (``ExampleTensors``): each one's class and whether it is a leaf, and which are one tensor (two
        tensors: one ``is``; more: grouped by object)."""
        example = self.example
        if example is None:
            return {"tensors": tuple((name, index, torch.Tensor, None) for name, index in tensors)}
        checked = tuple((name, index, example.classes.get(name, torch.Tensor), example.leaves.get(name))
                        for name, index in tensors)
        compared = tuple((name, index) for name, index in tensors if name in example.classes)
        if len(compared) < 2:
            return {"tensors": checked}
        by_first: dict[str, list[str]] = {}
        for name, _ in compared:
            by_first.setdefault(example.groups_of[name], []).append(name)
        groups = tuple(map(tuple, by_first.values()))
        pair = (compared[0][1], compared[1][1]) if len(compared) == 2 else None
        return {"tensors": checked, "compared": compared, "groups": groups, "pair": pair, "paired": len(groups) == 1}


def note_example_tensors(first: fx.GraphModule, model_signature: inspect.Signature | None,
                         example: tuple[tuple[Any, ...], Mapping[str, Any]] | None,
                         leafness_asked: frozenset[str] = frozenset()) -> None:
    """Keep on ``first`` (the first stage, before its first call) what the example's tensor arguments were
    (``ExampleTensors``; without an example, ``of_proxies``), which its binder compares every call's with."""
    binder = _Binder(first, model_signature)
    if example is None:
        first.meta[EXAMPLE_TENSORS_KEY] = ExampleTensors.of_proxies(binder.inputs, leafness_asked)
        return
    args, kwargs = example
    bound_args, bound_kwargs = binder.bind(tuple(args), dict(kwargs))
    named = inspect.signature(first.forward).bind(*bound_args, **bound_kwargs).arguments
    first.meta[EXAMPLE_TENSORS_KEY] = ExampleTensors.of(named, leafness_asked)


def _unlike_the_example(reason: str) -> SpecializationMismatch:
    """The refusal of a call whose tensors are not as the example's (``ExampleTensors``): a capture made with
    them may serve it."""
    return SpecializationMismatch(f"these inputs do not fit the sharded plan: {reason}; shard the model again with "
                                  "an example like these inputs", before_compute=True)


def _groups_differ(binding: _Binding, values: tuple[Any, ...]) -> bool:
    """Whether a call's tensor arguments ``compared`` (three or more) are one tensor otherwise than the
    example's were (``groups``): by a count of distinct ones first, the groups only where some were one."""
    distinct = len({id(values[index]) for _, index in binding.compared})
    if distinct != len(binding.groups or ()):
        return True
    return distinct != len(binding.compared) and binding.groups != one_tensor_groups(
        {name: values[index] for name, index in binding.compared})


def _tensor_kind(kind: type, leaf: bool) -> str:
    """``a Parameter`` / ``a tensor computed by autograd`` (not a leaf)."""
    return f"a {'tensor' if kind is torch.Tensor else kind.__name__}{'' if leaf else ' computed by autograd'}"


def _one_tensor(what: str, now: tuple[tuple[str, ...], ...], then: tuple[tuple[str, ...], ...]) -> str:
    """Which of a call's ``what`` (arguments, tensors) are one tensor (``now``, ``one_tensor_groups``), against
    the example's (``then``)."""
    def said(groups: tuple[tuple[str, ...], ...]) -> str:
        return "; ".join(" and ".join(group) for group in groups if len(group) > 1) or "none"
    return (f"the {what} that are one tensor are {said(now)}, but {said(then)} were when the plan was captured, "
            "whose capture answered the model's y is x from its inputs")


#: ``_Binder`` by first stage (a stage's graph does not change after emit).
_BINDERS: weakref.WeakKeyDictionary[fx.GraphModule, _Binder] = weakref.WeakKeyDictionary()


def _graph_inputs(first: fx.GraphModule) -> tuple[str, ...] | None:
    """The first stage's arguments that are graph inputs, as its input guard lists them; None when
    it has no guard (it has no constants then: every argument is an input)."""
    guard = _input_guard(first)
    return None if guard is None else guard.returns


def _input_guard(first: fx.GraphModule) -> InputGuard | None:
    """The first stage's ``InputGuard``, None when it has none."""
    if first not in _INPUT_GUARDS:
        guards = [node for node in first.graph.nodes if node.op == "call_function" and node.target is check_inputs]
        _INPUT_GUARDS[first] = getattr(first, str(guards[0].args[0].target)) if guards else None
    return _INPUT_GUARDS[first]


#: ``_input_guard`` by stage, found once (a stage's graph does not change after emit).
_INPUT_GUARDS: weakref.WeakKeyDictionary[fx.GraphModule, InputGuard | None] = weakref.WeakKeyDictionary()


def _not_fitting(signature: inspect.Signature, reason: TypeError, another_capture: bool = False) -> InputMismatchError:
    """The refusal of a call the plan's arguments do not take. ``another_capture``: the model takes it (an
    argument the example left at its default, or passed and this call leaves out), so a capture made
    with it serves it: a ``SpecializationMismatch``, on which a sharded model re-specialises."""
    message = (f"these inputs do not fit the sharded plan: {reason}. The plan takes "
               f"({', '.join(signature.parameters)}), the arguments its example passed (one left out was fixed at its "
               "default); shard the model again with an example that passes these arguments")
    return SpecializationMismatch(message, before_compute=True) if another_capture else InputMismatchError(message)


def _not_fitting_the_signature(signature: inspect.Signature, reason: TypeError,
                               another_capture: bool = False) -> InputMismatchError:
    """The refusal of a call a plan captured without example inputs does not take: its graph takes every
    argument of the forward as a tensor, so no talk of "the example", and (no re-specialisation without
    one) no advice to call the sharded model: sharding with an example is the way."""
    message = (f"these inputs do not fit the sharded plan: {reason}. The plan was made without example inputs, "
               f"from the forward's signature: it takes every argument ({', '.join(signature.parameters)}) as a "
               "tensor, each its own and no Parameter (as fx's proxies answered the model's code), and serves only "
               "calls like that; to serve calls like these, shard the "
               "model with example_inputs= (and example_kwargs=) like them: a model sharded with example inputs also "
               "captures itself again for calls its plan does not serve (respecialize=True, the default)")
    if another_capture:
        return SpecializationMismatch(message, before_compute=True, other_capture=False)
    return InputMismatchError(message)


class _PlacedOn:
    """Where a stage's weights are, found once: refreshed when the stage is moved through ``.to()``
    (``FixedDtypes._apply`` drops it) or when its first weight is elsewhere now (the model moved on
    its own, ``model.to("cuda")``). That weight is read from its module's registry on every call:
    a move may put a new tensor there rather than move the old one."""

    __slots__ = ("registry", "key", "probe_device", "device")

    def __init__(self, stage: nn.Module) -> None:
        # a parameter first: buffers of modules the capture traced through are the stage's own, and
        # stay where they are when the model moves
        modules = list(stage.modules())
        held = [(registry, key, tensor) for registry in [m._parameters for m in modules] + [m._buffers for m in modules]
                for key, tensor in registry.items() if tensor is not None]
        # (not from a TorchScript module's registries: views of its compiled module, without ``get``)
        probe = next((entry for entry in held if isinstance(entry[0], dict)), None)
        #: the registry and name of the weight read on every call (None: the stage holds none, or only a
        #: TorchScript module's, found again when the stage is moved)
        self.registry, self.key = probe[:2] if probe else (None, None)
        self.probe_device = probe[2].device if probe else None
        devices = {tensor.device for _, _, tensor in held}
        #: the one device of the stage's weights (None: none, or several)
        self.device = devices.pop() if len(devices) == 1 else None


def stage_device(stage: nn.Module) -> torch.device | None:
    """The one device a stage's weights are on (None: none, or several), read once and kept."""
    return _device_of(stage.__dict__, stage)


def _device_of(held: dict[str, Any], stage: nn.Module) -> torch.device | None:
    """``stage_device`` given the stage's ``__dict__``, where the kept ``_PlacedOn`` is."""
    placed = held.get(PLACED_ON)
    if placed is not None:
        if placed.registry is None:
            return placed.device
        probe = placed.registry.get(placed.key)
        if probe is not None and probe.device == placed.probe_device:
            return placed.device
    placed = held[PLACED_ON] = _PlacedOn(stage)
    return placed.device


#: Why a stage on the meta device does not take real tensors.
ON_META = ("a stage whose weights are on the meta device (a plan made from a model on meta; materialize_stage gives "
           "real weights only to the stages it is asked for) was handed real tensors, from which it can compute "
           "nothing but shapes: run the stages that were materialised (copy.stages[i]), or materialise every stage "
           "before calling the sharded model")


def moved_to(device: torch.device | None, values: Any, refuse_meta: bool = False) -> Any:
    """``values`` (a tuple, or a dict of keyword arguments) with their tensors on ``device``: stages
    placed on devices of their own by hand (``stages[i].to(f"cuda:{i}")``) hand each other their
    boundary values there. Flat values already there (always, on one device) are passed on as
    they are, without rebuilding the container. ``refuse_meta``: a stage of a plan made on meta is
    there because it was never materialised, so real values are refused (``ON_META``), not made meta."""
    if device is None:
        return values
    for value in values.values() if isinstance(values, dict) else values:
        if isinstance(value, torch.Tensor) and value.device != device or not isinstance(value, _PASSED_AS_THEY_ARE):
            break
    else:  # a plain loop: a generator for all() cost as much as the rest of the check
        return values
    if refuse_meta and device.type == "meta":
        raise PlanError(ON_META)
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v, values)
