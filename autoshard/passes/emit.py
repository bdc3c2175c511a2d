"""The ``emit`` pass: build the stage GraphModules and the ``ShardedModel``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch.fx as fx
from torch import nn

from autoshard.capture.guard import run_forward_hooks
from autoshard.capture.hooks_since import HooksAtCapture
from autoshard.capture.rebinding import watch
from autoshard.capture.signature import forward_signature
from autoshard.emit import HELD_STATE, emit_stages
from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError
from autoshard.fx_helpers import resolve
from autoshard.graph import boundary_values, check_partition
from autoshard.graph.partition import remade_values
from autoshard.isolation import HeldModule
from autoshard.lowering.from_fx import module_scopes
from autoshard.passes.analyses import memory_model
from autoshard.passes.base import Pass, PassContext, ShardProgram
from autoshard.sharded import ShardedModel, StagePlan, note_example_tensors
from autoshard.specialize import CapturedFor, call_structure


@dataclass(frozen=True)
class EmitPass(Pass):
    """Emit k fx stages holding the original parameters under their original names.

    Every stage but the last returns the tuple of values crossing its boundary; the last
    returns exactly what the model returns. Example: ``...,split{stages=2},emit``.
    """

    name: ClassVar[str] = "emit"
    requires: ClassVar[frozenset[str]] = frozenset({"traced", "dag", "partition"})
    provides: ClassVar[frozenset[str]] = frozenset({"sharded"})

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        partition = program.partition
        assignment = dict(partition.assignment)
        k = partition.num_stages
        try:  # a partition built without Partition.from_assignment (a pass of the user's) is checked here
            check_partition(program.dag, assignment, k)
        except (InvalidArgumentError, InvalidArgumentTypeError) as exc:
            error = InvalidArgumentTypeError if isinstance(exc, TypeError) else InvalidArgumentError
            raise error(f"the 'partition' artifact is not a valid split of the DAG: {exc}; the pass that "
                        "provides it should build it with Partition.from_assignment(dag, assignment, k), "
                        "which checks it") from exc
        boundaries = tuple(tuple(b) for b in boundary_values(program.dag, assignment, k))
        stages = emit_stages(program.traced.graph_module, assignment, boundaries, program.model.training,
                             remade_values(program.dag))
        example = program.example_inputs
        if stages:
            note_example_tensors(stages[0], forward_signature(program.model),
                                 None if example is None else (example.args, example.kwargs),
                                 program.traced.leafness_asked)
        for stage in stages:
            state = getattr(stage, HELD_STATE)
            read = (str(node.target) for node in stage.graph.nodes if node.op == "get_attr")  # weights, buffers
            watch(program.model, state, (*state.leaves, *read))
        plan = StagePlan(assignment, boundaries, program.traced.wrapped, program.dag, partition.info,
                         memory_model(ctx), training=program.model.training)
        run = modules_run(program.model, program.traced.graph_module)
        called = modules_called(program.model, program.traced.graph_module)
        sharded = ShardedModel(stages, plan, forward_signature(program.model), run, program.traced.attributes_read,
                               HooksAtCapture(run, called, modules_running_hooks(program.traced.graph_module)),
                               model=program.model)
        if program.example_inputs is not None:
            example = program.example_inputs
            sharded.captured_for = CapturedFor(call_structure(example.args, dict(example.kwargs),
                                                              sharded.model_signature))
        return dataclasses.replace(program, sharded=sharded)


def modules_run(model: nn.Module, gm: fx.GraphModule) -> tuple[nn.Module, ...]:
    """The model and its modules whose code the captured graph runs (the graph's module scopes):
    what they read from ``self.training`` was fixed at capture. A ``torch.export`` graph calls
    none of them, so its stages alone cannot see ``model.eval()``."""
    return _found(model, ["", *(path for node in gm.graph.nodes for path, _ in module_scopes(gm, node))])


def modules_called(model: nn.Module, gm: fx.GraphModule) -> tuple[nn.Module, ...]:
    """The model's modules the captured graph calls whole: they run their hooks themselves."""
    return _found(model, [str(node.target) for node in gm.graph.nodes if node.op == "call_module"])


def modules_running_hooks(gm: fx.GraphModule) -> tuple[nn.Module, ...]:
    """The modules whose forward hooks the captured graph runs after their traced body, as the
    module holds them at each call (``capture.guard.run_forward_hooks``)."""
    args = [resolve(gm, arg.target) if isinstance(arg, fx.Node) and arg.op == "get_attr" else arg
            for node in gm.graph.nodes if node.op == "call_function" and node.target is run_forward_hooks
            for arg in node.args[:1]]
    return tuple({id(held.module): held.module for held in args if isinstance(held, HeldModule)}.values())


def _found(model: nn.Module, paths: list[str]) -> tuple[nn.Module, ...]:
    """The model's modules at ``paths`` (the capture's graph names them as the model does: a child
    named ``model``, as in every Transformers ``*ForCausalLM``, is ``model``), once each."""
    found = []
    for path in dict.fromkeys(paths):
        try:
            found.append(model.get_submodule(path))
        except AttributeError:  # a scope of the capture's own making
            continue
    return tuple({id(module): module for module in found}.values())
