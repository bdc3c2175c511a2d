"""Re-specialisation: a sharded model serves a call its capture's guards refuse by capturing again.

A capture fixes some of its example's sizes and branches (a condition on a sequence length, a size
turned into a Python number), the constants it was given (``return_dict=False``, ``scale=2.0``) and
which arguments it was given at all (``labels`` passed or left at its default); a call that differs
in one of these raises ``SpecializationMismatch``. As
torch.compile recompiles on a failed guard, the ``Specializer`` kept on the ``ShardedModel``
captures the model again for that call's inputs and splits the new graph under the same
partition: every parameter and buffer one stage holds is pinned to that stage (optional pins: a
weight this branch does not read pins nothing), so what makes the plan a plan, which stage holds
which weights, stays. The new stages are verified against the model on the call (when the
pipeline verifies) and kept; later calls try first the specialisation that last served their
argument shapes, so a cached one costs its own guard check and a shape lookup.

A call in the other grad mode than code that asked ``torch.is_grad_enabled()`` was captured in
(diffusers' blocks ask it to choose gradient checkpointing) re-specialises too: the new capture is
made in the call's mode, and the grad mode counts among the shapes a plan is remembered by and,
where its code asked, among what it is chosen by. So does a call under another ``torch.autocast``
state than the plan's capture (every stage checks it, ``check_autocast``): autocast changes the
dtypes the model's code computes in, which a capture answers once.
A container argument of another length, other keys or other values in it re-specialises too. Only
a ``SpecializationMismatch`` re-specialises: another dtype or device, an argument the model does
not take, or a module switched to another mode is refused as before. In
training mode a guard that fails after a stage has computed is refused too where the stages hold
buffers or draw random numbers, as running them again would update the buffers (batch-norm
statistics) twice and move the generator on:
``sharded.specialize(*args, **kwargs)`` makes the specialisation without running any stage. Draws alone
do not refuse a call: where a plan tried may refuse it after its stages drew (calls of shapes not served
before; in training mode, a plan with checks after compute), the default generators are read first and
set back before the next plan runs (``generators.rewind``, 1.5-3.5 us a call).
"""

from __future__ import annotations

import inspect
import itertools
import operator
import pickle
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves

from autoshard.capture.attribute_reads import checked_value, copied
from autoshard.capture.eager import check_model_runs
from autoshard.capture.guard import (autocast_now, captured_autocast, check_inputs, check_site, chosen_grad_mode,
                                     tensor_class)
from autoshard.capture.reruns import Rerun, rerun_of_nodes
from autoshard.capture.signature import argument_names, forward_signature, is_default
from autoshard.capture.state import COUNT_ELSEWHERE
from autoshard.capture.structure import same_constant
from autoshard.errors import (
    AutoshardError, EmptyStageError, ExampleInputsError, InfeasibleSplitError, InputMismatchError, PinConflictError,
    SpecializationMismatch, plural, user_stacklevel,
)
from autoshard.generators import generator_snapshot, rewind
from autoshard.isolation import hooks_registered, settings_objects
from autoshard.sharded import ShardedModel

#: How many specialisations a sharded model makes at most, by default (torch.compile's recompile
#: limit is 8 too).
MAX_SPECIALIZATIONS = 8

#: How many argument shapes a sharded model remembers the serving plan of.
REMEMBERED_SHAPES = 256

ShapeKey = tuple[Any, ...]
#: Runs one plan on a call: ``ShardedModel.run_stages``, or a runtime's own way.
Runner = Callable[[ShardedModel, tuple[Any, ...], dict[str, Any]], Any]


class SpecializationLimitWarning(UserWarning):
    """A sharded model made its last allowed specialisation; later new ones are refused."""


@dataclass(frozen=True)
class Specialization:
    """One more capture of the model: the argument shapes it was made for (its guard values), the
    guard the earlier plans failed, how long the capture took, and its stages."""

    shapes: ShapeKey
    guard: str
    seconds: float
    sharded: ShardedModel = field(repr=False)
    structure: Any = field(repr=False)  # ``call_structure`` of the inputs it was made for
    #: the model's attributes its code read with other values than the first plan's (``config.use_cache=False``)
    attributes: tuple[str, ...] = ()

    def describe(self) -> str:
        """Each tensor it was made for, by argument and place in it (``batch['x']: (1, 8)``), each
        other value given (``scale=3.0``), the grad mode when it was off, and the model's attributes
        that differed from the first plan's."""
        shapes = ", ".join(f"{_readable(path)}: {tuple(leaf)}" if isinstance(leaf, torch.Size)
                           else f"{_readable(path)}={leaf!r}" for path, leaf in self.structure)
        grad = ", without grad" if chosen_grad_mode(self.sharded.stages) is False else ""
        model = f", with the model's {', '.join(self.attributes)}" if self.attributes else ""
        return f"{shapes or 'no arguments'}{grad}{model} ({self.seconds:.1f} s to capture)"


