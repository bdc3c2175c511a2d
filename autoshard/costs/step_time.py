"""Predicted time of one pipeline training step: the stages' times, the links between them, and
the order the schedule runs their work in.

A formula per schedule (``(m + k - 1) x`` the slowest stage) holds only for equal stages and free
links, so the step is simulated instead: each rank runs its ops (the forward or backward of one
stage on one microbatch) in the order PyTorch's schedule runs them, and an op starts when its rank
is free and its input has arrived. A forward needs the previous stage's forward of the same
microbatch; a backward needs the next stage's backward (the last stage's: its own forward). When
the two stages sit on different ranks the value crosses a link first, which takes ``latency +
bytes / bandwidth``. Besides that delay, each message costs the ranks at both ends
``message_seconds`` of their own time (the runtime's bookkeeping for the op and the transport's
CPU work), during which they run nothing else; and every op takes ``compute_scale`` times its stage's
time alone (ranks sharing one machine's cores and memory slow each other's ops down). The step
ends when the last op does. For k equal
stages of ``f + b`` per microbatch on free links this gives GPipe's and 1F1B's
``(m + k - 1)(f + b)``, and interleaved 1F1B's smaller bubble.

Stage times are per microbatch: the plan's example inputs are one microbatch, as for the
memory model. A forward-only time gives the backward as ``backward_ratio`` times it (2: a
backward computes the gradients of both the inputs and the weights, each about a forward's work).
After its last op each rank steps its optimizer over its stages' weights (``optimizer_step``,
per stage; ``predict_step`` times it, ``plan_report``'s step from per-node times leaves it out).
Not counted: the tied-gradient sum, a loss computed after the last stage, and the links' contention.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

from autoshard.arguments import bytes_per_second, duration, whole_number
from autoshard.costs.estimate import DeviceModel
from autoshard.costs.memory_model import UNMODELLED_SCHEDULES, MemoryModel, stages_per_rank_of
from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, keywords_named, shown, suggest

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""The schedules whose order of work the model follows (PyTorch's ``ScheduleGPipe``,
``Schedule1F1B`` and ``ScheduleInterleaved1F1B``)."""


class Default(float):
    """A ``StepTimeModel`` field's default: the number itself, told apart from the same number given
    (``is_default``), so the runtime calibration fills only the fields a caller leaves out and keeps a
    ``--link-bandwidth 1GB/s`` that happens to equal the default."""

    __slots__ = ()


def is_default(value: Any) -> bool:
    """Whether a ``StepTimeModel`` field holds its default rather than a value given (even an equal one)."""
    return type(value) is Default


DEFAULT_LINK_BANDWIDTH = Default(1e9)
"""Bytes per second between two ranks: about what gloo reaches between two CPU processes on one
machine (``benchmarks/step_time.py`` measures it); pass the interconnect's own for GPUs."""

DEFAULT_LINK_LATENCY = Default(100e-6)
"""Seconds per message between two ranks, whatever its size (gloo on one machine: ~0.1 ms)."""

DEFAULT_BACKWARD_RATIO = 2.0


def format_seconds(value: float) -> str:
    """Seconds in s, ms or µs, whichever reads best (an estimate of a tiny node is microseconds)."""
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3 or value == 0:
        return f"{value * 1000:.3f} ms"
    return f"{value * 1e6:.1f} µs"


