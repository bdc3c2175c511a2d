"""How training is run, as far as memory goes (``MemoryModel``), and what that makes of one weight.

A weight's state, as ``MemoryModel.weight_parts`` counts it, once per distinct weight (a shared one
once per stage holding it):

* the weight; for a trainable one its gradient (the weight's dtype) and the optimizer state: its
  state tensors (Adam and AdamW two moments, SGD with momentum one, SGD and none none) in the
  dtype of what it steps, as ``torch.optim`` keeps them (``zeros_like`` the parameter: 8 B a
  parameter for Adam on fp32 weights, 4 on bf16 ones), or ``optimizer_bytes_per_param`` per
  element when given; plus an fp32 master copy of a weight narrower than fp32 when
  ``master_weights`` (mixed precision), which the optimizer then steps, its state fp32;
* after the last backward, what the optimizer step allocates and frees again (``step_bytes``).

The microbatches a stage keeps in flight under each schedule (``MemoryModel.in_flight``,
``interleaved_in_flight``) are here too; ``costs.memory`` walks a stage's nodes under the model.

Under ``runtime.parallelize`` (``MemoryModel(data_parallel=..., dp=..., mixed_precision=...,
activation_checkpointing=...)``) the terms follow what FSDP2 and ``torch.distributed.pipelining``
do in torch 2.13, per rank:

* ``"fsdp"`` shards every parameter and its optimizer state over the ``dp`` ranks (``/ dp``;
  buffers stay whole). During a step it also holds each parameter unsharded, in the compute
  dtype: ``parallelize`` keeps units gathered after forward and the pipeline keeps them gathered
  after every backward but the last (``set_reshard_after_backward(False)``), so from a stage's
  first forward to its last backward the whole stage is gathered. Gradients accumulate unsharded
  over the microbatches (``set_requires_gradient_sync(False)``), in the reduce dtype
  (``FSDPParam.to_accumulated_grad_if_needed``); ``gathered_parts`` counts both copies. The
  sharded gradient appears only at the reduce-scatter after the last backward, one unit at a
  time as the copies are freed (``reduce_bytes``: the step's other candidate peak), and
  ``zero_grad`` frees it before the next step's peak, so it is not counted on top;
* ``"ddp"`` is ``replicate`` (FSDP2 over a shard group of one): the same terms with nothing
  divided, so a replica holds its weights twice during a step (``wait_for_unshard`` copies the
  "shard" into the all-gather buffer) and reduces into a new whole gradient at the step's end;
* ``mixed_precision`` (FSDP2's ``param_dtype``, gradients reduced in float32): the unsharded
  weights and each backward's fresh weight gradients take the compute dtype, the fp32 sharded
  weights are the optimizer's master copy, and floating activations shrink by compute / fp32;
* ``activation_checkpointing``: ``costs.recompute`` (a block keeps its inputs, not what it saves;
  in backward a block's recompute lives from the start of its backward to its end).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, keywords_named, plural, shown, suggest

OPTIMIZER_STATE_TENSORS: dict[str, int] = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0, "none": 0}
"""State tensors the optimizer keeps per parameter, each shaped and typed as what it steps."""

OPTIMIZER_BYTES: dict[str, float] = {name: 4.0 * count for name, count in OPTIMIZER_STATE_TENSORS.items()}
"""Optimizer state bytes per trainable element of an fp32 weight, by optimizer name."""

OPTIMIZER_STEP: dict[str, tuple[float, float, float]] = {
    "adam": (2.0, 1.0, 1.0), "adamw": (2.0, 1.0, 1.0), "sgd-momentum": (0.0, 0.0, 0.0), "sgd": (0.0, 0.0, 0.0),
    "none": (0.0, 0.0, 0.0)}
"""What one step of the optimizer allocates and frees again, as ``torch.optim`` (2.13) runs it with its
defaults, in multiples of the weights it steps: looping over them, (of the weight being stepped, of
the one stepped before it); foreach, of all it steps of one dtype at once. Adam's loop computes
``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``: a square root and a quotient of one
weight, while the previous weight's ``denom`` is still held; foreach, ``torch._foreach_sqrt`` of every
weight of one dtype, while the previous dtype's square roots are still held (``exp_avg_sq_sqrt`` is
not freed between groups). SGD, with momentum or without, updates in place."""

FOREACH_DEVICES = ("cuda", "xpu")
"""Where ``torch.optim`` steps every weight at once (foreach) unless told otherwise: it does so only
when all of them are on such devices (``torch.optim.optimizer._default_to_fused_or_foreach``)."""

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
"""The schedules whose microbatches in flight the model knows."""

UNMODELLED_SCHEDULES = ("; the runtime runs more of PyTorch's schedules (interleaved-zero-bubble, looped-bfs, ...), "
                        "whose memory and step time are not modelled: predict with the closest of these")
"""What a refusal of another schedule adds: ``runtime.SCHEDULES`` runs it, the cost models do not."""

INTERLEAVED_STAGES_PER_RANK = 2
"""``stages_per_rank`` under interleaved 1F1B when left out (every other schedule runs one)."""

DATA_PARALLEL = ("fsdp", "ddp")
"""The data-parallel kinds ``runtime.parallelize`` applies (None: pipelining alone)."""

COMPUTE_DTYPES: dict[str, int] = {"bfloat16": 2, "float16": 2}
"""Mixed-precision compute dtypes, with their bytes per element."""

_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}

_FP32 = 4


class Weight(Protocol):
    """What the model needs of a weight (``lowering.from_fx.WeightInfo`` has it)."""

    numel: int
    nbytes: int
    trainable: bool


def _device(info: Weight) -> str:
    """The device type the weight was on when planned (``lowering.from_fx.WeightInfo.device``); the
    CPU for one that does not say (a plan file from before it was recorded)."""
    return getattr(info, "device", "cpu")


def _two_largest(groups: Iterable[float]) -> float:
    """Foreach's most at once over its dtype groups: one group's temporaries beside the previous
    group's. ``torch.optim`` orders the groups by a hash map's order, not the weights', so the two
    largest: exact for one or two dtypes, the most it can be for more."""
    return sum(sorted(groups, reverse=True)[:2])


def is_parameter(info: Weight) -> bool:
    """FSDP shards parameters only; a buffer (``kind == "buffer"``) stays whole on every rank."""
    return getattr(info, "kind", "parameter") == "parameter"


def _compute_dtype(value: object) -> str | None:
    """``"bfloat16"``/``"float16"`` for any spelling of them (``torch.bfloat16`` included)."""
    if value is None:
        return None
    spelled = isinstance(value, str) or type(value).__name__ == "dtype"  # a name, or torch.bfloat16
    name = str(value).lower().removeprefix("torch.") if spelled else ""
    name = _DTYPE_NAMES.get(name, name)
    if name not in COMPUTE_DTYPES:
        error = InvalidArgumentError if spelled else InvalidArgumentTypeError  # 2.0, [..]: no name at all
        raise error(
            f"mixed_precision must name a compute dtype ({', '.join(COMPUTE_DTYPES)}, or torch.bfloat16) or be None, "
            f"got {shown(value)}")
    return name


def _choice(value: object, name: str, known: Sequence[str], alternative: str = "", note: str = "") -> str:
    """``value`` lowered, or a refusal with a "did you mean", as ``StepTimeModel`` and the CLI give;
    a value that is no name at all (None, 2.0) is a type error, as everywhere in the API."""
    if not isinstance(value, str):
        raise InvalidArgumentTypeError(f"{name} must be one of {', '.join(map(repr, known))}{alternative}, got "
                                       f"{shown(value)}")
    if value.lower() not in known:
        close = suggest(value.lower(), known)
        raise InvalidArgumentError(f"unknown {name} {value!r}{close}; known: {', '.join(known)}{note}")
    return value.lower()


def _count(value: object, name: str, allow_none: bool = True) -> None:
    """A count >= 1 (or None); the wrong type (2.0, True, a list) a type error, as ``whole_number``'s."""
    if value is None and allow_none:
        return
    alternative = " or None" if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentTypeError(f"{name} must be a whole number >= 1{alternative} (an int), got "
                                       f"{shown(value)}")
    if value < 1:
        raise InvalidArgumentError(f"{name} must be a whole number >= 1{alternative}, got {value!r}")