def _readable(path: str) -> str:
    """A ``call_structure`` path as code reads it: ``['batch']['x']`` is ``batch['x']``."""
    if path.startswith("['"):
        end = path.index("']")
        return path[2:end] + path[end + 2:]
    return path


def shape_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> ShapeKey:
    """The call's argument shapes, by position and keyword (None for a value that is no tensor).
    Top-level arguments only, so it costs a microsecond or two."""
    return (*enumerate(map(_shape, args)), *zip(kwargs, map(_shape, kwargs.values())))


def _served_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> ShapeKey:
    """The grad mode, the autocast state and each top-level argument's shape, or its value where it
    is a flag, a number or a string, or where it is a dict, a tuple, a list or a ``torch.Size``, what
    tells its items apart the same way (a dict's keys in order with them): which specialisation to
    try first (its own guards decide whether it serves the call). A plan for the other mode fails its
    grad-mode guard only where that code runs, after the stages before it computed; calls switching
    between two constants or two key orders tried the other's plan first (1.2x-1.7x the model's time),
    and so did calls switching a dict's tensor between two sizes a branch tells apart, or a size
    argument between values (``F.interpolate(x, size=size)``): 1.4x-2.0x."""
    return (torch.is_grad_enabled(), autocast_now(), *enumerate(map(_told_apart, args)),
            *zip(kwargs, map(_told_apart, kwargs.values())))


#: What begins an ``_alike`` key, so that none equals a served key.
_ALIKE = object()


def _alike(key: ShapeKey) -> ShapeKey:
    """``key`` with each tensor's shape as its number of dimensions: a call of sizes no plan served yet (a
    batch of another size, a tensor in a dict included) tries first the plan that last served a call alike
    but for its sizes, as before shapes inside a dict told calls apart (else the first plan would be tried,
    and in training mode its guard failing after a stage computed refuses the call)."""
    return (_ALIKE, *map(_without_sizes, key))


def _without_sizes(part: Any) -> Any:
    if type(part) is torch.Size:
        return len(part)
    return tuple(map(_without_sizes, part)) if type(part) is tuple else part


def _shape(value: Any) -> Any:
    return value.shape if isinstance(value, torch.Tensor) else None


#: Argument types ``_served_key`` keys by value: hashable, and compared at once.
_KEYED_BY_VALUE = frozenset({bool, int, float, str, type(None)})
#: Container types ``_served_key`` keys by their items (``_item``), in order.
_KEYED_BY_ITEMS = frozenset({tuple, list, torch.Size})


#: How many items of a container ``_served_key`` looks at: each costs it a few hundred nanoseconds a call.
_ITEMS_KEYED = 16


def _told_apart(value: Any) -> Any:
    """What ``_served_key`` keys a top-level argument by: a tensor's shape, a plain value, a container's
    first ``_ITEMS_KEYED`` items as ``_item`` tells them apart, and its length (one level: the input guard
    walks the rest), else None. (All of a list of 100 tensors cost 27 µs a call, not 2.)"""
    if isinstance(value, torch.Tensor):
        return value.shape
    kind = type(value)
    if kind in _KEYED_BY_VALUE:
        return value
    if kind is dict:
        return len(value), tuple(zip(value, map(_item, itertools.islice(value.values(), _ITEMS_KEYED))))
    return (len(value), tuple(map(_item, itertools.islice(value, _ITEMS_KEYED)))) if kind in _KEYED_BY_ITEMS else None


def _item(value: Any) -> Any:
    """A container's item as ``_served_key`` keys it: a tensor's shape, a plain value, else None."""
    if isinstance(value, torch.Tensor):
        return value.shape
    return value if type(value) in _KEYED_BY_VALUE else None


class _Constant:
    """A value of a call that is no tensor, in a ``call_structure``: equal to the same constant
    (``same_constant``, as the capture's checks compare them), whatever its ``==`` returns."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Constant) and same_constant(other.value, self.value)

    def __hash__(self) -> int:
        return hash(type(self.value))

    def __repr__(self) -> str:
        return repr(self.value)


def _described(value: Any) -> Any:
    return value.shape if isinstance(value, torch.Tensor) else _Constant(value)


def bound_arguments(signature: inspect.Signature | None, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The call's arguments by the names ``signature`` (the model's ``forward``) gives them; None where
    there is none, or it refuses them."""
    try:
        return None if signature is None else dict(signature.bind(*args, **kwargs).arguments)
    except TypeError:
        return None


