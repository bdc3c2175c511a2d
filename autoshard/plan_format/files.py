"""Plan files: JSON a person can read, edit and diff, checked on every read.

Every complaint names the file and the place in it. A plan is checked against the splitter's
invariants when it is read, so a hand edit that leaves a stage empty or sends a value backward is
rejected with the rule it breaks. The ``modules`` section summarises the nodes: editing it is not a
second way to move them (an entry edited on unmoved nodes is an error), and once nodes are moved
the entries they make stale are ignored.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from autoshard.capture.result import WrappedLeaf
from autoshard.costs.estimate import DeviceModel
from autoshard.costs.memory import SavedFacts
from autoshard.costs.memory_model import MemoryModel
from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, PlanError
from autoshard.graph import SplitInfo, check_dag, check_partition
from autoshard.lowering.from_fx import WeightInfo
from autoshard.plan_format.model import FORMAT, FORMAT_VERSION, PlanNode, SavedPlan, SplitRecord, optional_float
from autoshard.sharded import ShardedModel


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "), ensure_ascii=False)


def format_plan(data: Mapping[str, Any]) -> str:
    """JSON with one line per node, edge, module, weight and boundary: easy to read, edit and diff."""
    lines = []
    for key, value in data.items():
        if isinstance(value, dict) and value and key in ("modules", "weights"):
            items = [f"  {_compact(k)}: {_compact(v)}" for k, v in value.items()]
        elif isinstance(value, list) and value and not isinstance(value[0], (int, float)):
            items = [f"  {_compact(v)}" for v in value]
        else:
            lines.append(f" {_compact(key)}: {_compact(value)}")
            continue
        opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
        lines.append(f" {_compact(key)}: {opening}\n" + ",\n".join(items) + f"\n {closing}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def save_plan(plan: SavedPlan | ShardedModel, path: str | os.PathLike[str]) -> Path:
    """Write ``plan`` as JSON (deterministic: the same plan gives the same bytes). A ``ShardedModel``
    writes its own plan (``ShardedModel.save_plan``): the file the CLI's ``--out`` writes."""
    if isinstance(plan, ShardedModel):
        return plan.save_plan(path)
    if not isinstance(plan, SavedPlan):
        raise InvalidArgumentTypeError(
            f"save_plan writes the plan of a ShardedModel (autoshard.shard_model) or a SavedPlan, got "
            f"{type(plan).__name__}")
    target = Path(path)
    try:
        target.write_text(format_plan(plan.to_dict()), encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"cannot write the plan to {str(target)!r}: {exc.strerror or exc}") from exc
    return target


