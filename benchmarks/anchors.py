"""The splitting policies of other pipeline tools, re-implemented (our own code) on the DAG.

Each takes a graph in the splitter's contract and k and returns ``{node: stage}`` (stages may
be fewer than k, or empty, exactly as the policy would produce), or raises ``AnchorFailed``
where the tool itself would fail. They follow each tool's rule, not its code: where the
original recomputes sums from scratch we keep running sums, so wall times measure the rule.

* ``fairscale_greedy``: fairscale.experimental.nn.auto_shard: fill a shard past total // k,
  and when a node reads a value from an earlier shard (other than from the node just before
  it), merge every shard back to that one.
* ``deepspeed_balanced``: DeepSpeed ``partition_balanced``: bisection (absolute eps 1e-3) on
  the bottleneck with a greedy probe that keeps each part strictly below it.
* ``torchgpipe_block``: torchgpipe ``balance.blockpartition.solve`` (Bárány et al.): from
  equal counts, move one element at a time towards the smallest block until the largest is
  within 1 of the smallest, on weights normalised to [0, 1].
* ``pippy_equal_size``: PiPPy ``split_into_equal_size``: buckets of at most total // k,
  parameter-free nodes ignored, at most k - 1 cuts.
* ``pippy_milp``: PiPPy ``split_by_graph``: presolve merges degree-1 chains, then a MILP over
  one-hot stage variables that maximises the weight of edges kept inside stages, caps each
  stage's weight at 2.5x the mean and its edge weight at 1.1x, and fails on a time-out.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from itertools import accumulate
from typing import Callable

import networkx as nx
import numpy as np

from autoshard.graph.linearize import is_input, program_order

Assignment = dict


class AnchorFailed(Exception):
    """The tool's own algorithm gives up here (infeasible model, time-out, too large)."""


def _sequence(dag: nx.DiGraph) -> tuple[list, list[float]]:
    order = program_order(dag)
    nodes = [v for v in order if not is_input(dag, v)]
    return nodes, [float(dag.nodes[v]["cost"]) for v in nodes]


def _from_parts(dag: nx.DiGraph, nodes: list, part: list[int]) -> Assignment:
    """Stages for ``nodes`` (program order) from each node's part; inputs join the first."""
    assignment = {v: 0 for v in dag.nodes if is_input(dag, v)}
    assignment.update(zip(nodes, part))
    return assignment


def fairscale_greedy(dag: nx.DiGraph, k: int) -> Assignment:
    order = program_order(dag)
    per_shard = int(sum(float(dag.nodes[v]["cost"]) for v in order)) // k
    shard_of: dict = {}
    load: dict[int, float] = {}
    seen: list = []
    shard = 0
    for v in order:
        if is_input(dag, v):
            shard_of[v] = shard
            seen.append(v)
            continue
        earliest = shard
        for u in dag.predecessors(v):
            if u != seen[-1]:
                earliest = min(earliest, shard_of[u])
        if earliest < shard:  # a skip from an earlier shard: collapse the shards in between
            # Shards never decrease along ``seen``, so walking back stops at the first node
            # already in ``earliest``: fairscale walks on to ``source`` but changes nothing more.
            for u in reversed(seen):
                if shard_of[u] <= earliest:
                    break
                load[shard_of[u]] -= float(dag.nodes[u]["cost"])
                load[earliest] = load.get(earliest, 0.0) + float(dag.nodes[u]["cost"])
                shard_of[u] = earliest
            shard = earliest
        shard_of[v] = shard
        seen.append(v)
        load[shard] = load.get(shard, 0.0) + float(dag.nodes[v]["cost"])
        if load[shard] > per_shard:
            shard += 1
    used = sorted(set(shard_of.values()))
    rank = {s: i for i, s in enumerate(used)}
    return {v: rank[s] for v, s in shard_of.items()}


def deepspeed_balanced(dag: nx.DiGraph, k: int, eps: float = 1e-3) -> Assignment:
    nodes, weights = _sequence(dag)
    n = len(nodes)
    if n <= k:
        return _from_parts(dag, nodes, list(range(n)))
    prefix = list(accumulate(weights))  # inclusive, as DeepSpeed keeps it

    def probe(bottleneck: float) -> tuple[list[int], bool]:
        ends = [n] * k
        target = bottleneck
        start = 0
        for p in range(k - 1):
            ends[p] = bisect_left(prefix, target, lo=start)
            if ends[p] == n:
                size = prefix[-1] - (prefix[start - 1] if start else 0.0)
                return ends, size < bottleneck
            start = ends[p]
            target = (prefix[start - 1] if start else 0.0) + bottleneck
        return ends, target >= prefix[-1]

    lower, upper = prefix[-1] / k, prefix[-1]
    while upper > lower + eps:
        middle = lower + (upper - lower) / 2
        if probe(middle)[1]:
            upper = middle
        else:
            lower = middle + eps
    ends, _ = probe(upper)
    part, start = [], 0
    for p, end in enumerate(ends):
        part += [p] * (end - start)
        start = max(start, end)
    return _from_parts(dag, nodes, part)


