"""The plan as data: nodes with their stage, module and costs, and the views derived from them.

The ``stage`` of each node is what a plan *is*; boundaries, stage costs and the module summary
are computed from the nodes with the splitter's own functions, so they always agree with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

import networkx as nx

from autoshard.capture import WrappedLeaf
from autoshard.graph import bottleneck, boundary_bytes, boundary_values, stage_costs, total_boundary_bytes

FORMAT = "autoshard-plan"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class PlanNode:
    """One DAG node: where it runs, what it belongs to and what it costs under each cost model."""

    name: str
    stage: int
    op: str
    target: str
    module: str
    costs: Mapping[str, float]
    bytes: float
    param_bytes: float
    input: bool = False
    output: bool = False
    value: Mapping[str, Any] | None = None
    """The output's structure as ``shape-prop`` measured it (``ValueMeta.to_dict()``); None if unknown."""


def module_ancestors(path: str) -> list[str]:
    """``'a.b.c'`` -> ``['a', 'a.b', 'a.b.c']``; the root module ``''`` has none."""
    parts = path.split(".") if path else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


@dataclass(frozen=True)
class SavedPlan:
    """A split of one model's graph into ``num_stages`` stages, and how it was made."""

    num_stages: int
    cost_model: str
    pipeline: str
    model: str
    versions: Mapping[str, str]
    nodes: tuple[PlanNode, ...]
    edges: tuple[tuple[str, str], ...]
    wrapped: tuple[WrappedLeaf, ...] = ()

    # -- derived views ----------------------------------------------------------------------
    def assignment(self) -> dict[str, int]:
        return dict(self._assignment)

    @cached_property
    def _assignment(self) -> dict[str, int]:
        return {n.name: n.stage for n in self.nodes}

    @cached_property
    def _graph(self) -> nx.DiGraph:
        return self.graph()

    def cost_models(self) -> list[str]:
        """Cost models every node has a cost under, the split's own first."""
        common = set.intersection(*(set(n.costs) for n in self.nodes)) if self.nodes else set()
        return [self.cost_model] + sorted(common - {self.cost_model})

    def graph(self, cost_model: str | None = None) -> nx.DiGraph:
        """The DAG in the splitter's contract, weighted by ``cost_model`` (default: the split's)."""
        model = cost_model or self.cost_model
        dag = nx.DiGraph()
        for n in self.nodes:
            dag.add_node(n.name, cost=n.costs[model], bytes=n.bytes, input=n.input, output=n.output)
        dag.add_edges_from(self.edges)
        return dag

    def stage_costs(self, cost_model: str | None = None) -> list[float]:
        dag = self._graph if cost_model in (None, self.cost_model) else self.graph(cost_model)
        return stage_costs(dag, self._assignment, self.num_stages)

    def bottleneck(self) -> float:
        return bottleneck(self._graph, self._assignment, self.num_stages)

    def lower_bound(self) -> float:
        """No split can beat ``max(total / k, costliest node)``: the yardstick for the bottleneck."""
        costs = [n.costs[self.cost_model] for n in self.nodes]
        return max(sum(costs) / self.num_stages, max(costs, default=0.0))

    def boundaries(self) -> list[list[str]]:
        """Per boundary j (stage j to j+1), the values crossing it, carried values included."""
        return boundary_values(self._graph, self._assignment, self.num_stages)

    def boundary_bytes(self) -> list[float]:
        return boundary_bytes(self._graph, self._assignment, self.num_stages)

    def total_boundary_bytes(self) -> float:
        return total_boundary_bytes(self._graph, self._assignment, self.num_stages)

    def module_stage_sets(self) -> dict[str, set[int]]:
        """Every module (and its ancestors) holding a compute node, with the stages it spans."""
        spans: dict[str, set[int]] = {}
        for n in self.nodes:
            if not n.input:
                for path in module_ancestors(n.module):
                    spans.setdefault(path, set()).add(n.stage)
        return spans

    def module_stages(self) -> dict[str, int | list[int]]:
        """Module path -> its stage, or the sorted stages it spans; what ``modules`` in the file says."""
        return {p: min(s) if len(s) == 1 else sorted(s) for p, s in self.module_stage_sets().items()}

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The file's content: the plan, then the derived sections for readers."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "versions": dict(self.versions),
            "model": self.model,
            "pipeline": self.pipeline,
            "num_stages": self.num_stages,
            "cost_model": self.cost_model,
            "summary": {
                "stage_costs": [_number(c) for c in self.stage_costs()],
                "bottleneck": _number(self.bottleneck()),
                "lower_bound": _number(self.lower_bound()),
                "boundary_bytes": [_number(b) for b in self.boundary_bytes()],
                "total_boundary_bytes": _number(self.total_boundary_bytes()),
            },
            "boundaries": self.boundaries(),
            "modules": self.module_stages(),
            "wrapped": [{"kind": w.kind, "name": w.name, "reason": w.reason} for w in self.wrapped],
            "nodes": [_node_dict(n) for n in self.nodes],
            "edges": [list(e) for e in self.edges],
        }


def _number(x: float) -> int | float:
    """Whole numbers as ints, so the file reads ``4096`` rather than ``4096.0``."""
    return int(x) if float(x).is_integer() else float(x)


def _node_dict(n: PlanNode) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": n.name, "stage": n.stage, "op": n.op, "target": n.target, "module": n.module,
        "costs": {k: _number(v) for k, v in n.costs.items()}, "bytes": _number(n.bytes),
        "param_bytes": _number(n.param_bytes),
    }
    for flag in ("input", "output"):
        if getattr(n, flag):
            out[flag] = True
    if n.value:
        out["value"] = dict(n.value)
    return out
