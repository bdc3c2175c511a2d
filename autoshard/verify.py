"""Check that the stages compute what the model computes, and say where they first differ.

An output object holding tensors that compares by identity (a generation cache) is refused
first: nothing could be checked against it. Then three comparisons, in the order a failure is
easiest to act on:
1. the traced graph against the eager model (a tracing problem, before any split);
2. each stage's boundary values against the same values in the traced graph;
3. the chained stages' result against the eager model.
Randomness is replayed from one seed for every run, and buffers (BatchNorm statistics) are
restored after each run, so verifying never changes the user's model. Then the model and the
stages are each called twice in a row: state the model keeps where capture cannot see it shows
in the second call only. Last, the graph and the stages run on other values of the example's
shapes and dtypes (``other_values``): a value the capture fixed where the model computes it from
its inputs matches on the example and on nothing else, a silent wrong answer for every new input.
Where the model is sharded with grad on, the weights' gradients through the stages are compared
with the model's too (``gradient_difference``): a tensor hook the forward registers, or a detach a
trace skipped, shows in the backward alone.

The runs compared here have autograd on, the mode the graph was captured in: some modules take a
fused fast path in no-grad inference (``nn.TransformerEncoderLayer``) that computes the same
values in another op order, so comparing across modes could not be exact. A graph whose code
chose its path by the grad mode with grad off (``check_grad_mode`` guards) is compared with it off,
and so is a model that runs only without grad (``out=`` writes, weights made under inference mode).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map

from autoshard.capture.guard import autocast_now, chosen_grad_mode
from autoshard.capture.host_random import DRAW_WITH_TORCH, host_draws
from autoshard.capture.meta import rebuildable_base
from autoshard.capture.state import COUNT_ELSEWHERE
from autoshard.errors import InputMismatchError, SpecializationMismatch, TraceError, VerificationError, user_stacklevel
from autoshard.isolation import (SCALARS, PlainInterpreter, alike, called_on_copies, cloned, detached_values,
                                 each_tensor_once, isolated, module_state_restored, run_seeded, strided_copy)
from autoshard.lowering.inplace import written_values


def _positional(gm: fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The call's arguments in placeholder order, defaults filled in (an Interpreter runs positionally)."""
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


class _Recorder(PlainInterpreter):
    """Runs the traced graph and keeps the values named in ``wanted``."""

    def __init__(self, gm: fx.GraphModule, wanted: set[str]) -> None:
        super().__init__(gm)
        self.wanted = wanted
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.wanted:
            self.values[n.name] = detached_values(result)
        return result


def _fields_expanded(value: Any) -> Any:
    """``value`` with each plain dataclass (a pytree leaf, whose ``==`` would ask a tensor for a
    bool) replaced by its type's name and fields, and each subclass of a tuple, list or dict the
    trace rebuilds (``rebuildable_base``) by its type's name, items and attributes, so they are
    compared one by one."""
    def expand(leaf: Any) -> Any:
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = {f.name: _fields_expanded(getattr(leaf, f.name)) for f in dataclasses.fields(leaf)}
            return {"dataclass": type(leaf).__qualname__, "fields": fields}
        base = rebuildable_base(leaf)
        if base is not None:
            return {"container": type(leaf).__qualname__, "items": _fields_expanded(base(leaf)),
                    "attributes": _fields_expanded(getattr(leaf, "__dict__", {}))}
        return leaf
    return tree_map(expand, value)


def first_difference(actual: Any, expected: Any, rtol: float, atol: float) -> str | None:
    """A description of the first leaf where two nested values differ, or None if they match."""
    flat_a, spec_a = tree_flatten(_fields_expanded(actual))
    flat_e, spec_e = tree_flatten(_fields_expanded(expected))
    if spec_a != spec_e:
        return f"structure differs: {spec_a} vs {spec_e}"
    for index, (a, e) in enumerate(zip(flat_a, flat_e)):
        if isinstance(e, torch.Tensor):
            try:
                torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as exc:
                return f"leaf {index}: {str(exc).strip().splitlines()[0]}"
        elif a != e:
            return f"leaf {index}: {a!r} != {e!r}"
    return None


def _has_tensors(value: Any, depth: int = 4) -> bool:
    """Whether tensors hide in ``value``: in containers and objects' attributes, ``depth`` levels down."""
    if isinstance(value, torch.Tensor):
        return True
    if depth == 0:
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        items: Any = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        items = getattr(value, "__dict__", {}).values()
    return any(_has_tensors(item, depth - 1) for item in items)