def torchgpipe_block(dag: nx.DiGraph, k: int, max_moves: int = 10_000_000) -> Assignment:
    nodes, weights = _sequence(dag)
    n = len(nodes)
    low, span = min(weights), max(weights) - min(weights)
    normal = [0.0 if span == 0 else (w - low) / span for w in weights]
    prefix = [0.0, *accumulate(normal)]
    splits = [n // k * (x + 1) for x in range(k - 1)] + [n]

    def size(i: int) -> float:
        return prefix[splits[i]] - prefix[splits[i - 1] if i else 0]

    moves = 0
    while True:
        largest, p = max((size(i), i) for i in range(k))
        while True:
            smallest, q = min((size(i), i) for i in range(k))
            if largest <= smallest + 1:
                part, start = [], 0
                for i, end in enumerate(splits):
                    part += [i] * (end - start)
                    start = end
                return _from_parts(dag, nodes, part)
            if p < q:
                h = q - 1
                splits[h] -= 1
            else:
                h = q + 1
                splits[q] += 1
            moves += 1
            if moves > max_moves:
                raise AnchorFailed(f"no convergence after {max_moves} moves")
            if p == h:
                break


def pippy_equal_size(dag: nx.DiGraph, k: int) -> Assignment:
    nodes, weights = _sequence(dag)
    threshold = int(sum(weights)) // k
    cuts: list[int] = []
    bucket = 0.0
    for i, w in enumerate(weights):
        if w == 0:
            continue  # no parameters: PiPPy does not look at it
        if bucket + w <= threshold:
            bucket += w
        elif bucket == 0 and w > threshold:
            cuts.append(i + 1)  # the node becomes a stage of its own
        else:
            cuts.append(i)
            bucket = w
    cuts = sorted(set(c for c in cuts if 0 < c < len(nodes)))[: k - 1]
    part = [sum(1 for c in cuts if c <= i) for i in range(len(nodes))]
    return _from_parts(dag, nodes, part)


def _merge_chains(dag: nx.DiGraph) -> list[list]:
    """PiPPy's presolve: merge sources with one reader, sinks with one producer, degree-1 chains."""
    cluster_of = {v: i for i, v in enumerate(dag.nodes)}
    members = {i: [v] for v, i in cluster_of.items()}
    edges = sorted(dag.edges, key=lambda e: -float(dag.nodes[e[0]]["bytes"]))
    for u, v in edges:
        a, b = cluster_of[u], cluster_of[v]
        if a == b:
            continue
        merge = ((dag.in_degree(u) == 0 and dag.out_degree(u) == 1)
                 or (dag.in_degree(v) == 1 and dag.out_degree(v) == 0)
                 or (dag.out_degree(u) == 1 and dag.in_degree(v) == 1 and dag.out_degree(v) == 1))
        if merge:
            for w in members[b]:
                cluster_of[w] = a
            members[a] += members.pop(b)
    return list(members.values())


def pippy_milp(dag: nx.DiGraph, k: int, time_limit: float = 30.0, max_columns: int = 2_000_000) -> Assignment:
    import highspy

    clusters = _merge_chains(dag)
    index = {id(c): i for i, c in enumerate(clusters)}
    slot = {v: index[id(c)] for c in clusters for v in c}
    n = len(clusters)
    weight = [sum(float(dag.nodes[v]["cost"]) for v in c) for c in clusters]
    edges = []
    inner = [0.0] * n
    for u, v in dag.edges:
        source = dag.in_degree(u) == 0 and float(dag.nodes[u]["cost"]) == 0
        w = 0.0 if source else float(dag.nodes[u]["bytes"])  # PiPPy zeroes inputs' edges
        if slot[u] == slot[v]:
            inner[slot[u]] += w
        else:
            edges.append((slot[u], slot[v], w))
    m = len(edges)
    columns = n * k + m * k + 1
    if columns > max_columns:
        raise AnchorFailed(f"model too large to build ({columns} columns)")

    def x(i: int, j: int) -> int:
        return i * k + j

    def e(i: int, j: int) -> int:
        return n * k + i * k + j

    aux = n * k + m * k
    rows: list[tuple[float, float, list[tuple[int, float]]]] = []
    for i, (s, t, _) in enumerate(edges):
        for j in range(k):
            rows.append((-math.inf, 0.0, [(e(i, j), 1.0), (x(s, j), -1.0)]))
            rows.append((-math.inf, 0.0, [(e(i, j), 1.0), (x(t, j), -1.0)]))
            rows.append((-math.inf, 1.0, [(x(s, j), 1.0), (x(t, j), 1.0), (e(i, j), -1.0)]))
        rows.append((-math.inf, 0.0, [(x(t, j), float(j)) for j in range(k)]
                     + [(x(s, j), -float(j)) for j in range(k)]))
    for i in range(n):
        rows.append((1.0, 1.0, [(x(i, j), 1.0) for j in range(k)]))
    total_weight = sum(weight)
    total_comm = sum(w for _, _, w in edges) + sum(inner)
    for j in range(k):
        rows.append((-math.inf, 2.5 * total_weight / k, [(x(i, j), weight[i]) for i in range(n) if weight[i]]))
        comm = [(e(i, j), w) for i, (_, _, w) in enumerate(edges)] + [(x(i, j), inner[i]) for i in range(n) if inner[i]]
        rows.append((-math.inf, 1.1 * total_comm / k, comm))
        touching: dict[int, float] = {}
        for i, (s, t, w) in enumerate(edges):
            touching[x(s, j)] = touching.get(x(s, j), 0.0) + w
            touching[x(t, j)] = touching.get(x(t, j), 0.0) + w
            touching[e(i, j)] = -w
        for i in range(n):
            touching[x(i, j)] = touching.get(x(i, j), 0.0) + inner[i]
        rows.append((-math.inf, 0.0, [*touching.items(), (aux, -total_comm / k)]))
    cost = np.zeros(columns)
    for j in range(k):
        for i, (_, _, w) in enumerate(edges):
            cost[e(i, j)] = -w - 1
        for i in range(n):
            cost[x(i, j)] = -inner[i]
    cost[aux] = total_comm / k

    solver = highspy._core._Highs()
    solver.setOptionValue("output_flag", False)
    lower, upper = np.zeros(columns), np.ones(columns)
    lower[aux], upper[aux] = 1.0, 2.0
    empty = np.zeros(0, dtype=np.int32)
    solver.addCols(columns, cost, lower, upper, 0, empty, empty, np.zeros(0))
    starts, idx, val = [], [], []
    for _, _, terms in rows:
        starts.append(len(idx))
        idx += [c for c, _ in terms]
        val += [v for _, v in terms]
    solver.addRows(len(rows), np.array([max(r[0], -highspy.kHighsInf) for r in rows]),
                   np.array([r[1] for r in rows]), len(idx), np.array(starts, dtype=np.int32),
                   np.array(idx, dtype=np.int32), np.array(val))
    integer = np.arange(n * k + m * k, dtype=np.int32)
    solver.changeColsIntegrality(len(integer), integer, np.array([highspy.HighsVarType.kInteger] * len(integer)))
    solver.setOptionValue("time_limit", float(time_limit))
    solver.run()
    status = solver.getModelStatus()
    if status == highspy.HighsModelStatus.kTimeLimit:
        raise AnchorFailed(f"time limit ({time_limit:g} s) reached")
    if status != highspy.HighsModelStatus.kOptimal:
        raise AnchorFailed(f"MILP {solver.modelStatusToString(status)}")
    values = solver.getSolution().col_value
    stage = [max(range(k), key=lambda j: values[x(i, j)]) for i in range(n)]
    used = sorted(set(stage))
    rank = {s: r for r, s in enumerate(used)}
    return {v: rank[stage[slot[v]]] for v in dag.nodes}


#: Anchor name -> policy; ``pippy-milp`` is run only on graphs small enough to model.
ANCHORS: dict[str, Callable[[nx.DiGraph, int], Assignment]] = {
    "fairscale-greedy": fairscale_greedy,
    "deepspeed-balanced": deepspeed_balanced,
    "torchgpipe-block": torchgpipe_block,
    "pippy-equal-size": pippy_equal_size,
    "pippy-milp": pippy_milp,
}
