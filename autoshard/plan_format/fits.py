"""Whether a saved plan fits the model's graph today: the same nodes and edges, the same weight sizes.

Below the passes, with the rest of the file format, so that the ``load-partition`` pass can check
a plan; ``autoshard.plan_io.rebuild`` (which imports the passes) checks it too.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import networkx as nx

from autoshard.errors import PlanError
from autoshard.plan_format.model import SavedPlan, versions


def check_fits(plan: SavedPlan, dag: nx.DiGraph, source: str) -> None:
    """Raise ``PlanError`` unless ``dag`` (the model's graph today) is the graph the plan was made for."""
    problems = _differences("node", [n.name for n in plan.nodes], list(dag.nodes))
    problems += _differences("edge", [f"{u} -> {v}" for u, v in plan.edges], [f"{u} -> {v}" for u, v in dag.edges])
    if problems:
        check_arguments(plan, dag, source)
        here = versions()
        made = ", ".join(f"{k} {v}" for k, v in plan.versions.items()) or "unknown versions"
        raise PlanError(
            f"plan {source} was made for another graph ({'; '.join(problems)}). It was made for "
            f"{plan.model or 'a model'} with {made}; here: {', '.join(f'{k} {v}' for k, v in here.items())}. "
            "Make a new plan for this model with `autoshard split TARGET --stages K --out PLAN.json`"
        )


def check_arguments(plan: SavedPlan, dag: nx.DiGraph, source: str) -> None:
    """Raise ``PlanError`` where ``dag`` takes other arguments than the plan's graph, some of them the same
    (the same model called another way): a plan saved from a call with ``labels`` rebuilt from one without
    (or the reverse) differs in every node those arguments reach, and the graph comparison would name a
    node (``'labels_unchecked'``), not the cause. Disjoint arguments are another model's: left to it."""
    planned = _arguments(node.target for node in plan.nodes if node.op == "placeholder")
    given = _arguments(data.get("target", "") for _, data in dag.nodes(data=True) if data.get("op") == "placeholder")
    if planned == given or not set(planned) & set(given):
        return
    change = [f"{', '.join(map(repr, names))} {how}" for names, how in (
        ([a for a in planned if a not in given], "left out"), ([a for a in given if a not in planned], "added"))
        if names]
    raise PlanError(
        f"plan {source} was made for a call with the arguments {_listed(planned)}, and the example inputs here pass "
        f"{_listed(given)} ({'; '.join(change) or 'in another order'}): its graph takes other inputs, so its stages "
        f"cannot be rebuilt from them. Pass example inputs for the same arguments ({_listed(planned)}) to load_plan "
        "(or from TARGET, for `autoshard split --plan`); "
        "with respecialize=True (the default) the stages it builds take calls with other arguments too, captured "
        "again under the plan's split. Or make a new plan with example inputs that pass these arguments")


def _arguments(targets: Iterable[str]) -> list[str]:
    """The argument names of a graph's inputs, in order, each once (a structured argument has several)."""
    return list(dict.fromkeys(str(t) for t in targets))


def _listed(names: Sequence[str]) -> str:
    return ", ".join(map(repr, names))


class StalePlanWarning(UserWarning):
    """A plan loaded into a model whose weights have other sizes, or are tied otherwise, than those it was made for."""


class UnmeasuredMemoryWarning(UserWarning):
    """A plan made under ``max_memory`` with nodes whose saved activations were not measured (fake
    tensors could not run or size them, and shape propagation ran no real tensors to probe them on):
    they count their output's bytes only, so a stage may hold more than its budget
    (``autoshard.runtime.measure_stage_memory`` says how much)."""


def weight_size_changes(plan: SavedPlan, dag: nx.DiGraph) -> list[str]:
    """The weights (by the plan's names) whose size in ``dag`` differs from the plan's, or that are tied
    otherwise (GPT-2's head untied from its embedding: a whole table more in the last stage): the same
    graph with other weights, whose split the plan's balance no longer describes."""
    now = dag.graph.get("weights", {})
    resized = [f"'{name}' has {now[name].numel:,} elements here, {info.numel:,} in the plan"
               for name, info in plan.weights.items() if name in now and now[name].numel != info.numel]
    return resized + _tie_changes(plan.weights, now)


def _tie_changes(planned: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """Each group of names one weight has in the plan and not here, or here and not in the plan."""
    def groups(weights: Mapping[str, Any]) -> dict[str, frozenset[str]]:
        return {name: frozenset(info.names) for info in weights.values() for name in info.names}

    before, after = groups(planned), groups(now)
    changes = []
    sides = ((after, before, "here", "in the plan"), (before, after, "in the plan", "here"))
    for names, were, where, not_where in sides:
        for group in dict.fromkeys(names.values()):
            tied = sorted(group & were.keys())
            if len(tied) > 1 and any(were[name] != group for name in tied):
                changes.append(f"{' and '.join(map(repr, tied))} are one weight {where}, not {not_where}")
    return changes


def _differences(kind: str, planned: Sequence[str], actual: Sequence[str]) -> list[str]:
    planned_set, actual_set = set(planned), set(actual)
    only_plan = [x for x in planned if x not in actual_set]
    only_graph = [x for x in actual if x not in planned_set]
    out = []
    if only_graph:
        out.append(f"{len(only_graph)} {kind}(s) of the model are not in the plan, e.g. {only_graph[0]!r}")
    if only_plan:
        out.append(f"{len(only_plan)} {kind}(s) of the plan are not in the model, e.g. {only_plan[0]!r}")
    return out