def _positive(value: Any, name: str, zero_allowed: bool = False) -> float:
    bound = ">= 0" if zero_allowed else "> 0"
    if not isinstance(value, numbers.Real) or isinstance(value, bool):  # numpy numbers too
        raise InvalidArgumentTypeError(f"{name} must be a finite number {bound}, got {shown(value)}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
        raise InvalidArgumentError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


@keywords_named
@dataclass(frozen=True)
class StepTimeModel:
    """How the step runs, as far as time goes.

    ``schedule`` is one of ``SCHEDULES``; ``microbatches`` the step's count (None: one per rank,
    as the memory model counts them, the fewest PyTorch's ``Schedule1F1B`` accepts; a step it
    refuses is refused, see ``refusal``); ``stages_per_rank`` the stages each process runs under
    interleaved 1F1B (None: 2; any other schedule runs one and refuses more).
    ``link_bandwidth`` (bytes/s, or a rate such as ``"25GB/s"`` or ``"200Gbit/s"``) and ``link_latency`` (s per
    message, or a time such as ``"5us"``) describe the link between ranks; ``message_seconds``
    (s, or a time) is the time each message keeps its sender and its receiver busy (0: free);
    ``compute_scale`` how much longer a stage's forward or backward runs inside the pipeline than
    timed alone (1: as alone; ``autoshard.runtime.calibrate_runtime`` measures these four with the
    real runtime).
    ``backward_ratio`` is a backward's time over its forward's where only the forward's is known.
    """

    schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int | None = None
    link_bandwidth: float | str = DEFAULT_LINK_BANDWIDTH
    link_latency: float | str = DEFAULT_LINK_LATENCY
    backward_ratio: float = DEFAULT_BACKWARD_RATIO
    message_seconds: float | str = Default(0.0)
    compute_scale: float = Default(1.0)

    def __post_init__(self) -> None:
        for name, read in (("link_bandwidth", lambda text: bytes_per_second(text, "link_bandwidth", "B/s")),
                           ("link_latency", lambda text: duration(text, "link_latency")),
                           ("message_seconds", lambda text: duration(text, "message_seconds"))):
            if isinstance(getattr(self, name), str):  # '25GB/s', '5us': stored as the number
                object.__setattr__(self, name, read(getattr(self, name)))
        if not isinstance(self.schedule, str):
            raise InvalidArgumentTypeError(f"schedule must be the name of one of {', '.join(SCHEDULES)}, got "
                                           f"{shown(self.schedule)}")
        name = self.schedule.lower()
        if name not in SCHEDULES:
            raise InvalidArgumentError(
                f"unknown schedule {self.schedule!r}{suggest(str(name), SCHEDULES)}; the step-time model knows "
                f"{', '.join(SCHEDULES)}{UNMODELLED_SCHEDULES}")
        object.__setattr__(self, "schedule", name)
        if self.microbatches is not None:
            object.__setattr__(self, "microbatches", whole_number(self.microbatches, "microbatches", at_least=1))
        object.__setattr__(self, "stages_per_rank", stages_per_rank_of(name, self.stages_per_rank))
        for name, described, zero_allowed in (("link_bandwidth", "link_bandwidth (bytes per second)", False),
                                              ("link_latency", "link_latency (seconds)", True),
                                              ("backward_ratio", "backward_ratio", True),
                                              ("message_seconds", "message_seconds", True),
                                              ("compute_scale", "compute_scale", False)):
            value = getattr(self, name)
            checked = _positive(value, described, zero_allowed)
            if not isinstance(value, float):  # numpy numbers as Python's, for to_dict's JSON (a Default stays one)
                object.__setattr__(self, name, checked)

    def microbatch_count(self, num_stages: int) -> int:
        """The step's microbatches; by default one per rank, as the memory model counts them."""
        if self.microbatches is not None:
            return self.microbatches
        return num_stages // self.stages_per_rank if self.schedule == "interleaved-1f1b" else num_stages

    def refusal(self, num_stages: int) -> str | None:
        """Why PyTorch's schedule would refuse this step on ``num_stages`` stages (None: it runs it),
        checked as its constructor checks: ``Schedule1F1B`` wants at least one microbatch per
        stage, ``ScheduleInterleaved1F1B`` whole rounds; ``ScheduleGPipe`` runs any count."""
        m = self.microbatch_count(num_stages)
        if self.schedule == "1f1b" and m < num_stages:
            return (f"PyTorch's Schedule1F1B needs at least as many microbatches as stages and refuses {m} for "
                    f"{num_stages} stages: give at least {num_stages} microbatches, or the gpipe schedule, which "
                    "runs any count")
        if self.schedule != "interleaved-1f1b":
            return None
        per_rank = self.stages_per_rank
        if num_stages % per_rank:
            return (f"interleaved-1f1b runs {per_rank} stages per rank, so the stages must divide by it; got "
                    f"{num_stages} stages: pick stages_per_rank dividing {num_stages}")
        ranks = num_stages // per_rank
        rounds = max(1, m // ranks)
        if m % rounds:
            return (f"interleaved-1f1b splits the microbatches into rounds of {ranks} (the ranks); {m} microbatches "
                    f"make {rounds} rounds with some left over: use a multiple of {rounds}")
        return None

    def link_seconds(self, nbytes: float) -> float:
        """One message of ``nbytes`` over the link."""
        return self.link_latency + nbytes / self.link_bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "microbatches": self.microbatches, "stages_per_rank": self.stages_per_rank,
                "link_bandwidth": self.link_bandwidth, "link_latency": self.link_latency,
                "backward_ratio": self.backward_ratio, "message_seconds": self.message_seconds,
                "compute_scale": self.compute_scale}


Op = tuple[bool, int, int]
"""(backward, stage, microbatch)."""


def _orders(model: StepTimeModel, k: int, m: int) -> tuple[list[list[Op]], list[int]]:
    """Each rank's ops in the schedule's order, and each stage's rank."""
    if model.schedule == "interleaved-1f1b":
        return _interleaved_orders(k, m, model.stages_per_rank)
    orders = []
    for stage in range(k):
        # GPipe: every forward, then every backward. 1F1B (Schedule1F1B, m >= k): k - stage forwards,
        # then a backward and a forward in turn until the forwards are done, then the remaining backwards.
        warm = m if model.schedule == "gpipe" else k - stage
        kinds = [False] * warm + [True, False] * (m - warm) + [True] * warm
        orders.append(_numbered(kinds, [stage] * len(kinds)))
    return orders, list(range(k))


def _interleaved_orders(k: int, m: int, per_rank: int) -> tuple[list[list[Op]], list[int]]:
    """``ScheduleInterleaved1F1B``'s order (its ``_calculate_single_rank_operations``): stage s on
    rank s mod ranks; a warm-up of forwards, then a forward and a backward per step, then the
    remaining backwards, moving to the next local stage every round of microbatches (``k``, ``m``
    and ``per_rank`` as ``StepTimeModel.refusal`` accepts them)."""
    ranks = k // per_rank
    per_round, total = m // max(1, m // ranks), m * per_rank
    orders = []
    for rank in range(ranks):
        warm = min((per_rank - 1) * per_round + 2 * (ranks - 1 - rank), total)

        def forward_stage(op: int, rank: int = rank) -> int:
            return (op // per_round) % per_rank * ranks + rank

        def backward_stage(op: int, rank: int = rank, warm: int = warm) -> int:
            return (per_rank - 1 - (op - warm) // per_round % per_rank) * ranks + rank

        kinds, stages = [], []
        for op in range(total + warm):
            if op < total:
                kinds.append(False)
                stages.append(forward_stage(op))
            if op >= warm:
                kinds.append(True)
                stages.append(backward_stage(op))
        orders.append(_numbered(kinds, stages))
    return orders, [s % ranks for s in range(k)]


def _numbered(kinds: Sequence[bool], stages: Sequence[int]) -> list[Op]:
    """Ops with their microbatch: each stage's forwards, and its backwards, run microbatches in order."""
    seen: dict[tuple[bool, int], int] = {}
    ops = []
    for backward, stage in zip(kinds, stages):
        mb = seen.get((backward, stage), 0)
        seen[(backward, stage)] = mb + 1
        ops.append((backward, stage, mb))
    return ops


def _idle_share(bubble: float) -> str:
    """The bubble in whole percent, except that one with some compute left reads "over 99%", not
    100%, which says the ranks never compute (links far slower than tiny stages came to 99.97%)."""
    return "over 99%" if 0.995 <= bubble < 1 else f"{bubble:.0%}"


@dataclass(frozen=True)
class StepTime:
    """One step's predicted ``seconds``; per stage its ``busy`` seconds (forward and backward of
    every microbatch, with the time their messages keep the rank busy, and its optimizer step);
    ``bubble``, the share of the ranks' time spent idle; ``bottleneck``, the stage with the most work
    per microbatch; ``links``, per boundary, one message's seconds (0 between stages of one rank);
    ``source``, where the stage times came from; ``optimizer_step``, per stage, its optimizer step's
    seconds after the rank's last op (empty: not counted)."""

    seconds: float
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    busy: tuple[float, ...]
    links: tuple[float, ...]
    bubble: float
    bottleneck: int
    microbatches: int
    model: StepTimeModel
    source: str
    optimizer_step: tuple[float, ...] = ()

    def __str__(self) -> str:
        j, m = self.bottleneck, self.microbatches
        forward, backward = format_seconds(self.forward[j]), format_seconds(self.backward[j])
        longest = max(range(len(self.optimizer_step)), key=self.optimizer_step.__getitem__, default=None)
        return (f"{format_seconds(self.seconds)} for {m} microbatch{'' if m == 1 else 'es'} under "
                f"{self.model.schedule}; bubble {_idle_share(self.bubble)} of the ranks' time; bottleneck stage {j} "
                f"(forward {forward} + backward {backward} per microbatch"
                + (f", x{self.model.compute_scale:.2f} their time alone" if self.model.compute_scale != 1 else "")
                + ")" + (f"; then the optimizer step, longest on stage {longest} "
                         f"({format_seconds(self.optimizer_step[longest])})" if longest is not None else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "forward": list(self.forward), "backward": list(self.backward),
                "busy": list(self.busy), "links": list(self.links), "bubble": self.bubble,
                "bottleneck": self.bottleneck, "microbatches": self.microbatches, "model": self.model.to_dict(),
                "source": self.source, "optimizer_step": list(self.optimizer_step)}


def step_time(
    forward: Sequence[float], backward: Sequence[float], boundary_bytes: Sequence[float],
    model: StepTimeModel = StepTimeModel(), source: str = "given", optimizer_step: Sequence[float] = (),
) -> StepTime:
    """Simulate one step: ``forward[j]`` and ``backward[j]`` are stage j's seconds per microbatch
    (timed alone: the step runs them ``model.compute_scale`` times as long, and reports them so),
    ``boundary_bytes[j]`` the bytes stage j sends stage j + 1 per microbatch (its gradient comes
    back the same size); ``optimizer_step[j]`` (empty: none) the seconds of stage j's optimizer step,
    which its rank runs after its last op (scaled alike)."""
    k = len(forward)
    if k < 1 or len(backward) != k or len(boundary_bytes) != k - 1 or len(optimizer_step) not in (0, k):
        raise InvalidArgumentError(
            f"step_time needs a forward and a backward time per stage and the bytes of each boundary (and, if any, "
            f"an optimizer step time per stage): got {len(forward)} forward, {len(backward)} backward, "
            f"{len(boundary_bytes)} boundaries and {len(optimizer_step)} optimizer steps (want k, k, k - 1, k or 0)")
    for name, values in (("forward", forward), ("backward", backward), ("boundary_bytes", boundary_bytes),
                         ("optimizer_step", optimizer_step)):
        for value in values:
            _positive(value, f"every {name} value", zero_allowed=True)
    refused = model.refusal(k)
    if refused is not None:
        raise InvalidArgumentError(refused)
    forward, backward, stepped = ([t * model.compute_scale for t in times]
                                  for times in (forward, backward, optimizer_step or [0.0] * k))
    m = model.microbatch_count(k)
    orders, rank_of = _orders(model, k, m)
    # a boundary between two stages of one rank sends nothing (interleaved 1F1B on one rank)
    links = tuple(model.link_seconds(b) if rank_of[j] != rank_of[j + 1] else 0.0 for j, b in enumerate(boundary_bytes))

    # Each op of a stage receives and sends one message per neighbour stage on another rank.
    messages = [sum(0 <= other < k and rank_of[other] != rank_of[stage] for other in (stage - 1, stage + 1))
                for stage in range(k)]

    def ready(op: Op, finish: dict[Op, float]) -> float | None:
        """When ``op``'s input is on its rank; None while the op it waits for has not run."""
        backward_op, stage, mb = op
        if not backward_op and stage == 0:
            return 0.0
        if backward_op and stage == k - 1:
            return finish.get((False, stage, mb))
        source = (True, stage + 1, mb) if backward_op else (False, stage - 1, mb)
        if source not in finish:
            return None
        crossing = links[min(stage, source[1])] if rank_of[source[1]] != rank_of[stage] else 0.0
        return finish[source] + crossing

    finish: dict[Op, float] = {}
    free = [0.0] * len(orders)
    next_op = [0] * len(orders)
    while any(next_op[r] < len(order) for r, order in enumerate(orders)):
        moved = False
        for r, order in enumerate(orders):
            while next_op[r] < len(order):
                op = order[next_op[r]]
                arrived = ready(op, finish)
                if arrived is None:
                    break
                work = (backward[op[1]] if op[0] else forward[op[1]]) + model.message_seconds * messages[op[1]]
                free[r] = finish[op] = max(free[r], arrived) + work
                next_op[r] += 1
                moved = True
        if not moved:  # pragma: no cover - every order above is one PyTorch runs without deadlock
            raise AssertionError(f"the {model.schedule} order deadlocks at ops {next_op}")
    seconds = max(end + sum(stepped[s] for s in range(k) if rank_of[s] == r) for r, end in enumerate(free))
    busy = tuple(m * (f + b + 2 * model.message_seconds * n) + o
                 for f, b, n, o in zip(forward, backward, messages, stepped))
    idle = 1.0 - sum(busy) / (len(orders) * seconds) if seconds > 0 else 0.0
    bottleneck = max(range(k), key=lambda j: forward[j] + backward[j])
    return StepTime(seconds, tuple(forward), tuple(backward), busy, links, max(idle, 0.0), bottleneck, m, model,
                    source, tuple(stepped) if optimizer_step else ())


def predicted_step(
    seconds: Sequence[float], boundary_bytes: Sequence[float], model: StepTimeModel,
    estimate: DeviceModel | None, timed_backward: bool,
) -> StepTime:
    """The step from a plan's time per stage (one microbatch): estimated under ``estimate``, or
    measured (``estimate`` None) forward only or, with ``timed_backward`` (the profile's own
    setting, carried with its times), forward and backward together (then split ``1 : backward_ratio``).
    The one place a plan's times become forward and backward seconds: ``plan_report`` and the CLI
    both call it."""
    ratio = model.backward_ratio
    if estimate is None and timed_backward:
        forward = [s / (1 + ratio) for s in seconds]
        source = f"measured forward and backward per node (profile{{backward=true}}), split 1 : {ratio:g}"
    else:
        forward = list(seconds)
        made = "measured forward per node (profile)" if estimate is None else f"estimated under {estimate.describe()}"
        source = f"{made}; backward = {ratio:g} x forward"
    return step_time(forward, [f * ratio for f in forward], boundary_bytes, model, source)


def checked_step(step: Any) -> StepTimeModel:
    """``step`` when it is a ``StepTimeModel``, else a refusal that shows one made of a schedule's name
    (``step="gpipe"`` is a natural first try)."""
    if not isinstance(step, StepTimeModel):
        raise InvalidArgumentTypeError(f"step must be a StepTimeModel, got {shown(step)}"
                                       + (f": StepTimeModel({step!r})" if isinstance(step, str) else ""))
    return step


def run_of(memory: MemoryModel) -> StepTimeModel:
    """The step a memory model describes: its schedule, microbatches and stages per rank."""
    return StepTimeModel(memory.schedule, memory.microbatches, memory.stages_per_rank)