class _Reader:
    """Typed access to the parsed JSON; every complaint names the file and the place in it."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, where: str, problem: str) -> PlanError:
        return PlanError(f"plan {self.source}: {where} {problem}")

    def get(self, obj: Any, key: str, kinds: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
        if not isinstance(obj, dict):
            raise self.error(where, f"must be a JSON object, got {type(obj).__name__}")
        if key not in obj:
            if default is not ...:
                return default
            raise self.error(where, f"has no {key!r}")
        value = obj[key]
        if value is None and default is None:
            return None  # an optional entry written as null
        numeric = kinds in (int, float, (int, float))
        if not isinstance(value, kinds) or (numeric and isinstance(value, bool)):
            names = " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
            raise self.error(f"{where}.{key}", f"must be {names}, got {value!r}")
        if numeric and not math.isfinite(value):
            raise self.error(f"{where}.{key}", f"must be finite, got {value!r}")
        return value

    def node(self, obj: Any, i: int) -> PlanNode:
        where = f"nodes[{i}]"
        number = (int, float)
        costs = self.get(obj, "costs", dict, where)
        for model, cost in costs.items():
            self.get(costs, model, number, f"{where}.costs")
        return PlanNode(
            name=self.get(obj, "name", str, where), stage=self.get(obj, "stage", int, where),
            op=self.get(obj, "op", str, where, ""), target=self.get(obj, "target", str, where, ""),
            module=self.get(obj, "module", str, where, ""), costs=dict(costs),
            bytes=float(self.get(obj, "bytes", number, where)),
            param_bytes=float(self.get(obj, "param_bytes", number, where, 0)),
            input=self.get(obj, "input", bool, where, False), output=self.get(obj, "output", bool, where, False),
            value=self.get(obj, "value", dict, where, None),
            weights=self.names(self.get(obj, "weights", list, where, []), f"{where}.weights"),
            allocated=optional_float(self.get(obj, "allocated", number, where, None)),
            training=self.training(self.get(obj, "training", dict, where, None), f"{where}.training"),
            readers=self.names(self.get(obj, "readers", list, where, []), f"{where}.readers"),
        )

    def training(self, obj: Any, where: str) -> SavedFacts | None:
        """A node's ``costs.saved`` facts; absent in plans written before they were recorded."""
        if obj is None:
            return None
        releases = self.get(obj, "releases", list, where, [])
        if not all(isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and isinstance(r[1], int)
                   for r in releases):
            raise self.error(f"{where}.releases", "must be a list of [node name, bytes] pairs")
        grads = self.get(obj, "input_grads", list, where, None)
        if grads is not None and not all(isinstance(g, list) and len(g) == 2 and isinstance(g[0], str)
                                         and isinstance(g[1], bool) for g in grads):
            raise self.error(f"{where}.input_grads", "must be a list of [node name, true or false] pairs")
        return SavedFacts(*(self.get(obj, key, int, where) for key in ("saved", "saved_output", "grad", "backward")),
                          tuple((name, nbytes) for name, nbytes in releases), self.get(obj, "views", str, where, None),
                          None if grads is None else tuple((name, handed) for name, handed in grads),
                          self.get(obj, "backward_when_sent", int, where, None),
                          self.get(obj, "forward", int, where, None),
                          tuple(self.names(self.get(obj, "strided_grads", list, where, []), f"{where}.strided_grads")),
                          self.get(obj, "strided_output", bool, where, False),
                          self.when_contiguous(self.get(obj, "when_contiguous", list, where, None),
                                               f"{where}.when_contiguous"),
                          self.dense_order(self.get(obj, "dense_order", list, where, None), f"{where}.dense_order"),
                          self.optional_names(self.get(obj, "weight_grads", list, where, None),
                                              f"{where}.weight_grads"),
                          self.names(self.get(obj, "holds", list, where, []), f"{where}.holds"),
                          self.get(obj, "weights_first", bool, where, False),
                          self.optional_names(self.get(obj, "saves_from", list, where, None), f"{where}.saves_from"),
                          self.get(obj, "gradients_kept", int, where, 0),
                          self.get(obj, "gradient_copies", int, where, 0),
                          self.names(self.get(obj, "writes", list, where, []), f"{where}.writes"),
                          self.get(obj, "backward_alone", int, where, None),
                          self.handed(self.get(obj, "backward_when_handed", list, where, []),
                                      f"{where}.backward_when_handed"),
                          self.names(self.get(obj, "passes_on", list, where, []), f"{where}.passes_on"),
                          self.optional_names(self.get(obj, "strided_when_sent", list, where, None),
                                              f"{where}.strided_when_sent"),
                          self.parts(self.get(obj, "parts", list, where, []), f"{where}.parts"),
                          self.part(self.get(obj, "part", list, where, None), f"{where}.part"))

    def handed(self, obj: list, where: str) -> tuple[tuple[tuple[int, ...], int], ...]:
        """``SavedFacts.backward_when_handed``: [order of dimensions, bytes] pairs."""
        if not all(isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], list)
                   and all(isinstance(d, int) and not isinstance(d, bool) for d in pair[0])
                   and isinstance(pair[1], int) and not isinstance(pair[1], bool) for pair in obj):
            raise self.error(where, "must be a list of [[dimension, ...], bytes] pairs")
        return tuple((tuple(order), nbytes) for order, nbytes in obj)

    def parts(self, obj: list, where: str) -> tuple[tuple[int, int], ...]:
        """``SavedFacts.parts``: [bytes, saved bytes] pairs."""
        if not all(isinstance(pair, list) and len(pair) == 2
                   and all(isinstance(x, int) and not isinstance(x, bool) for x in pair) for pair in obj):
            raise self.error(where, "must be a list of [bytes, saved bytes] pairs")
        return tuple((nbytes, saved) for nbytes, saved in obj)

    def part(self, obj: list | None, where: str) -> tuple[int, ...] | None:
        """``SavedFacts.part``: indices into the maker's ``parts``, or absent."""
        if obj is None:
            return None
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in obj):
            raise self.error(where, "must be a list of storage indices, as [1]")
        return tuple(obj)

    def dense_order(self, obj: list | None, where: str) -> tuple[int, ...] | None:
        """``SavedFacts.dense_order``: a permutation of the dimensions, or absent."""
        if obj is None:
            return None
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in obj) or sorted(obj) != list(range(len(obj))):
            raise self.error(where, "must be a permutation of the dimensions, as [1, 0, 2]")
        return tuple(obj)

    def when_contiguous(self, obj: list | None, where: str) -> tuple[int, int, int, tuple[str, ...]] | None:
        """``SavedFacts.when_contiguous``: [saved change, forward, backward, [node names]] or absent."""
        if obj is None:
            return None
        if len(obj) != 4 or not all(isinstance(x, int) and not isinstance(x, bool) for x in obj[:3]) \
                or not isinstance(obj[3], list):
            raise self.error(where, "must be [bytes, bytes, bytes, [node names]]")
        return obj[0], obj[1], obj[2], self.names(obj[3], f"{where}[3]")

    def names(self, items: list, where: str) -> tuple[str, ...]:
        bad = next((x for x in items if not isinstance(x, str)), None)
        if bad is not None:
            raise self.error(where, f"must list names (strings), got {bad!r}")
        return tuple(items)

    def optional_names(self, items: list | None, where: str) -> tuple[str, ...] | None:
        return None if items is None else self.names(items, where)

    def weight(self, name: str, obj: Any) -> WeightInfo:
        where = f"weights[{name!r}]"
        aliases = self.names(self.get(obj, "aliases", list, where, [name]), f"{where}.aliases")
        return WeightInfo(aliases, self.get(obj, "numel", int, where), self.get(obj, "bytes", int, where),
                          self.get(obj, "kind", str, where, "parameter"), self.get(obj, "trainable", bool, where),
                          self.get(obj, "device", str, where, "cpu"), self.get(obj, "storage", str, where, None),
                          self.get(obj, "storage_bytes", int, where, 0))

    def time_estimate(self, obj: Any) -> DeviceModel | None:
        where = "time_estimate"
        if obj is None:
            return None
        if self.get(obj, "model", str, where) != "roofline":
            raise self.error(f"{where}.model", "must be \"roofline\" (the only device model this autoshard knows)")
        try:
            return DeviceModel(self.get(obj, "peak_flops", (int, float), where),
                               self.get(obj, "bandwidth", (int, float), where),
                               self.get(obj, "calibrated", bool, where, False))
        except InvalidArgumentError as exc:
            raise self.error(where, str(exc)) from None

    def memory_model(self, obj: Any) -> MemoryModel:
        """Absent in plans written before it was recorded: those were all made for the default."""
        where = "memory_model"
        if obj is None:
            return MemoryModel()
        schedule = self.get(obj, "schedule", str, where, "1f1b")
        try:
            return MemoryModel(self.get(obj, "optimizer_bytes_per_param", (int, float), where, None),
                               self.get(obj, "microbatches", int, where, None),
                               self.get(obj, "optimizer", str, where, "adam"),
                               schedule,
                               self._stages_per_rank(obj, schedule, where),
                               self.get(obj, "master_weights", bool, where, False),
                               self.get(obj, "data_parallel", str, where, None),
                               self.get(obj, "dp", int, where, 1),
                               self.get(obj, "mixed_precision", str, where, None),
                               self.get(obj, "activation_checkpointing", bool, where, False),
                               self.get(obj, "optimizer_foreach", bool, where, None),
                               self.get(obj, "keep_gradients", bool, where, False))
        except InvalidArgumentError as exc:
            raise self.error(where, str(exc)) from None

    def _stages_per_rank(self, obj: Any, schedule: str, where: str) -> int | None:
        """The saved stages per rank under interleaved 1F1B; under another schedule the schedule's own
        one, since plans written before it was refused there saved 2, which counted for nothing."""
        saved = self.get(obj, "stages_per_rank", int, where, None)
        return saved if schedule.lower() == "interleaved-1f1b" else None

    def split(self, obj: Any) -> SplitRecord | None:
        where = "split"
        if obj is None:
            return None
        number = (int, float)
        proven = self.get(obj, "proven_optimal", bool, where, None)
        info = SplitInfo(
            strategy=self.get(obj, "strategy", str, where),
            bound=optional_float(self.get(obj, "bound", number, where, None)),
            bottleneck=float(self.get(obj, "bottleneck", number, where)),
            boundary_bytes=float(self.get(obj, "boundary_bytes", number, where)),
            proven_optimal=proven,
            separated=self.names(self.get(obj, "separated", list, where, []), f"{where}.separated"),
            tolerance=optional_float(self.get(obj, "tolerance", number, where, None)),
        )
        return SplitRecord(info, self.get(obj, "assignment_digest", str, where))

    def edge(self, obj: Any, i: int) -> tuple[str, str]:
        if not (isinstance(obj, list) and len(obj) == 2 and all(isinstance(x, str) for x in obj)):
            raise self.error(f"edges[{i}]", f"must be a [producer, consumer] pair of node names, got {obj!r}")
        return obj[0], obj[1]

    def wrapped(self, obj: Any, i: int) -> WrappedLeaf:
        where = f"wrapped[{i}]"
        return WrappedLeaf(self.get(obj, "kind", str, where), self.get(obj, "name", str, where),
                           self.get(obj, "reason", str, where))