def _named_leaves(value: Any) -> list[tuple[str, Any]]:
    """``value``'s pytree leaves with their paths, or numbered where a registered container type
    has no key function (diffusers registers its output classes so)."""
    try:
        return [(keystr(path) or "the output", leaf) for path, leaf in tree_flatten_with_path(value)[0]]
    except ValueError:
        return [(f"leaf {index}", leaf) for index, leaf in enumerate(tree_flatten(value)[0])]


def objects_holding_tensors(value: Any) -> list[str]:
    """Where ``value`` holds an object with tensors inside that the capture does not look into: one
    comparing by identity (a cache), or one not a dataclass (a ``SimpleNamespace``: it compares by
    value, and the trace kept it as a constant with its tensors gone). A dataclass's fields are read."""
    return [f"{name}: {type(leaf).__name__}" for name, leaf in _named_leaves(value)
            if not isinstance(leaf, torch.Tensor) and _has_tensors(leaf) and rebuildable_base(leaf) is None
            and (type(leaf).__eq__ is object.__eq__ or not dataclasses.is_dataclass(leaf))]


def _captured_grad_mode(gm: fx.GraphModule) -> bool:
    """The grad mode the graph's code was captured for: off where it chose a path with grad off."""
    return chosen_grad_mode([gm]) is not False


def _expected_run(model: nn.Module, gm: fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any],
                  seed: int) -> tuple[bool, Any]:
    """The grad mode to compare in and the model's output in it: the graph's captured mode, with
    grad on where the model runs with it; a model that writes with ``out=`` or holds inference
    tensors runs only without grad, and is compared without."""
    if not _captured_grad_mode(gm):
        return False, _model_run(model, args, kwargs, seed, False)
    try:
        return True, _model_run(model, args, kwargs, seed, True)
    except RuntimeError as with_grad:
        try:
            return False, _model_run(model, args, kwargs, seed, False)
        except Exception:
            raise with_grad from None


def _model_run(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int, grad: bool) -> Any:
    # Every run gets its own copy of the inputs: a forward that writes to them must not feed the
    # next run its output, nor change the caller's tensors.
    return run_seeded(lambda: called_on_copies(model, args, kwargs), model, seed, grad=grad)


def _graph_run(interpreter: fx.Interpreter, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               seed: int, grad: bool) -> Any:
    gm = interpreter.module
    return run_seeded(lambda: interpreter.run(*_positional(gm, *cloned((args, kwargs)))), model, seed, grad=grad)


class _GradientSummary(NamedTuple):
    """What the comparison keeps of one weight's gradient, not the gradient: its count of values that
    are not finite, its norm and largest magnitude, and its dot with a seeded random direction (a
    gradient of the same norm pointing elsewhere moves that). Two sets of whole gradients held at
    once cost twice the weights."""

    nonfinite: int
    norm: float
    largest: float
    projected: float
    dtype: torch.dtype


def _summary(grad: torch.Tensor, seed: int) -> _GradientSummary:
    grad = grad.to_dense() if grad.layout != torch.strided else grad
    finite = torch.isfinite(grad)
    values = torch.where(finite, grad, 0).float()
    direction = torch.randn(grad.shape, generator=torch.Generator().manual_seed(seed))
    return _GradientSummary(int((~finite).sum()), float(values.norm()), float(values.abs().max()) if grad.numel()
                            else 0.0, float((values * direction.to(values.device)).sum()), grad.dtype)


