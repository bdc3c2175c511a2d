"""Whether nodes that ran for a call may run again for it, as running them once would leave things.

A check that refuses a call after some stages computed leaves their work done, and another plan runs
them again: that leaves what one run leaves unless they update buffers (batch-norm statistics, a step
counter) or draw random numbers from generators not set back between the runs. The runtime asks it of
the stages up to a refusing check (``specialize.rerun_of``); ``size_conditions`` asks it of the whole
graph at capture, to tell which checks must be written over the inputs' sizes and checked first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from autoshard.costs.facts import NodeFacts, node_facts
from autoshard.fx_helpers import resolve, runs_model_code
from autoshard.lowering.randomness import draws_random

#: A ``call_module`` node of a stage, with its facts.
ModuleCall = tuple[torch.fx.GraphModule, torch.fx.Node, NodeFacts | None]


@dataclass(frozen=True)
class Rerun:
    """What running a plan's stages again, up to one of them, depends on, from one walk of their nodes
    (``rerun_of_nodes``): whether a node writes a buffer whatever the modes or draws from a generator of
    the call's own (``same`` False) or from the default generators (``draws``), and the module calls
    (``called``: stage, node, facts), which draw or update buffers as the modes are on the call. The
    stages' graphs and buffers stay as captured, so the walk is made once per plan and stage: made after
    every failed guard, it cost 150-300 µs a call where calls took the wrong plan first."""

    same: bool
    called: tuple[ModuleCall, ...] = ()
    draws: bool = False

    def holds(self, rewound: bool = False) -> bool:
        """Whether running these stages twice leaves what running them once leaves, with the modules' modes
        as they are now: none updates a buffer (one its code writes in place, ``self.steps.add_(1)``; in
        training mode, a traced ``F.batch_norm``'s statistics, or any a module in training mode holds:
        ``_updates_buffers``), nor draws random numbers, unless the default generators are ``rewound``
        between the runs."""
        return self.same and (rewound or not self.draws) and not any(
            (not rewound and _draws(stage, node, facts)) or _updates_buffers(stage, node, facts, set())
            for stage, node, facts in self.called)

    def then(self, later: Rerun) -> Rerun:
        """The ``Rerun`` of these nodes followed by ``later``'s (a stage's after the stages before it)."""
        if not (self.same and later.same):
            return Rerun(False)
        return Rerun(True, self.called + later.called, self.draws or later.draws)


def rerun_of_nodes(stage: torch.fx.GraphModule, nodes: Iterable[torch.fx.Node], training: bool) -> Rerun:
    """The ``Rerun`` of ``nodes``, in order, of ``stage``'s graph, captured in ``training`` mode."""
    called: list[ModuleCall] = []
    draws = False
    held: set[str] = set()  # the nodes that are a weight or buffer of the stage, or a view of one
    for node in nodes:
        facts = node_facts(node)
        first = node.args[0] if node.args else None
        weight = node.op == "get_attr" and isinstance(resolve(stage, str(node.target)), torch.Tensor)
        if weight or (facts is not None and facts.aliases_input and isinstance(first, torch.fx.Node)
                      and first.name in held):
            held.add(node.name)
        if node.op == "call_module":
            called.append((stage, node, facts))
        elif _updates_buffers(stage, node, facts, held, training) or (
                _draws(stage, node, facts) and "generator" in node.kwargs):
            return Rerun(False)
        else:
            draws = draws or _draws(stage, node, facts)
    return Rerun(True, tuple(called), draws)


def _draws(stage: torch.fx.GraphModule, node: torch.fx.Node, facts: NodeFacts | None) -> bool:
    """Whether ``node`` may draw random numbers: not where shape propagation saw it (``facts``) draw
    nothing from the default generators and it is given no generator of its own (an attention that may
    drop out, called with ``dropout_p=0.0`` in eval mode)."""
    if facts is not None and not facts.draws_random and "generator" not in node.kwargs:
        return False
    return draws_random(stage, node)


def _updates_buffers(stage: torch.fx.GraphModule, node: torch.fx.Node, facts: NodeFacts | None,
                     held: set[str], training: bool = False) -> bool:
    """Whether ``node`` writes in place (as shape propagation saw it: ``facts``) what ``held`` names (a
    buffer of ``stage``, or a view of one: ``self.calls[:1].add_(1)``), or calls a module in training
    mode that holds buffers, or a module kept whole that shape propagation saw write a buffer of its own
    (``NodeFacts.writes_own_buffers``, in any mode). In training mode also a node given such a tensor that
    updates running statistics (``_updates_statistics``: a traced ``F.batch_norm``, whose kernel moves no
    version counter), calls the model's own code kept whole (``runs_model_code``: what it does with the
    buffer is unseen), or that shape propagation did not see run; a buffer only read (BERT's
    ``position_ids``, a rotary ``inv_freq``) is not updated."""
    if node.op == "call_module":
        return (facts is not None and facts.writes_own_buffers) or any(
            m.training and any(b is not None for b in m._buffers.values())
            for m in stage.get_submodule(str(node.target)).modules())
    if facts is not None and not held.isdisjoint(facts.written_inputs):
        return True
    unseen_or_statistics = facts is None or _updates_statistics(node) or runs_model_code(stage, node)
    return training and node.op in ("call_function", "call_method") and unseen_or_statistics and \
        any(given.name in held for given in node.all_input_nodes)


def _updates_statistics(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls a normalisation that updates the running statistics it is given (by its name:
    ``batch_norm``, ``instance_norm``, a quantisation observer's ``moving_avg``), or an operator whose schema
    writes an argument: writes ``facts.written_inputs`` may miss."""
    if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
        return True
    name = getattr(node.target, "__name__", str(node.target))
    return any(word in name for word in ("batch_norm", "instance_norm", "moving_avg"))