def plan_from_dict(data: Any, source: str = "<dict>") -> SavedPlan:
    """Parse and check a plan's JSON content; ``PlanError`` says what is wrong and where."""
    r = _Reader(source)
    if r.get(data, "format", str, "the file", None) != FORMAT:
        raise r.error("the file", f"is not an autoshard plan (no \"format\": \"{FORMAT}\")")
    version = r.get(data, "format_version", int, "the file")
    if version != FORMAT_VERSION:
        raise r.error("format_version", f"is {version}; this autoshard reads version {FORMAT_VERSION}, whose graphs "
                      "differ: make a new plan with `autoshard split TARGET --stages K --out PLAN.json`")
    nodes = tuple(r.node(obj, i) for i, obj in enumerate(r.get(data, "nodes", list, "the file")))
    plan = SavedPlan(
        num_stages=r.get(data, "num_stages", int, "the file"),
        cost_model=r.get(data, "cost_model", str, "the file"),
        pipeline=r.get(data, "pipeline", str, "the file"),
        model=r.get(data, "model", str, "the file", ""),
        versions={str(k): str(v) for k, v in r.get(data, "versions", dict, "the file", {}).items()},
        nodes=nodes,
        edges=tuple(r.edge(obj, i) for i, obj in enumerate(r.get(data, "edges", list, "the file"))),
        wrapped=tuple(r.wrapped(obj, i) for i, obj in enumerate(r.get(data, "wrapped", list, "the file", []))),
        weights={str(name): r.weight(name, obj) for name, obj in r.get(data, "weights", dict, "the file", {}).items()},
        time_estimate=r.time_estimate(r.get(data, "time_estimate", dict, "the file", None)),
        time_backward=r.get(data, "time_backward", bool, "the file", None),
        split=r.split(r.get(data, "split", dict, "the file", None)),
        memory_model=r.memory_model(r.get(data, "memory_model", dict, "the file", None)),
    )
    _check_consistent(plan, r)
    _check_modules(plan, r.get(data, "modules", dict, "the file", None), r)
    return plan