def call_structure(args: tuple[Any, ...], kwargs: dict[str, Any], signature: inspect.Signature | None = None) -> Any:
    """Every value of the call under the parameter it binds to in ``signature`` (the model's
    ``forward``; a call it refuses is taken as written), nested containers included: each tensor's
    shape and each other value. What ``plan_for`` matches a microbatch on. An argument by position
    or by name, and one given its default or left out, are the same call, as they are to the
    capture's guards and the call's binding; a dict's keys in another order are not (the model's
    code may read them in order). Walking every input costs more than ``shape_key``, so it runs
    where a plan is chosen once for many calls, not per call."""
    call: Any = (tuple(args), dict(kwargs))
    bound = bound_arguments(signature, args, kwargs)
    if signature is not None and bound is not None:
        call = argument_names(signature, {name: value for name, value in bound.items()
                                          if not is_default(signature, name, value)})
    found, _ = tree_flatten_with_path(call)
    return tuple((keystr(path), _described(leaf)) for path, leaf in found)


class CapturedFor:
    """The call a plan was captured for (``call_structure`` of its example), kept on the plan itself
    (``ShardedModel.captured_for``): a copy of the stages (``copy.deepcopy``, ``materialize_stage``,
    a pickle) keeps no ``Specializer``, and still serves that call without choosing among plans, as
    ``pipeline_stage(..., microbatch=)`` asks (``serves_as_captured``)."""

    __slots__ = ("structure",)

    def __init__(self, structure: Any) -> None:
        self.structure = structure

    def __deepcopy__(self, memo: dict[int, Any]) -> CapturedFor:
        return self  # shapes and constants, never changed

    def __reduce__(self) -> tuple[Any, ...]:
        try:
            pickle.dumps(self.structure)
        except Exception:  # noqa: BLE001 - a constant of the example's that cannot be pickled: the copy knows none
            return type(None), ()
        return CapturedFor, (self.structure,)