def stages_per_rank_of(schedule: str, given: int | None) -> int:
    """The stages each process runs under ``schedule`` (a known name, lower case): None is the
    schedule's own; only interleaved 1F1B runs more than one, so another schedule refuses more
    rather than count them for nothing (``MemoryModel`` and ``StepTimeModel`` alike)."""
    interleaved = schedule == "interleaved-1f1b"
    if given is None:
        return INTERLEAVED_STAGES_PER_RANK if interleaved else 1
    given = int(given) if isinstance(given, numbers.Integral) and not isinstance(given, bool) else given  # numpy's
    _count(given, "stages_per_rank")
    if given > 1 and not interleaved:
        raise InvalidArgumentError(
            f"stages_per_rank={given} is how many stages each process runs under schedule='interleaved-1f1b' "
            f"only; schedule {schedule!r} runs one per process: pass schedule='interleaved-1f1b', or leave "
            "stages_per_rank out")
    return given


@keywords_named
@dataclass(frozen=True)
class MemoryModel:
    """How training is run, as far as memory goes.

    ``optimizer`` names the optimizer (``OPTIMIZER_BYTES``); ``optimizer_bytes_per_param``, when
    given, overrides its state bytes per trainable element (None: its state tensors in the dtype it
    steps, ``state_bytes_per_element``). ``microbatches`` is the step's count
    (None: as many as the schedule keeps at most, ``k - j`` under 1F1B). ``schedule`` is one of
    ``SCHEDULES``; ``stages_per_rank`` is how many stages each process runs under interleaved
    1F1B (k must divide by it; None: ``INTERLEAVED_STAGES_PER_RANK``), and 1 under any other
    schedule, which refuses more. ``master_weights`` counts an fp32 copy of each trainable weight
    narrower than fp32 (bf16 or fp16 weights, the optimizer stepping in fp32). ``optimizer_foreach``
    says how the optimizer steps (``step_bytes``): every weight at once (True), one after another
    (False), or, None, as ``torch.optim`` chooses for the device the weights were on when planned
    (at once on a GPU, one after another on the CPU): a plan made on the CPU for GPUs passes True.
    ``keep_gradients``: the training loop keeps the gradients between steps
    (``zero_grad(set_to_none=False)``); by default ``zero_grad`` frees them, torch's default, so a
    stage's first backward of a step makes them (``makes_gradients``).

    The layout ``runtime.parallelize`` runs, per rank: ``data_parallel`` (``"fsdp"``, ``"ddp"`` or
    None) over ``dp`` ranks, ``mixed_precision`` (the compute dtype, ``"bfloat16"``; needs a
    data-parallel kind, as ``parallelize`` does) and ``activation_checkpointing``. The example
    inputs the plan is made with are one microbatch of one data-parallel rank.
    """

    optimizer_bytes_per_param: float | None = None
    microbatches: int | None = None
    optimizer: str = "adam"
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    master_weights: bool = False
    data_parallel: str | None = None
    dp: int = 1
    mixed_precision: str | None = None
    activation_checkpointing: bool = False
    optimizer_foreach: bool | None = None
    keep_gradients: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer", _choice(self.optimizer, "optimizer", tuple(OPTIMIZER_BYTES),
                                                      " (the name 'none' for no optimizer state)"))
        object.__setattr__(self, "schedule", _choice(self.schedule, "schedule", SCHEDULES, note=UNMODELLED_SCHEDULES))
        bytes_ = self.optimizer_bytes_per_param
        if bytes_ is not None and (isinstance(bytes_, bool) or not isinstance(bytes_, (int, float))
                                   or not 0 <= bytes_ < float("inf")):
            typed = not isinstance(bytes_, bool) and isinstance(bytes_, (int, float))
            alternative = "" if typed else " or None (the optimizer's own)"
            raise (InvalidArgumentError if typed else InvalidArgumentTypeError)(
                f"optimizer_bytes_per_param must be a number >= 0 (8 for Adam's two fp32 moments, 4 for SGD with "
                f"momentum, 0 for plain SGD){alternative}, got {shown(bytes_)}")
        _count(self.microbatches, "microbatches")
        object.__setattr__(self, "stages_per_rank", stages_per_rank_of(self.schedule, self.stages_per_rank))
        for flag in ("master_weights", "activation_checkpointing", "optimizer_foreach", "keep_gradients"):
            value = getattr(self, flag)
            if not isinstance(value, bool) and not (value is None and flag == "optimizer_foreach"):
                also = " or None (as torch.optim chooses for the device)" if flag == "optimizer_foreach" else ""
                raise InvalidArgumentTypeError(
                    f"{flag} must be True or False{also}, got {shown(value)}")
        self._check_layout()

    def _check_layout(self) -> None:
        """The data-parallel fields, refused as ``parallelize`` refuses them."""
        if self.data_parallel is not None:
            object.__setattr__(self, "data_parallel", _choice(self.data_parallel, "data_parallel", DATA_PARALLEL,
                                                              " or None"))
        _count(self.dp, "dp", allow_none=False)
        object.__setattr__(self, "mixed_precision", _compute_dtype(self.mixed_precision))
        if self.data_parallel is None and self.dp > 1:
            raise InvalidArgumentError(
                f"dp={self.dp} ranks need data_parallel='fsdp' or 'ddp' (with None the copies would train apart)")
        if self.mixed_precision is not None and self.data_parallel is None:
            raise InvalidArgumentError(
                "mixed_precision is FSDP2's policy, so it needs data_parallel='fsdp' or 'ddp' (dp may be 1), as "
                "parallelize does")

    def in_flight_rule(self, stage: str = "j") -> str:
        """``in_flight`` in words, for reports and plan files: ``k - j`` or ``min(k - j, cap)``."""
        if self.schedule == "gpipe":
            return "every microbatch" if self.microbatches is None else f"{self.microbatches}"
        if self.schedule == "interleaved-1f1b":
            return f"as ScheduleInterleaved1F1B orders {self.stages_per_rank} stages per rank"
        return f"k - {stage}" if self.microbatches is None else f"min(k - {stage}, {self.microbatches})"

    def layout(self) -> str:
        """The data-parallel layout in words ("" for pipelining alone)."""
        parts = []
        if self.data_parallel is not None:
            parts.append(f"{self.data_parallel} over dp={self.dp}")
        if self.mixed_precision is not None:
            parts.append(f"{self.mixed_precision} compute")
        if self.activation_checkpointing:
            parts.append("activation checkpointing")
        return ", ".join(parts)

    def describe(self) -> str:
        """What the model assumes, in words, for reports."""
        master = ", fp32 master weights" if self.master_weights else ""
        shard = f" / {self.dp}" if self.data_parallel == "fsdp" and self.dp > 1 else ""
        gathered = " + unsharded weights and gradients during the step" if self.data_parallel else ""
        layout = f"; {self.layout()}" if self.layout() else ""
        tensors = plural(OPTIMIZER_STATE_TENSORS[self.optimizer], "tensor")
        per_param = (f"{self.optimizer_bytes_per_param:g} B per parameter" if self.optimizer_bytes_per_param is not None
                     else f"{tensors} a parameter in the dtype it steps")
        return (f"(weights + gradients + {self.optimizer} state ({per_param}"
                f"{master})){shard}{gathered} + the larger of: kept activations x microbatches in flight (saved "
                f"for backward, received and sent values; stage j of k: {self.in_flight_rule()}, {self.schedule}) + "
                f"one backward + receive buffers of every microbatch of the step; or, after the last backward, every "
                f"receive buffer + the tied-gradient sum or the {self.optimizer} step ({self._stepping()}){layout}")

    def _stepping(self) -> str:
        if self.optimizer_foreach is None:
            return "foreach on a GPU"
        return "foreach" if self.optimizer_foreach else "one weight at a time"

    def as_call(self) -> str:
        """``MemoryModel(optimizer='sgd', microbatches=8)``: the fields that differ from the
        default, so an error can say what to run again."""
        # its optimizer's own state bytes and its schedule's own stages per rank are no change
        base = MemoryModel(optimizer=self.optimizer, schedule=self.schedule)
        given = {"optimizer": self.optimizer} if self.optimizer != MemoryModel.optimizer else {}
        given.update((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                     if getattr(self, f.name) != getattr(base, f.name)
                     or f.name == "schedule" and self.schedule != MemoryModel.schedule)
        return f"MemoryModel({', '.join(f'{name}={value!r}' for name, value in given.items())})"

    def to_dict(self) -> dict[str, float | int | str | bool | None]:
        return {"optimizer_bytes_per_param": self.optimizer_bytes_per_param, "microbatches": self.microbatches,
                "optimizer": self.optimizer, "schedule": self.schedule, "stages_per_rank": self.stages_per_rank,
                "master_weights": self.master_weights, "data_parallel": self.data_parallel, "dp": self.dp,
                "mixed_precision": self.mixed_precision, "activation_checkpointing": self.activation_checkpointing,
                "optimizer_foreach": self.optimizer_foreach, "keep_gradients": self.keep_gradients}

    def in_flight(self, stage: int, num_stages: int) -> int:
        """Microbatches whose activations stage ``stage`` keeps at once under the schedule."""
        if self.schedule == "gpipe":
            return num_stages if self.microbatches is None else self.microbatches
        if self.schedule == "interleaved-1f1b":
            return interleaved_in_flight(num_stages, self.stages_per_rank, self.microbatches)[stage]
        count = num_stages - stage
        return count if self.microbatches is None else min(count, self.microbatches)

    def forwards_first(self, stage: int, num_stages: int) -> bool:
        """Whether every forward of stage ``stage``'s step runs before its first backward, which then
        meets every microbatch in flight: GPipe, and 1F1B on a stage keeping all the step's microbatches."""
        if self.schedule == "gpipe":
            return True
        return self.schedule == "1f1b" and self.step_microbatches(num_stages) <= num_stages - stage

    def makes_gradients(self, stage: int, num_stages: int) -> bool:
        """Whether stage ``stage``'s first backward of a step meets no gradient of its weights
        (``zero_grad`` freed them) and makes them, with every microbatch in flight (``forwards_first``).
        Under interleaved 1F1B and data parallelism the gradients are counted as held (more, not less)."""
        return not self.keep_gradients and self.data_parallel is None and self.forwards_first(stage, num_stages)

    def sends_held(self, stage: int, num_stages: int) -> int:
        """Under ``forwards_first``, how many of the earlier backwards' sent-back gradients the
        schedule holds at most while a backward runs: torch's GPipe keeps every backward's sends
        until its last backward has run; ``Schedule1F1B`` the previous one's (its ``bwd_sends``)."""
        if self.schedule == "gpipe":
            return self.in_flight(stage, num_stages) - 1
        return 1

    def refills(self, stage: int, num_stages: int) -> bool:
        """Whether a forward follows stage ``stage``'s first backward (1F1B's steady state), while
        torch's ``Schedule1F1B`` still holds the gradients that backward sent back (its ``bwd_sends``,
        until the next backward has run)."""
        return self.schedule == "1f1b" and self.step_microbatches(num_stages) > num_stages - stage

    def holds_warmup_send(self, stage: int, num_stages: int) -> bool:
        """Whether, in 1F1B's steady state, stage ``stage`` still holds what it sent for a microbatch
        it has back-propagated: ``Schedule1F1B``'s warm-up keeps the last send it fired (its
        ``send_work``: microbatch ``k - j - 2``'s outputs) until the cool-down, past that
        microbatch's backward, the steady state's ``k - j - 1``-th (of ``m - (k - j) + 1``)."""
        warmup = num_stages - stage
        return (self.refills(stage, num_stages) and stage < num_stages - 1
                and self.step_microbatches(num_stages) >= 2 * warmup - 1)

    def step_microbatches(self, num_stages: int) -> int:
        """The step's microbatches: ``microbatches``, or when None the fewest that fill the pipeline
        (one per stage; under interleaved 1F1B one per rank)."""
        if self.microbatches is not None:
            return self.microbatches
        return num_stages // self.stages_per_rank if self.schedule == "interleaved-1f1b" else num_stages

    def all_in_flight(self, num_stages: int) -> tuple[int, ...]:
        """``in_flight`` of every stage, stage 0 first."""
        return tuple(self.in_flight(j, num_stages) for j in range(num_stages))

    @property
    def shards(self) -> int:
        """Ranks one weight's state is split over: ``dp`` under FSDP, else 1."""
        return self.dp if self.data_parallel == "fsdp" else 1

    def compute_bytes(self, info: Weight) -> float:
        """Bytes per element a weight is computed in: the mixed-precision dtype's, else its own."""
        own = info.nbytes / info.numel if info.numel else 0.0
        return float(COMPUTE_DTYPES[self.mixed_precision]) if self.mixed_precision and is_parameter(info) else own

    def gathered_parts(self, info: Weight) -> tuple[float, float]:
        """(unsharded weight, unsharded gradient) bytes data parallelism holds during a step (module
        docstring): the weight in the compute dtype, the gradient accumulated in float32 under mixed
        precision (FSDP2 upcasts it to the reduce dtype after each backward), else in the weight's dtype."""
        if self.data_parallel is None or not is_parameter(info):
            return 0.0, 0.0
        weight = info.numel * self.compute_bytes(info)
        if not info.trainable:
            return weight, 0.0
        return weight, float(info.numel * _FP32 if self.mixed_precision else info.nbytes)

    def weight_parts(self, info: Weight) -> tuple[float, float, float]:
        """(weight, gradient, optimizer state with any master copy) bytes of one weight on one rank
        at its peak. Under data parallelism: its shards plus the unsharded copies of a step
        (``gathered_parts``); the gradient is the unsharded accumulation alone, since the sharded
        one exists only from the reduce-scatter after the last backward (the copies freed by then)
        until ``zero_grad``."""
        master = info.numel * _FP32 if self._master_copy(info) else 0
        optimizer = info.numel * self.state_bytes_per_element(info) + master if info.trainable else 0.0
        if self.data_parallel is None:
            return float(info.nbytes), float(info.nbytes if info.trainable else 0), float(optimizer)
        share = self.shards if is_parameter(info) else 1
        gathered_weight, gathered_grad = self.gathered_parts(info)
        return info.nbytes / share + gathered_weight, gathered_grad, optimizer / share

    def storage_bytes(self, held: Iterable[Weight]) -> float:
        """What the stage's weights hold beyond their own bytes: a storage several of them view, or one
        larger than the weight viewing it (``WeightInfo.storage``), is held whole, once."""
        return sum(float(getattr(group[0], "storage_bytes", 0)) - sum(info.nbytes for info in group)
                   for group in self._by_storage(held))

    def storage_shares(self, infos: Iterable[Weight]) -> dict[int, float]:
        """By ``id``, the even share of its storage of each weight ``storage_bytes`` counts by storage: a
        stage holding any of them holds at least its share, and all of their shares sum to the storage
        (a stride-0 buffer's own bytes may be thousands of times its storage)."""
        return {id(info): float(getattr(info, "storage_bytes", 0)) / len(group)
                for group in self._by_storage(infos) for info in group}

    def _by_storage(self, infos: Iterable[Weight]) -> list[list[Weight]]:
        """The distinct weights that view a storage counted whole, grouped by it. FSDP copies parameters
        into shards of its own, so there only buffers."""
        groups: dict[str, dict[int, Weight]] = {}
        for info in infos:
            storage = getattr(info, "storage", None)
            if storage is not None and (self.data_parallel != "fsdp" or not is_parameter(info)):
                groups.setdefault(storage, {})[id(info)] = info
        return [list(group.values()) for group in groups.values()]

    def state_bytes_per_element(self, info: Weight) -> float:
        """The optimizer's state bytes per element of a trainable weight: ``optimizer_bytes_per_param``
        when given, else its state tensors in the dtype of what it steps (``torch.optim`` makes them
        ``zeros_like`` the parameter): the fp32 master copy's where ``master_weights`` keeps one, else
        the weight's own (``stepped_bytes``)."""
        if self.optimizer_bytes_per_param is not None:
            return float(self.optimizer_bytes_per_param)
        return OPTIMIZER_STATE_TENSORS[self.optimizer] * self._stepped_width(info)

    def _master_copy(self, info: Weight) -> bool:
        """Whether the optimizer steps an fp32 copy of the weight: ``master_weights``, and narrower than fp32."""
        return self.master_weights and info.nbytes < info.numel * _FP32

    def _stepped_width(self, info: Weight) -> float:
        """Bytes per element of what the optimizer steps for the weight: its fp32 master copy, or itself."""
        if self._master_copy(info):
            return float(_FP32)
        return info.nbytes / info.numel if info.numel else 0.0

    def fresh_gradient_bytes(self, info: Weight) -> float:
        """Bytes of the compute-dtype gradient one backward makes of a weight under mixed precision,
        alive until FSDP2 adds it to the float32 accumulation (0 otherwise: autograd accumulates
        into the existing gradient)."""
        if self.mixed_precision is None or not info.trainable or not is_parameter(info):
            return 0.0
        return info.numel * self.compute_bytes(info)

    def reduce_bytes(self, units: Sequence[Sequence[Weight]]) -> float:
        """The most the gradient reduction after a stage's last backward adds to its weight state,
        over FSDP's units (``runtime.blocks``: whole blocks, and the rest of the stage): the unit's
        weights are freed first (reshard), then ``foreach_reduce`` allocates an input of its whole
        gradient in the reduce dtype and an output of 1/dp of it, and gloo's reduce-scatter stages
        one more whole copy (measured on CPU; NCCL reduces in place, so on GPUs this over-counts by
        one unit's gradient). ``replicate`` reduces over a group of one: no staging copy."""
        if self.data_parallel is None:
            return 0.0
        most = 0.0
        for unit in units:
            weights, grads = (sum(p[i] for p in map(self.gathered_parts, unit)) for i in range(2))
            staged = grads if self.shards > 1 else 0.0
            most = max(most, grads + grads / self.shards + staged - weights)
        return most

    def stepped_bytes(self, info: Weight) -> float:
        """Bytes of the tensor the optimizer steps for a trainable weight on one rank: its fp32 master
        copy where ``master_weights`` keeps one, else the weight (FSDP's shard of it)."""
        if not info.trainable:
            return 0.0
        return info.numel * self._stepped_width(info) / (self.shards if is_parameter(info) else 1)

    def step_bytes(self, infos: Sequence[Weight]) -> float:
        """The most one optimizer step over ``infos`` (a stage's weights, in the order it steps them)
        allocates and frees again (``OPTIMIZER_STEP``): looping, of one tensor and the one before; foreach, of all it
        steps of one dtype and of the dtype stepped before it (``optimizer_foreach``; None: foreach when every
        weight was on a ``FOREACH_DEVICES`` device). Non-default settings (Adam's ``weight_decay``, ``amsgrad``)
        add more, not counted; ``optimizer_bytes_per_param`` changes the state, not this."""
        trainable = [info for info in infos if info.trainable]
        current, previous, at_once = OPTIMIZER_STEP[self.optimizer]
        foreach = self.optimizer_foreach
        if foreach is None:
            foreach = bool(trainable) and all(_device(info) in FOREACH_DEVICES for info in trainable)
        if not foreach:  # in the order given, the order the stage's parameters are stepped
            stepped = [0.0, *map(self.stepped_bytes, trainable)]
            return max((current * b + previous * a for a, b in zip(stepped, stepped[1:])), default=0.0)
        by_dtype: dict[float, float] = {}  # keyed by bytes per element, which tells the dtypes apart here
        for info in trainable:
            width = self._stepped_width(info)
            by_dtype[width] = by_dtype.get(width, 0.0) + self.stepped_bytes(info)
        return at_once * _two_largest(by_dtype.values())

    def reduced_bytes(self, infos: Sequence[Weight]) -> float:
        """What data parallelism holds after its reduction against its peak state (<= 0): the unsharded
        weights and gradients freed, the reduced gradient's shard made (0 for pipelining alone)."""
        if self.data_parallel is None:
            return 0.0
        gathered = [self.gathered_parts(info) for info in infos]
        return sum(grad / self.shards - weight - grad for weight, grad in gathered)

    def activation_scale(self, infos: Sequence[Weight]) -> float:
        """What floating activations shrink by under mixed precision: the compute dtype's bytes over
        the widest parameter's (the model's own dtype, whose values the probe measured)."""
        widest = max((i.nbytes / i.numel for i in infos if i.numel and is_parameter(i)), default=0.0)
        if self.mixed_precision is None or not widest:
            return 1.0
        return min(1.0, COMPUTE_DTYPES[self.mixed_precision] / widest)

    def state_bytes(self, info: Weight) -> float:
        """Weight + gradient + optimizer state of one weight."""
        return sum(self.weight_parts(info))


def interleaved_in_flight(num_stages: int, stages_per_rank: int, microbatches: int | None) -> tuple[int, ...]:
    """Per stage, the most microbatches it has run forward and not yet backward under PyTorch's
    ``ScheduleInterleaved1F1B`` (stage s on rank s mod ranks). Its op order is re-derived here
    (warm-up forwards, then one forward and one backward per step, then the cool-down backwards,
    ``microbatches_per_round`` at a time per local stage), not imported, so the model stays
    torch-free; ``tests/test_costs_memory_model.py`` checks it against torch's own order."""
    if num_stages % stages_per_rank:
        raise InvalidArgumentError(
            f"interleaved 1F1B runs {stages_per_rank} stages per rank, so the number of stages must divide by it; "
            f"got {num_stages} stages: pick stages_per_rank dividing {num_stages}")
    ranks, local = num_stages // stages_per_rank, stages_per_rank
    count = ranks if microbatches is None else microbatches
    rounds = max(1, count // ranks)
    if count % rounds:
        raise InvalidArgumentError(
            f"interleaved 1F1B needs the microbatches to divide into rounds of {ranks} (the ranks); "
            f"{count} microbatches make {rounds} rounds with some left over: pick a multiple of {rounds}")
    per_round = count // rounds
    held = [0] * num_stages
    for rank in range(ranks):
        warmup = min((local - 1) * per_round + 2 * (ranks - 1 - rank), count * local)
        total = count * local
        alive = [0] * local
        for op in range(total):
            alive[(op // per_round) % local] += 1
            for i, n in enumerate(alive):
                held[i * ranks + rank] = max(held[i * ranks + rank], n)
            if op >= warmup:
                alive[local - 1 - ((op - warmup) // per_round) % local] -= 1
    return tuple(held)