def _gradients(model: nn.Module, run: Callable[[], Any], seed: int) -> dict[str, _GradientSummary | None]:
    """The gradients ``run()`` gives the model's trainable parameters, summarised, backward from a
    seeded weighted sum of its floating outputs (empty where none needs a gradient). By ``backward``,
    as training takes them (a reentrant checkpoint gives none to ``autograd.grad``), with each
    weight's own ``.grad`` set back after; ``run`` is given inputs of its own."""
    weights = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    kept = [p.grad for _, p in weights]
    try:
        for _, p in weights:
            p.grad = None
        with isolated(model, seed), torch.enable_grad():
            leaves = [t for t in tree_flatten(_fields_expanded(run()))[0]
                      if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
            if not leaves or not weights:
                return {}
            scales = torch.Generator().manual_seed(seed)
            sum((t * torch.rand(t.shape, generator=scales).to(t)).sum() for t in leaves).backward()
        return {name: None if p.grad is None else _summary(p.grad, seed + i) for i, (name, p) in enumerate(weights)}
    finally:
        for (_, p), grad in zip(weights, kept):
            p.grad = grad


def _hooked(model: nn.Module) -> bool:
    """Whether a weight has a hook of its own, which a backward for checking would run (it may log,
    clip, or step an optimizer)."""
    return any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


def gradient_difference(model: nn.Module, run: Callable[[tuple[tuple[Any, ...], dict[str, Any]]], Any],
                        args: tuple[Any, ...], kwargs: dict[str, Any], seed: int,
                        grad: bool) -> tuple[bool, str | None]:
    """Whether the weights' gradients through ``run()`` (the graph, the stages) were compared with those
    through the model, and where they first differ (None where they agree). The forward values agree
    exactly by then; a backward may still add in another order (a kernel the model's own path avoided),
    so the gradients are compared within a tolerance of their dtype, or autocast's (``loose``): what
    fails is a gradient lost (a tensor hook the forward registered, a ``detach`` the trace did not
    take), gained, or scaled. Not compared where the runs compared are without grad (``grad``) or the
    model is sharded under ``torch.no_grad()`` (for inference alone), nor on meta, nor where a weight
    has a hook of its own (``_hooked``). ``run(inputs)`` runs them on ``inputs``: the example's, as
    leaves of their own, so that no gradient reaches the caller's tensors."""
    if not (grad and torch.is_grad_enabled()) or _hooked(model) or any(p.is_meta for p in model.parameters()):
        return False, None
    own = each_tensor_once(lambda t: alike(t.detach(), t), (args, kwargs))
    try:
        expected = _gradients(model, lambda: called_on_copies(model, *own), seed)
    except Exception as exc:  # noqa: BLE001 - the model's own backward fails (autograd's in-place check)
        warnings.warn(
            f"the model's own backward raises on the example ({type(exc).__name__}: {str(exc).splitlines()[0]}), "
            "so the stages' gradients were not compared with it, and they may train where the model cannot: "
            "mend the model's backward before training the stages", UncheckedGradientsWarning,
            stacklevel=user_stacklevel())
        return False, None
    try:
        actual = _gradients(model, lambda: run(own), seed)
    except Exception as exc:  # noqa: BLE001 - the model's ran: that is the difference
        return True, f"the backward raises {type(exc).__name__}: {exc}, where the model's runs"
    cast = autocast_now()
    narrowest = [dtype for enabled, dtype in cast or () if enabled]
    for name, want in expected.items():
        got = actual.get(name)
        if got is None or want is None:
            held = got if want is None else want
            if held is None or (held.norm == 0 and held.nonfinite == 0):
                continue
            return True, (f"parameter {name} gets {'no' if got is None else 'a'} gradient, where the model "
                          f"gives it {'none' if want is None else 'one'}")
        loose = max(1e-3, *(8 * torch.finfo(dtype).eps for dtype in (want.dtype, *narrowest)))
        if got.nonfinite != want.nonfinite or abs(got.norm - want.norm) > loose * want.norm \
                or abs(got.projected - want.projected) > 3 * loose * want.norm:
            return True, (f"parameter {name}'s gradient differs from the model's (norm {got.norm:.4g} against "
                          f"{want.norm:.4g}, largest {got.largest:.3g} against {want.largest:.3g})")
    return bool(expected), None


def capture_difference(model: nn.Module, gm: fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any],
                       seed: int = 0) -> str | None:
    """Where the captured graph's output first differs from the model's on the example, then on
    other values of its shapes, then its weights' gradients (None when equal, or when the output
    cannot be compared: ``verify_stages`` explains that)."""
    grad, expected = _expected_run(model, gm, args, kwargs, seed)
    if objects_holding_tensors(expected):
        return None
    problem = first_difference(_graph_run(PlainInterpreter(gm), model, args, kwargs, seed, grad), expected, 0.0, 0.0)
    other = other_values((args, kwargs), seed)
    problem = problem or (None if other is None else other_values_difference(model, gm, other, seed, grad)[1])
    if problem:
        return problem
    graph = PlainInterpreter(gm)
    return gradient_difference(model, lambda inputs: graph.run(*_positional(gm, *cloned(inputs))), args, kwargs,
                               seed, grad)[1]