def _check_consistent(plan: SavedPlan, r: _Reader) -> None:
    names = [n.name for n in plan.nodes]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise r.error("nodes", f"list {duplicate!r} twice; each node appears once")
    missing_cost = next((n.name for n in plan.nodes if plan.cost_model not in n.costs), None)
    if missing_cost is not None:
        raise r.error(f"node {missing_cost!r}", f"has no cost under the plan's cost model {plan.cost_model!r}")
    if plan.weights:
        unknown = next(((n.name, w) for n in plan.nodes for w in n.weights if w not in plan.weights), None)
        if unknown is not None:
            raise r.error(f"node {unknown[0]!r}", f"reads the weight {unknown[1]!r}, which is not in `weights`")
    known = set(names)
    for i, (u, v) in enumerate(plan.edges):
        if u not in known or v not in known:
            raise r.error(f"edges[{i}]", f"names {u if u not in known else v!r}, which is not in nodes")
    unread = next(((n.name, m) for n in plan.nodes for m in n.readers if m not in known), None)
    if unread is not None:
        raise r.error(f"node {unread[0]!r}", f"names the reader {unread[1]!r}, which is not in nodes")
    try:
        dag = plan.graph()
        check_dag(dag)
        check_partition(dag, plan.assignment(), plan.num_stages)
    except InvalidArgumentError as exc:
        raise r.error(
            "breaks an invariant:", f"{exc}. Edit the nodes' \"stage\" so that every stage "
            f"0..{plan.num_stages - 1} runs a node and no value flows to an earlier stage",
        ) from None


def _check_modules(plan: SavedPlan, written: dict | None, r: _Reader) -> None:
    """The ``modules`` section is derived from the nodes, so a person moves stages by editing the nodes'
    ``"stage"`` fields alone. Once nodes have moved (their assignment no longer matches the split
    record's digest), the entries written before the edit are stale and ignored: the file is rewritten
    from the nodes. Where the nodes are as the splitter left them, an entry that disagrees is an edit in
    the wrong place, which would move nothing: refused. A plan without a split record cannot tell the two
    apart, so it asks for the entry to be updated or deleted."""
    if written is None or (plan.split is not None and not plan.split_is_current):
        return
    derived = plan.module_stages()
    for path, stage in written.items():
        if path in derived and derived[path] != stage:
            then = ("" if plan.split is not None else
                    ", and update or delete this `modules` entry (this plan has no `split` record that would "
                    "tell a stale entry from an edit)")
            raise r.error(
                f"modules[{path!r}]", f"says {stage!r} but its nodes are in {derived[path]!r}. `modules` "
                "summarises `nodes` and moves nothing: move a module by editing the \"stage\" of its nodes "
                f"(their \"module\" starts with it){then}",
            )


def read_plan(path: str | Path) -> SavedPlan:
    """Read and check a plan file (``PlanError`` on any problem, naming the place in the file)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentTypeError(f"a plan path must be a str or a path, got {type(path).__name__}")
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"cannot read the plan {source!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise PlanError(f"plan {source} is not a text (JSON) file: byte {exc.start} is not UTF-8") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"plan {source} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from exc
    return plan_from_dict(data, source)
