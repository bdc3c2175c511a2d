"""Turn a partition of the traced graph into k ``GraphModule`` stages that chain.

Stage 0 takes the model's own inputs (same names, same defaults). Every stage but the last
returns a tuple of the values live across its boundary, in program order; the next stage takes
exactly that tuple. A value needed several stages later is carried through the stages between.
The last stage returns exactly what the model returns. Stages are built over the traced root,
so they hold the original Parameter and buffer objects under their original qualified names.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch.fx as fx


def _stage_graph(
    source: fx.Graph,
    stage: int,
    num_stages: int,
    assignment: Mapping[str, int],
    incoming: Sequence[str],
    outgoing: Sequence[str],
) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {node.name: node for node in source.nodes}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env and node.op == "get_attr":  # each stage holds its own reference
            env[node] = graph.node_copy(node)
        return env[node]

    if stage == 0:
        for node in source.nodes:
            if node.op == "placeholder":
                env[node] = graph.node_copy(node)
    else:
        for name in incoming:
            env[by_name[name]] = graph.placeholder(name)
    for node in source.nodes:
        if assignment.get(node.name) == stage and node.op != "placeholder":
            env[node] = graph.node_copy(node, lookup)
    if stage == num_stages - 1:
        graph.node_copy(next(n for n in source.nodes if n.op == "output"), lookup)
    else:
        graph.output(tuple(env[by_name[name]] for name in outgoing))
    graph.lint()
    return graph


def emit_stages(
    gm: fx.GraphModule,
    assignment: Mapping[str, int],
    boundaries: Sequence[Sequence[str]],
) -> list[fx.GraphModule]:
    """Build the stage modules; ``boundaries[j]`` lists the values crossing from stage j to j+1."""
    num_stages = len(boundaries) + 1
    stages = []
    for stage in range(num_stages):
        incoming = boundaries[stage - 1] if stage > 0 else ()
        outgoing = boundaries[stage] if stage < num_stages - 1 else ()
        graph = _stage_graph(gm.graph, stage, num_stages, assignment, incoming, outgoing)
        stages.append(fx.GraphModule(gm, graph, class_name=f"Stage{stage}"))
    return stages