def verify_stages(
    model: nn.Module,
    gm: fx.GraphModule,
    stages: Sequence[fx.GraphModule],
    boundaries: Sequence[Sequence[str]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rtol: float = 0.0,
    atol: float = 0.0,
    seed: int = 0,
) -> str:
    """Raise ``VerificationError`` naming the first differing stage; return a summary if all match."""
    with host_draws() as drew:
        grad, expected = _expected_run(model, gm, args, kwargs, seed)
    opaque = objects_holding_tensors(expected)
    if opaque:
        raise VerificationError(
            f"the model returns objects that hold tensors ({'; '.join(opaque)}) where the capture does not look, "
            "so no copy can be checked against them, and stages cannot pass them on (pipeline runtimes send "
            "tensors); if one is a generation cache (past_key_values), call the model with use_cache=False",
            stage=None)
    recorder = _Recorder(gm, {name for boundary in boundaries for name in boundary})
    traced = _graph_run(recorder, model, args, kwargs, seed, grad)
    problem = first_difference(traced, expected, rtol, atol)
    # the graph keeps what the trace drew, while code kept whole draws anew: the likeliest cause of a difference
    draws = (f"; the model drew from {' and '.join(drew)} on this call, and the graph keeps what the trace drew "
             f"(random() < p deciding a branch is fixed to the example's). {DRAW_WITH_TORCH}") if drew else ""
    if problem and drew:
        raise VerificationError(f"the traced graph differs from the model before any split ({problem}){draws}",
                                stage=None)
    if problem:
        raise VerificationError(
            f"the traced graph differs from the model before any split ({problem}); "
            "the capture lost something the model depends on (a rebuilt argument, a hook, "
            "a global setting, a branch on a tensor's exact class, `type(x) is torch.Tensor`, which a "
            "trace answers for its stand-in: isinstance(x, torch.Tensor) is answered as the model's) or "
            "fixed something the model draws anew on every call (randomness "
            "from numpy or Python's random, which the graph keeps as the trace drew it) or changes "
            "between calls where capture cannot see it (a list or dict on a module changed in "
            "place, a global, a class attribute)", stage=None)

    def chained(checked: bool = True, inputs: tuple[tuple[Any, ...], dict[str, Any]] = (args, kwargs)) -> Any:
        values = called_on_copies(stages[0], *inputs)
        for index, stage in enumerate(stages[1:], start=1):
            if checked:
                check_boundary(index - 1, values)
            values = stage(*values)
        return values

    written = written_values(gm)  # recorded after later writes changed them: the outputs tell

    def check_boundary(index: int, values: tuple[Any, ...]) -> None:
        for name, value in zip(boundaries[index], values):
            if name in written:
                continue
            problem = first_difference(value, recorder.values[name], rtol, atol)
            if problem:
                raise VerificationError(
                    f"stage {index} produced value '{name}' that differs from the model's ({problem}){draws}",
                    stage=index)

    actual = run_seeded(chained, model, seed, grad=grad)
    problem = first_difference(actual, expected, rtol, atol)
    if problem:
        last = len(stages) - 1
        raise VerificationError(f"stage {last} (the last) returned a different output ({problem}){draws}",
                                stage=last)
    _check_second_calls(model, args, kwargs, lambda: chained(checked=False), rtol, atol, seed, grad)
    other = other_values((args, kwargs), seed)
    compared, problem = (False, None) if other is None else other_values_difference(
        model, gm, other, seed, grad, rtol, atol, chained=lambda: chained(False, other))
    if problem:
        raise VerificationError(f"{problem}; {_REPORT}", stage=None)
    gradients, problem = gradient_difference(model, lambda inputs: chained(False, inputs), args, kwargs, seed, grad)
    if problem:
        raise VerificationError(
            f"the stages' gradients differ from the model's ({problem}): the capture lost or changed something "
            "only the backward shows (a tensor hook the forward registers, a detach under a branch on "
            "isinstance(x, torch.Tensor), which a trace answers for its proxies); try the other front end in "
            "the pipeline's first pass (pipeline=\"trace,...\" or \"export,...\"), or shard under "
            "torch.no_grad() for inference alone", stage=None)
    also = " and on other values of its shapes" if compared else ""
    grads = "; their weights' gradients match the model's within their dtype's tolerance" if gradients else ""
    return f"{len(stages)} stages match the model on the example inputs{also} (rtol={rtol}, atol={atol}){grads}"


class StateNotReplayedWarning(UserWarning):
    """The model's forward changes attributes of its modules that the stages leave as they are."""


def _warn_unreplayed(model: nn.Module, by_model: list[tuple[nn.Module, str]],
                     by_stages: list[tuple[nn.Module, str]]) -> None:
    """Warn where the model's call changed a plain value on a module (a log it appends to, a count
    on the top-level module) that the stages' call did not: a graph records operations on values,
    not attribute writes (a module kept whole writes its own, as it runs). Not an error: the
    outputs matched, and such bookkeeping is often only read outside the model."""
    replayed = {(id(module), name) for module, name in by_stages}
    paths = {id(module): path for path, module in model.named_modules(remove_duplicate=False)}
    dropped = sorted({f"{paths.get(id(module)) or type(module).__name__}.{name}" for module, name in by_model
                      if (id(module), name) not in replayed})
    if dropped:
        warnings.warn(
            f"the model's forward changes {', '.join(dropped)} on every call, and the stages do not (a captured "
            "graph records operations on values, not attribute writes): a call of the sharded model leaves "
            f"{'it' if len(dropped) == 1 else 'them'} as {'it is' if len(dropped) == 1 else 'they are'}. The outputs "
            "match; keep such bookkeeping outside the forward, or in a forward hook of a module (a module with "
            "hooks is kept whole, and its hooks run on every call)", StateNotReplayedWarning,
            stacklevel=user_stacklevel())


def other_values(inputs: Any, seed: int) -> Any:
    """``inputs`` with other values in the tensors of two or more elements, their shapes, dtypes
    and devices kept, drawn from ``seed``: floating values scaled one by one by 0.9 to 1.1 (signs,
    zeros and infinities stay, so an additive mask stays one), integers shuffled within each
    tensor (token ids stay in the vocabulary), in the strides of the given (a slice stays one: a plan
    export made guards the layout), anything else (bool masks, sparse and quantized tensors) as
    given. None when nothing changed (every tensor constant)."""
    generator = torch.Generator().manual_seed(seed + 1)
    changed = []

    def other(leaf: Any) -> Any:
        if (type(leaf) not in (torch.Tensor, nn.Parameter) or leaf.layout is not torch.strided or leaf.is_quantized
                or leaf.numel() < 2 or leaf.device.type == "meta"):
            return leaf
        with torch.no_grad():
            if leaf.is_floating_point():
                factors = torch.empty(leaf.shape, dtype=torch.float64).uniform_(0.9, 1.1, generator=generator)
                made = leaf * factors.to(leaf.device, leaf.dtype)
            elif leaf.dtype != torch.bool and not leaf.is_complex():
                order = torch.randperm(leaf.numel(), generator=generator).to(leaf.device)
                made = leaf.reshape(-1)[order].reshape(leaf.shape)
            else:
                return leaf
            if made.stride() != leaf.stride() and 0 not in leaf.stride():  # the layout the plan may guard (a slice)
                made = strided_copy(leaf).copy_(made)
        changed.append(not torch.equal(made, leaf))
        return alike(made, leaf)

    made = each_tensor_once(other, inputs)
    return made if any(changed) else None


def other_values_difference(model: nn.Module, gm: fx.GraphModule, other: tuple[tuple[Any, ...], dict[str, Any]],
                            seed: int, grad: bool, rtol: float = 0.0, atol: float = 0.0,
                            chained: Callable[[], Any] | None = None) -> tuple[bool, str | None]:
    """Compare the graph (and the ``chained`` stages) with the model on ``other`` values of the
    example's shapes: (whether anything was compared, where they first differ). The stages run
    first, and the graph only where they differ, to tell the capture's fault from the split's.
    Nothing is compared where the model refuses those values (an index past a table, lengths out
    of order) or the plan's guards do (a branch taken on the values: a call would capture again)."""
    try:
        expected = _model_run(model, *other, seed, grad)
    except Exception:  # noqa: BLE001 - values the model itself refuses say nothing about the capture
        return False, None
    graph = ("the traced graph", lambda: _graph_run(PlainInterpreter(gm), model, *other, seed, grad))
    runs = [graph] if chained is None else [("the chained stages", lambda: run_seeded(chained, model, seed,
                                                                                      grad=grad)), graph]
    problems: list[str] = []
    for what, run in runs:
        try:
            actual = run()
        except InputMismatchError:
            return False, None
        except Exception as failure:  # noqa: BLE001 - reported, with what to do
            problem = (f"{what}: runs on the example, but fails on other values of its shapes and dtypes, which the "
                       f"model runs ({type(failure).__name__}: {failure})")
        else:
            difference = first_difference(actual, expected, rtol, atol)
            problem = difference and (
                f"{what}: equal to the model on the example but not on other values of its shapes and dtypes "
                f"({difference}); the capture fixed something the model computes from its inputs' values, so every "
                "new input would get a wrong answer")
        if not problem:  # the stages match (nothing more to run), or the graph does (the stages' problem stands)
            return True, problems[-1] if problems else None
        problems.append(problem)
    return True, problems[-1]  # the graph differs too: the capture's


_REPORT = ("the capture did not see the model read them: code that passes a value on outside its tensors (a hook "
           "or a callback storing a Python number that the forward reads later) is one way, a bug of autoshard's "
           "another (please report it with the model); meanwhile try the other front end in the pipeline's first "
           "pass (trace or export in place of capture: pipeline=\"trace,...\" or \"export,...\", --pipeline on "
           "the command line)")


def _check_second_calls(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], chained: Callable[[], Any],
                        rtol: float, atol: float, seed: int, grad: bool) -> None:
    """Call the model twice and the stages twice (each pair from the same state and seed) and
    compare the second calls: state the model keeps between calls where capture cannot see it
    (``self.__dict__[...]``, a dict or list changed in place, a global) changes the model's second
    call while the stages keep the branch of the capture, which one call cannot show. Stages whose
    check refuses the second call (a setting their first call wrote, ``StateAtCapture.write_back``)
    leave it to another capture, as a sharded model does."""
    written_by_model: list[tuple[nn.Module, str]] = []
    written_by_stages: list[tuple[nn.Module, str]] = []
    holding_graphs: list[str] = []
    expected = run_seeded(_noting_the_second(lambda: called_on_copies(model, args, kwargs), model, written_by_model,
                                             holding_graphs), model, seed, grad=grad)
    try:
        actual = run_seeded(_noting_the_second(chained, model, written_by_stages), model, seed, grad=grad)
    except SpecializationMismatch:
        counted = sorted({name for module, name in written_by_model
                          if module is model and isinstance(getattr(model, name, None), SCALARS)})
        if counted:  # the first call's write back of a value its second moves on again
            raise TraceError(
                f"the top-level forward of {type(model).__name__} changes its attribute{'s' * (len(counted) > 1)} "
                f"{', '.join(map(repr, counted))} on every call, which its code reads; a captured graph cannot replay "
                f"that write, and each value would take a capture of its own: {COUNT_ELSEWHERE}") from None
        return
    problem = first_difference(actual, expected, rtol, atol)
    if problem:
        raise VerificationError(
            f"the stages' second call on the example differs from the model's ({problem}), though the "
            "first matched: the model keeps state from one call to the next where capture cannot see "
            "it (written through self.__dict__, vars() or object.__setattr__, a dict or list changed in "
            "place, a global or class attribute), which the stages froze at the example's first call; "
            "keep that state in a module attribute (self.ready = True) or a buffer", stage=None)
    _warn_unreplayed(model, written_by_model, written_by_stages)
    if holding_graphs:
        warnings.warn(
            f"the model's forward writes a value that requires grad into its buffer {', '.join(holding_graphs)} "
            "in place: the buffer then holds that call's autograd graph, and the graph of each later write holds "
            "the one before, so what every call's graph saved is never freed (memory grows with every call, in "
            "the model as in the stages, beyond what a plan predicts for one step); write a detached value "
            "(buf.copy_(h.detach())) or under torch.no_grad()", GraphInBufferWarning, stacklevel=user_stacklevel())


class UncheckedGradientsWarning(UserWarning):
    """The model's own backward raised on the example, so the stages' gradients were not compared."""


class GraphInBufferWarning(UserWarning):
    """The model's forward keeps autograd graphs alive from call to call through a buffer."""


def _noting_the_second(call: Callable[[], Any], model: nn.Module, changed: list[tuple[nn.Module, str]],
                       holding_graphs: list[str] | None = None) -> Callable[[], Any]:
    """``call`` made twice in a row, returning the second result, with what the second call changes
    on the model's modules again added to ``changed``: bookkeeping that moves on every call (a log, a
    count), not what a call sets to the same value each time (Swin's window size, a cache filled on
    the first call); and the buffers holding an autograd graph after it to ``holding_graphs``. Run
    inside ``run_seeded``, which sets the model back after both."""
    def calls() -> Any:
        call()
        with module_state_restored(model, changed):
            result = call()
        if holding_graphs is not None:
            holding_graphs.extend(name for name, buffer in model.named_buffers() if buffer.grad_fn is not None)
        return result

    return calls