def serves_as_captured(plan: ShardedModel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``plan`` was captured for a call of exactly this structure and serves it as things stand
    (``_serves_now``): what a copy of the stages, which makes no specialisations, may be chosen for."""
    made = plan.captured_for
    return (made is not None and made.structure == call_structure(args, kwargs, plan.model_signature)
            and _serves_now(plan, args, kwargs))


def _serves_now(plan: ShardedModel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a plan captured for calls of this structure serves this one now: one whose code chose its
    path by the grad mode serves that mode only, each serves the autocast state it was captured in, and
    the attributes of the model its code read as they are now (``StateAtCapture``), and inputs its input
    guard passes (an export capture's: laid out as its example, contiguous or not, requiring grad or not)."""
    return (chosen_grad_mode(plan.stages) in (None, torch.is_grad_enabled()) and captured_autocast(plan.stages)
            == autocast_now() and _read_as_now(plan) and plan.inputs_accepted(args, kwargs))


class Specializer:
    """Serves a ``ShardedModel``'s calls, capturing the model again when a guard flips.

    ``capture(model, args, kwargs, pins)`` shards the model for a call's inputs with ``pins``
    (``{weight name: stage}``) held; ``shard_model`` gives it the pipeline, cost and memory model
    of the first plan. It holds the model, as the stages do (they watch its modules' modes).
    """

    def __init__(self, model: nn.Module, capture: Callable[..., ShardedModel], limit: int = MAX_SPECIALIZATIONS,
                 example: tuple[tuple[Any, ...], dict[str, Any]] = ((), {}), keep_example: bool = False):
        self._model = model
        self._capture = capture
        self.limit = limit
        self._signature = forward_signature(model)
        self.example = self.structure(*example)  # what the first plan was captured for (not its tensors)
        #: the example itself, kept only where ``keep_example`` (the first plan's calls write a setting their next
        #: call reads anew): ``settled`` captures the model for it as its first call leaves it
        self.example_call = example if keep_example else None
        self.specializations: list[Specialization] = []
        #: how many specialisations were dropped as made for hooks the model no longer holds (``_retire_unhooked``)
        self.retired = 0
        #: per served key, the plans that served it, the latest first
        self._last: dict[ShapeKey, list[ShardedModel]] = {}
        #: per call (its structure, its tensors' dtypes, devices, layouts and whether they require grad, the
        #: grad mode and autocast), the model's state a new capture for it failed in, and that refusal (None
        #: where the model itself raised on it)
        self._refused: dict[Any, tuple[list[Any], InputMismatchError]] = {}
        #: per plan, the stage a guard of it failed in after some computed and that guard's site, ``rerun_of``
        #: them (``_rerun``)
        self._reruns: dict[tuple[ShardedModel, nn.Module | None, str | None], Rerun] = {}
        self._late: dict[ShardedModel, bool] = {}  # per plan: has checks after compute (``_checks_late``)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        """A copy of the stages holds copies of the weights, which a capture of the model would not:
        copies serve what their own guards allow, as before."""
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        return type(None), ()

    @property
    def model(self) -> nn.Module:
        """The model it captures again: every plan it makes holds this model's weights."""
        return self._model

    def structure(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``call_structure`` of a call of this model."""
        return call_structure(args, kwargs, self._signature)

    # -- serving ---------------------------------------------------------------------------------
    def serve(self, primary: ShardedModel, args: tuple[Any, ...], kwargs: dict[str, Any],
              run: Runner = ShardedModel.run_stages, given_back: bool = False) -> Any:
        """Run the plan that serves this call: the one that last served its shapes, then the others,
        then a new capture. ``run(plan, args, kwargs)`` runs one plan (a runtime's own way, such as
        ``OffloadRunner``'s; default: the stages in turn). ``given_back``: the caller restores the
        buffers and random state afterwards (a measurement), so stages may run again after a guard
        failed in training mode."""
        if not self.specializations:
            # in training mode, a check late in the stages may refuse a call after they drew (1.5-3.5 us a
            # call; not in a call torch.compile traces, which cannot rewind and has no plan to go on to)
            snapshot = generator_snapshot() if self._model.training and not given_back and \
                not torch.compiler.is_compiling() and self._checks_late(primary) else None
            try:
                return run(primary, args, kwargs)
            except SpecializationMismatch as exc:
                if not given_back:
                    self._check_rerun(primary, exc, snapshot)
                return self._specialized(primary, args, kwargs, exc, run)
        key = _served_key(args, kwargs)
        served = self._last.get(key)
        alike = served if served is not None else self._last.get(_alike(key))  # new sizes: the plan of the last alike
        first = None if alike is None else _first_to_try(alike)
        failed: SpecializationMismatch | None = None
        # new shapes may take a plan whose guard refuses them after its stages drew: those draws are drawn again
        snapshot = generator_snapshot() if served is None and not given_back and \
            not torch.compiler.is_compiling() else None
        for sharded in self._in_turn(primary, first):
            try:
                result = run(sharded, args, kwargs)
            except SpecializationMismatch as exc:
                if not given_back:
                    self._check_rerun(sharded, exc, snapshot)
                # name the first plan's guard; its traceback would keep the tried plan's activations alive
                failed = exc.with_traceback(None) if failed is None or sharded is primary else failed
                continue
            if served is None or served[0] is not sharded:  # (the steady state keeps the list as it is)
                self._remember(key, sharded)
            return result
        assert failed is not None
        return self._specialized(primary, args, kwargs, failed, run)

    def _checks_late(self, plan: ShardedModel) -> bool:
        """Whether a check of ``plan`` may refuse a call after a stage computed (one ``check_order`` could
        not move to the start of the first stage), found once per plan."""
        found = self._late.get(plan)
        if found is None:
            found = self._late[plan] = _checks_after_compute(plan)
        return found

    def _in_turn(self, primary: ShardedModel, first: ShardedModel | None) -> Iterator[ShardedModel]:
        """``first``, then every other plan, the primary first: made as they are tried, so that a call the
        first serves builds no list of them."""
        if first is not None:
            yield first
        for plan in self._plans(primary):
            if plan is not first:
                yield plan

    def made_for(self, primary: ShardedModel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ShardedModel | None:
        """The plan captured for a call of exactly this structure (``call_structure``: nested shapes and
        constants too), if any: what serves it where no stage may run to choose, or a step must not
        fall back half-way, and which serves it as things stand (``_serves_now``)."""
        key = self.structure(args, kwargs)
        made = [(self.example, primary)] + [(s.structure, s.sharded) for s in self.specializations]
        return next((plan for structure, plan in made if structure == key and _serves_now(plan, args, kwargs)), None)

    def _remember(self, key: ShapeKey, sharded: ShardedModel) -> None:
        """Keep which plans served these shapes, and calls alike but for their sizes (``_alike``), the latest
        first, for the last ``REMEMBERED_SHAPES`` keys."""
        for remembered in (key, _alike(key)):
            served = self._last.get(remembered, [])
            _keep_latest(self._last, remembered, [sharded, *(plan for plan in served if plan is not sharded)])

    def _refusing(self, key: Any, state: list[Any], message: str) -> InputMismatchError:
        """The refusal of a call no capture serves, remembered for calls like it while the model stays as
        it is: the same capture would fail again, after seconds of tracing and verifying."""
        refusal = InputMismatchError(message)
        self._remember_refusal(key, state, refusal)
        return refusal

    def _remember_refusal(self, key: Any, state: list[Any], refusal: InputMismatchError | None) -> None:
        """Keep the refusal of a call (None: the model itself raised on it) for the last ``REMEMBERED_SHAPES``."""
        _keep_latest(self._refused, key, (state, refusal))

    def _limit_reached(self, primary: ShardedModel, args: tuple[Any, ...], kwargs: dict[str, Any],
                       guard: str) -> InputMismatchError:
        """The refusal of a new capture past ``limit``: what each plan was made for, and what made so many
        (a count the forward moves on, a number passed that could be a tensor, hooks registered since)."""
        seen = "; ".join(s.describe() for s in self.specializations) or "none"
        numbers = [name for name, value in (bound_arguments(self._signature, args, kwargs) or {}).items()
                   if type(value) in (int, float)]
        tensor = (f"; a number passed as an argument ({', '.join(numbers)}) is a constant of each capture, "
                  "one plan per value: where the model only computes with it (no branch or size taken from "
                  "it), pass it as a tensor (torch.tensor(t)), an input of one plan for every value"
                  ) if numbers else ""
        moving = set.intersection(*(set(made.sharded.attributes_moved_by_each_call())
                                    for made in self.specializations)) if self.specializations else set()
        hooked = sum(made.sharded.holds_other_hooks_than(primary) for made in self.specializations)
        dropped = (f", and {plural(self.retired, 'plan')} made for the hooks before were dropped (at most "
                   "max_specializations are, so that hooks changing on every call are not captured on every call)"
                   ) if self.retired else ""
        hooks = (f"; {hooked} of them were made because hooks were registered on the model's modules since{dropped}: "
                 "shard the model with such a call as the example (for Transformers' output recorders: one asking "
                 "for hidden states) to plan with the hooks from the start") if hooked else ""
        advice = (f"the forward changes {', '.join(sorted(moving))} on every call (each value took a capture of "
                  f"its own, and a larger max_specializations only puts this off): {COUNT_ELSEWHERE}" if moving else
                  "shard the model (or load its plan) with a larger max_specializations= to serve these inputs too"
                  f"{tensor}{hooks}")
        return InputMismatchError(f"{guard}. This sharded model has made its {plural(self.limit, 'specialisation')} "
                                  f"(max_specializations; made for: {seen}); {advice}")

    def _retire_unhooked(self) -> None:
        """Drop the specialisations made for hooks the model's modules no longer hold, where that keeps the
        plans dropped in all within ``limit``: Transformers installs output recorders on the first call
        asking for hidden states, and no plan made before serves a call after. (A model whose hooks
        change on every call would otherwise be captured again on every call.)"""
        stale = [made for made in self.specializations if not made.sharded.hooks_hold()]
        if not stale or self.retired + len(stale) > self.limit:
            return
        self.retired += len(stale)
        gone = {id(made.sharded) for made in stale}
        self.specializations = [made for made in self.specializations if id(made.sharded) not in gone]
        self._last = {key: kept for key, plans in self._last.items()
                      if (kept := [plan for plan in plans if id(plan) not in gone])}
        self._reruns = {key: rerun for key, rerun in self._reruns.items() if id(key[0]) not in gone}

    def _plans(self, primary: ShardedModel) -> list[ShardedModel]:
        return [primary] + [s.sharded for s in self.specializations]

    def _check_rerun(self, tried: ShardedModel, exc: SpecializationMismatch,
                     snapshot: list[torch.Tensor] | None = None) -> None:
        """Refuse to run stages again after some computed, where that is not the same as running them
        once: buffers they update in place (batch-norm statistics, a step counter) would be updated
        twice, random draws (dropout, sampling) would move the generators on, unless they are set back to
        ``snapshot`` (read before the stages ran), which is done here."""
        if exc.before_compute:
            return
        if not self._rerun(tried, exc.stage, exc.site).holds(rewound=snapshot is not None):
            raise SpecializationMismatch(
                f"{exc.refusal}. Stages that update buffers (batch-norm statistics, a step counter) or draw random "
                "numbers are not run again for new inputs once some have computed (the buffers would be updated "
                "twice, the draws would differ from the model's); the stages before this guard have run for this "
                "call (any buffers they update are updated). Call sharded.specialize(*args, **kwargs) with inputs "
                "like these before such calls", other_capture=False) from exc
        if snapshot is not None:
            rewind(snapshot)

    def _rerun(self, tried: ShardedModel, last: nn.Module | None, site: str | None) -> Rerun:
        """``rerun_of(tried, last, site)``, walked once per plan, stage and check and kept."""
        found = self._reruns.get((tried, last, site))
        if found is None:
            found = self._reruns[tried, last, site] = rerun_of(tried, last, site)
        return found

    def _specialized(self, primary: ShardedModel, args: tuple[Any, ...], kwargs: dict[str, Any],
                     exc: SpecializationMismatch, run: Runner) -> Any:
        return run(self.specialize(primary, args, kwargs, guard=exc.refusal), args, kwargs)

    # -- capturing -------------------------------------------------------------------------------
    def plan_for(self, primary: ShardedModel, args: tuple[Any, ...], kwargs: dict[str, Any],
                 guard: str = "made for a microbatch", retry: bool = False) -> ShardedModel:
        """The plan captured for inputs of exactly these shapes (``call_structure``: nested ones too),
        captured now if none is. For runtimes that build their stages before any call
        (``pipeline_stage``): there a guard failing in the middle of a step has no plan to fall back
        to, so the plan is chosen by shape up front; and for ``sharded.specialize``, which would
        otherwise capture again what a plan serves (a training loop calling it before each step)."""
        made = self.made_for(primary, args, kwargs)
        return made if made is not None else self.specialize(primary, args, kwargs, guard=guard, retry=retry)

    def settled(self, primary: ShardedModel, plan: ShardedModel,
                call: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> ShardedModel:
        """``plan``, or where each of its calls writes a setting of the model that the next call reads with the
        new value (a Hugging Face classifier fills in ``config.problem_type`` on its first call with labels), the
        plan made for the model as such a call leaves it: the model is set so, as that call would set it, and
        the plan for ``call`` (by default the example, where kept: ``example_call``) chosen or captured then.
        What a runtime running one plan for several calls builds from (a pipeline's stages run once per
        microbatch): ``plan`` serves the first only. A setting each call moves on (a count) is refused."""
        if not plan.attributes_moved_by_each_call():
            return plan
        call = call if call is not None else self.example_call
        if call is None:
            raise InputMismatchError(
                f"each call of these stages sets the model's {', '.join(plan.attributes_moved_by_each_call())} "
                "to another value than they were captured with, and no inputs were given to capture the model "
                "with that value; give the call's inputs (pipeline_stage(..., microbatch=...))")
        plan.write_settings_back()
        after = self.plan_for(primary, *call, guard="made for the model as a call of the plan before leaves it")
        moving = after.attributes_moved_by_each_call()
        if moving:
            raise InputMismatchError(
                f"the model's forward changes {', '.join(moving)} on every call, which its code reads, so each call "
                f"takes a capture of its own and no plan serves several in turn: {COUNT_ELSEWHERE}")
        return after

    @torch.compiler.disable  # a capture runs as Python, even where torch.compile traces the sharded model
    def specialize(self, primary: ShardedModel, args: tuple[Any, ...], kwargs: dict[str, Any],
                   guard: str = "made ahead with sharded.specialize", retry: bool = False) -> ShardedModel:
        """Capture the model for these inputs under the primary plan's partition, keep and return it.
        Other shapes, constants, arguments passed or left out, the grad mode and the modules' modes
        make another capture; a call the model itself refuses (an argument it does not take) is refused
        as the plan refuses it, and one no capture served before, at once, unless to ``retry``."""
        try:
            primary.check_model_state()  # what cannot be captured again (a module assigned anew) is refused
        except SpecializationMismatch:
            pass  # other attributes or modes than the example's: the capture below is made with them
        try:
            primary.fit_call(args, kwargs)  # arguments the model itself refuses
        except SpecializationMismatch:
            pass  # other arguments or constants than the example's: the capture below is made with them
        structure = self.structure(args, kwargs)
        if len(self.specializations) >= self.limit:
            self._retire_unhooked()
        refusal_key = (structure, _tensor_facts(args, kwargs), torch.is_grad_enabled(), autocast_now())
        refused = None if retry else self._refused.get(refusal_key)
        if refused is not None and refused[1] is None:  # the model raised on a call like it: ask it first
            _raise_where_the_model_does(self._model, args, kwargs)
        if len(self.specializations) >= self.limit:
            raise self._limit_reached(primary, args, kwargs, guard)
        state = _model_state(self._model)
        if refused is not None and refused[1] is not None and refused[0] == state:  # (a serving loop's fallback)
            raise InputMismatchError(
                f"{refused[1]} (refused when first tried, and the numbers, flags, strings and hooks of the model's "
                "modules are as they were then; where something else it reads has changed, sharded.specialize() "
                "with these inputs tries again)")
        before = model_weights_held(self._model, primary)
        started = time.perf_counter()
        try:
            sharded = self._capture(self._model, args, kwargs, ownership(before))
        except ExampleInputsError as exc:
            if exc.__cause__ is not None:  # the model itself refuses these inputs: its own error
                self._remember_refusal(refusal_key, state, None)
                raise exc.__cause__ from None
            raise self._refusing(refusal_key, state, f"{guard}. No plan can be captured for these inputs: {exc}"
                                 ) from exc
        except EmptyStageError as exc:
            raise self._refusing(refusal_key, state, _too_little_to_run(guard, exc)) from exc
        except PinConflictError as exc:
            raise self._refusing(refusal_key, state, _run_as_one_piece(guard, exc)) from exc
        except AutoshardError as exc:  # a pin the new graph's order cannot meet names its weight; a capture failed
            # sharding again is the way only past the pins: what the capture refuses, it refuses there too (so the
            # guard's own advice, its last clause, is left out)
            again = "; shard the model again with an example like these inputs" * isinstance(exc, InfeasibleSplitError)
            raise self._refusing(
                refusal_key, state, f"{guard.rsplit(';', 1)[0]}. A new capture for these inputs, with every weight in "
                f"the stage that holds it, failed ({exc}){again}") from exc
        check_same_holders(before, sharded)
        self.specializations.append(Specialization(shape_key(args, kwargs), guard.split(";")[0],
                                                   time.perf_counter() - started, sharded, structure,
                                                   sharded.attributes_unlike(primary)))
        self._remember(_served_key(args, kwargs), sharded)
        if len(self.specializations) == self.limit and all(made.sharded.hooks_hold() for made in self.specializations):
            warnings.warn(
                f"this sharded model has made its {plural(self.limit, 'specialisation')} (max_specializations); "
                "inputs that need another are refused from now on", SpecializationLimitWarning,
                stacklevel=user_stacklevel())
        return sharded


def _keep_latest(kept: dict[Any, Any], key: Any, value: Any) -> None:
    """``kept[key] = value`` as the latest entry, the oldest dropped past ``REMEMBERED_SHAPES``."""
    kept.pop(key, None)
    kept[key] = value
    while len(kept) > REMEMBERED_SHAPES:
        del kept[next(iter(kept))]


def _first_to_try(served: list[ShardedModel]) -> ShardedModel:
    """Of the plans that served a call's key (the latest first), the one whose check of the model's
    state passes as it stands: a setting switched between calls runs the plan made for it, without a
    refusal first. One plan alone is tried unasked: its stage makes that check anyway, and asking first
    made every call of a sharded model with a specialisation check it twice (6 µs on a 6-block MLP)."""
    if len(served) == 1:
        return served[0]
    return next((plan for plan in served if plan.state_holds()), served[0])


def _too_little_to_run(guard: str, exc: EmptyStageError) -> str:
    """The refusal of inputs whose capture leaves a stage nothing to compute, in the user's terms: the pins
    are the re-specialisation's own (every weight stays in its stage), not the user's. The guard's own
    advice (its last clause: pass these arguments in the example, say) is left out: the example may
    pass them already, and a capture made for them is what failed."""
    fact = guard.rsplit(";", 1)[0]
    if exc.last == exc.stage:
        short = f"stage {exc.stage} of {exc.num_stages} with nothing to compute"
    else:
        short = f"only {plural(exc.nodes, 'node')} to compute for the {exc.stages()} of {exc.num_stages}"
    return (f"{fact}. These inputs run too few of the model's weights and nodes to give every stage work under the "
            f"plan's placement: a new capture for them keeps every weight in the stage that holds it, which leaves "
            f"{short}. Shard the model again with an example like these inputs (its plan places the weights for "
            "them), or into fewer stages")


def _run_as_one_piece(guard: str, exc: PinConflictError) -> str:
    """Why a capture for these inputs cannot keep the plan's placement: it runs ``exc.node`` as one piece
    (code it could not trace with them), whose weights the plan holds in two stages."""
    first, second = exc.stages
    return (f"{guard.rsplit(';', 1)[0]}. A new capture for these inputs runs {exc.node} as one piece (the code it "
            f"could not trace with them), but the plan holds its weights in stages {first} and {second}, and a new "
            "capture keeps every weight in the stage that holds it. Shard the model again with an example like "
            "these inputs (its plan keeps that piece in one stage)")


def _raise_where_the_model_does(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise the model's own error where it raises on this call, run as a capture's last resort runs it
    (leaving the model as it was): a forward's milliseconds, where a capture would take seconds to end
    there too. Values may decide (``if ids.max() >= vocab: raise``), so the model is asked on each call."""
    try:
        check_model_runs(model, args, kwargs)
    except ExampleInputsError as exc:
        raise exc.__cause__ from None


def _model_state(model: nn.Module) -> list[Any]:
    """What a capture's verdict on a call depends on besides the call: each module's numbers, flags and
    strings (its mode among them) and the lists and dicts of them, those of the objects they keep
    settings in (``config.use_cache``), and the hooks registered on them. Read only where a capture is
    to be made."""
    return [hooks_registered(model), *((key, copied(value)) for holder in (*model.modules(), *settings_objects(model))
                                       for key, value in vars(holder).items()
                                       if type(value) in _KEYED_BY_VALUE or (type(value) in (list, dict, tuple)
                                                                             and checked_value(value)))]


def _tensor_facts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Each tensor of a call's dtype, device, layout, class, whether it requires grad and is a leaf, and the
    first tensor it is (``y is x``) (what a capture's input guard reads besides its shape)."""
    tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    first = {id(t): i for i, t in reversed(list(enumerate(tensors)))}
    return tuple((leaf.dtype, leaf.device, leaf.layout, leaf.layout is torch.strided and leaf.is_contiguous(),
                  leaf.requires_grad, leaf.is_leaf, tensor_class(leaf), first[id(leaf)]) for leaf in tensors)


def _read_as_now(sharded: ShardedModel) -> bool:
    """Whether the model is as ``sharded``'s code read it at its capture: the plain attributes it read,
    and the modes of the modules it runs (after ``model.eval()``, the plan made in eval mode)."""
    try:
        sharded.check_model_state()
    except SpecializationMismatch:
        return False
    return True


def _checks_after_compute(plan: ShardedModel) -> bool:
    """Whether a check in ``plan``'s stages follows a module or function call (the input guard and taking
    items apart aside): where ``check_order`` moved every check to the start, none can refuse a call
    after something computed."""
    computed = False
    for stage in plan.stages:
        for node in stage.graph.nodes:
            if check_site(node) is not None:
                if computed:
                    return True
            elif node.op in ("call_module", "call_method") or (
                    node.op == "call_function" and node.target not in (check_inputs, operator.getitem)):
                computed = True
    return False


def rerun_of(sharded: ShardedModel, last: nn.Module | None = None, site: str | None = None) -> Rerun:
    """The ``Rerun`` of ``sharded``'s stages up to ``last`` (all where None), and in ``last`` of its nodes
    up to the check of ``site`` (``guard.check_site``; all where None): a check ``check_order`` moved to
    the start of the first stage refuses a call before anything computed."""
    rerun = Rerun(True)
    for stage in sharded.stages:
        nodes = _up_to_check(stage, site) if stage is last else stage.graph.nodes
        rerun = rerun.then(rerun_of_nodes(stage, nodes, sharded.plan.training))
        if stage is last or not rerun.same:
            break
    return rerun


def _up_to_check(stage: torch.fx.GraphModule, site: str | None) -> list[torch.fx.Node]:
    """``stage``'s nodes before its last check of ``site`` (all where it has none): where one of several
    checks of the same site refused, the last is the furthest the stage may have run."""
    nodes = list(stage.graph.nodes)
    return nodes[:max((i for i, node in enumerate(nodes) if site is not None and check_site(node) == site),
                      default=len(nodes))]


def holders(sharded: ShardedModel) -> dict[str, frozenset[int]]:
    """Each parameter and buffer name, with the stages that hold it under that name or hold its
    tensor under another: a tied weight (GPT-2's embedding and head) is held by the embedding's
    stage under one name and by the head's under the other. (A stage moved by hand, ``.to(device)``,
    holds its own copy of a shared buffer under the shared name.)"""
    by_name: dict[str, set[int]] = {}
    by_tensor: dict[int, set[int]] = {}
    tensors: dict[str, set[int]] = {}
    for j, stage in enumerate(sharded.stages):
        for name, tensor in [*stage.named_parameters(remove_duplicate=False),
                             *stage.named_buffers(remove_duplicate=False)]:
            by_name.setdefault(name, set()).add(j)
            by_tensor.setdefault(id(tensor), set()).add(j)
            tensors.setdefault(name, set()).add(id(tensor))
    return {name: frozenset(stages.union(*(by_tensor[key] for key in tensors[name])))
            for name, stages in by_name.items()}


def model_weights_held(model: nn.Module, sharded: ShardedModel) -> dict[str, frozenset[int]]:
    """``holders`` of the model's own parameters and buffers: what a new capture must hold where the
    plan does. A tensor the capture lifts from outside the module tree (a module kept in a plain
    list) gets a name numbered afresh by each capture, so no other capture's name means it."""
    own = {name for name, _ in (*model.named_parameters(remove_duplicate=False),
                                *model.named_buffers(remove_duplicate=False))}
    return {name: stages for name, stages in holders(sharded).items() if name in own}


def ownership(held: dict[str, frozenset[int]]) -> dict[str, int]:
    """``{name: stage}`` for every parameter and buffer one stage holds (a tied weight several stages
    hold is left to the split and checked after)."""
    return {name: min(stages) for name, stages in held.items() if len(stages) == 1}


def check_same_holders(before: dict[str, frozenset[int]], sharded: ShardedModel) -> None:
    """Refuse a specialisation in which a weight both plans hold (``before``: the first plan's) sits
    in a stage the plan did not put it in. Fewer of its holders are fine: a tied weight (T5's shared
    embedding) the new capture reads in one of the plan's stages only is where it needs to be, and
    the holder left out adds no part to the tied gradient's sum (``runtime.ties``)."""
    for name, stages in holders(sharded).items():
        if name in before and not stages <= before[name]:
            raise InputMismatchError(
                f"a new capture for these inputs holds {name!r} in stage(s) {sorted(stages)}, but the plan holds it "
                f"in stage(s) {sorted(before[name])}; shard the model again with an example like these inputs")
