"""The split passes: module-level constraints, tied weights, and one pass per strategy."""

from __future__ import annotations

import dataclasses
import re

import networkx as nx
import pytest
import torch
from conftest import SignGate
from torch import nn

import autoshard
from autoshard.api import run_pipeline
from autoshard.errors import InfeasibleSplitError, InvalidArgumentError, PipelineValidationError, SpecError
from autoshard.examples import ResidualMLP, TransformerLM
from autoshard.examples.models import causal_mask
from autoshard.graph import Partition
from autoshard.passes import (
    BuildDagPass,
    EmitPass,
    LinearizePass,
    PassRegistry,
    Pipeline,
    TracePass,
    VerifyPass,
    function_pass,
)
from autoshard.passes.base import ExampleInputs
from autoshard.passes.split import (
    SplitExactPass,
    SplitFixedOrderPass,
    SplitGreedyPass,
    SplitPass,
    SplitUniformPass,
)

REGISTRY = PassRegistry(
    [TracePass, BuildDagPass, LinearizePass, EmitPass, VerifyPass, SplitPass, SplitExactPass,
     SplitFixedOrderPass, SplitGreedyPass, SplitUniformPass],
    entry_point_group=None,
)


def run(model: nn.Module, inputs: tuple, split: str):
    """The program after trace, build-dag, linearize, ``split``, emit and verify."""
    pipeline = Pipeline.parse(f"trace,build-dag,linearize,{split},emit,verify", REGISTRY)
    return run_pipeline(model, pipeline, ExampleInputs(inputs)).program


def stages_of_module(program, path: str) -> set[int]:
    """The stages holding nodes that run inside module ``path`` (or its descendants)."""
    dag, assignment = program.dag, program.partition.assignment
    return {assignment[v] for v in dag.nodes
            if any(p == path or p.startswith(path + ".") for p, _ in dag.nodes[v].get("scopes", ()))}


def mlp():
    torch.manual_seed(0)
    return ResidualMLP(num_blocks=8).eval(), (torch.randn(4, 16),)


def test_cut_before_starts_a_stage_at_the_modules_first_node():
    model, inputs = mlp()
    balanced = run(model, inputs, "split{stages=2}")
    assert stages_of_module(balanced, "linears.4") == {1} and stages_of_module(balanced, "linears.3") == {0}
    program = run(model, inputs, "split{stages=2 cut-before=linears.2}")
    assert all(stages_of_module(program, f"linears.{i}") == {0} for i in range(2))
    assert all(stages_of_module(program, f"linears.{i}") == {1} for i in range(2, 8))
    assert torch.equal(program.sharded(*inputs), model(*inputs))


def test_no_split_keeps_each_instance_of_a_class_whole():
    torch.manual_seed(0)
    model = TransformerLM(nlayers=4).eval()
    inputs = (torch.randint(0, 100, (12, 3)), causal_mask(12))
    for k in (2, 3, 5):
        program = run(model, inputs, f"split{{stages={k} cost=nodes no-split=TransformerEncoderLayer}}")
        for i in range(4):
            assert len(stages_of_module(program, f"transformer_encoder.layers.{i}")) == 1, (k, i)
        assert len(program.sharded.stages) == k


def test_no_split_by_path_keeps_that_subtree_whole():
    model, inputs = mlp()
    program = run(model, inputs, "split{stages=4 cost=nodes no-split=linears.3,linears.4}")
    assert len(stages_of_module(program, "linears.3")) == 1 and len(stages_of_module(program, "linears.4")) == 1


def test_unknown_modules_are_named_with_suggestions():
    model, inputs = mlp()
    with pytest.raises(InvalidArgumentError,
                       match=r"no-split: no module path or class is called 'linear\.3' \(did you mean"):
        run(model, inputs, "split{stages=2 no-split=linear.3}")
    with pytest.raises(InvalidArgumentError,
                       match=r"cut-before: no module with nodes in the graph is called 'linears\.9'"):
        run(model, inputs, "split{stages=2 cut-before=linears.9}")
    with pytest.raises(InvalidArgumentError, match=r"called 'model\.linears\.3' \(did you mean 'linears\.3'\?\)"):
        run(model, inputs, "split{stages=2 cut-before=model.linears.3}")  # a path of a wrapper around this model


class AliasedAndKeptWhole(nn.Module):
    """``shared`` is registered first and called under its second name ``first`` (as T5 ties its
    embeddings to ``shared``): nodes run under one of the names only; ``gate`` is kept whole;
    ``spare`` never runs, but ``last`` uses its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)
        self.first = self.shared
        self.middle = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))  # iterated, never called
        self.gate = SignGate()
        self.spare = nn.Linear(8, 8)  # never run; the last layer uses its weight
        self.last = nn.Linear(8, 8)
        self.last.weight = self.spare.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(self.pre(x))
        for layer in self.middle:
            h = layer(h)
        return self.last(self.gate(h))


def test_constraints_may_name_a_module_by_another_name_or_inside_one_kept_whole():
    torch.manual_seed(0)
    model, inputs = AliasedAndKeptWhole().eval(), (torch.randn(4, 8),)
    by_alias = run(model, inputs, "split{stages=2 cost=nodes cut-before=shared no-split=shared}")
    by_name = run(model, inputs, "split{stages=2 cost=nodes cut-before=first no-split=first}")
    assert by_alias.partition.assignment == by_name.partition.assignment
    # fx names the module by its first name, export by the name the forward calls: either way
    # one of the two runs no node, and the cut lands before the module's node
    assert stages_of_module(by_alias, "shared") | stages_of_module(by_alias, "first") == {1}
    assert stages_of_module(by_alias, "pre") == {0} and stages_of_module(by_alias, "middle") == {1}
    whole = run(model, inputs, "split{stages=3 cost=nodes no-split=middle}")  # a container whose children run
    assert len(stages_of_module(whole, "middle")) == 1
    inner = run(model, inputs, "split{stages=3 cost=nodes no-split=gate.lin}")  # the gate is one node anyway
    assert inner.partition.assignment == run(model, inputs, "split{stages=3 cost=nodes}").partition.assignment
    with pytest.raises(InvalidArgumentError, match="cut-before: 'gate.lin' runs inside 'gate', which the capture "
                                                   "keeps whole .* cut before 'gate'"):
        run(model, inputs, "split{stages=2 cut-before=gate.lin}")
    with pytest.raises(InvalidArgumentError, match="no-split: the forward never runs module 'spare' "
                                                   r"\(its weights are used as 'last.weight'\)"):
        run(model, inputs, "split{stages=2 no-split=spare}")


def test_a_cut_inside_a_no_split_module_is_refused_in_module_paths_with_advice_that_works():
    """The splitter knows node names only ('size_14'): the refusal must name what the user wrote
    and say where a stage can start instead, and that advice must be accepted."""
    model, inputs = mlp()
    with pytest.raises(InfeasibleSplitError, match=r"cut-before 'linears\.3' falls inside no-split linears "
                                                   r"\(module 'linears'\).* cut before 'linears' instead"):
        run(model, inputs, "split{stages=2 cost=nodes cut-before=linears.3 no-split=linears}")
    torch.manual_seed(0)
    lm = TransformerLM(nlayers=2).eval()
    lm_inputs = (torch.randint(0, 100, (12, 3)), causal_mask(12))
    with pytest.raises(InfeasibleSplitError, match=r"cut-before 'transformer_encoder\.layers\.1\.linear2' falls "
                       r"inside no-split TransformerEncoderLayer \(transformer_encoder\.layers\.1\) \(module "
                       r"'transformer_encoder\.layers\.1'\).* cut before 'transformer_encoder\.layers\.1' instead"):
        run(lm, lm_inputs, "split{stages=2 cut-before=transformer_encoder.layers.1.linear2 "
                           "no-split=TransformerEncoderLayer}")
    program = run(lm, lm_inputs, "split{stages=2 cut-before=transformer_encoder.layers.1 "
                                 "no-split=TransformerEncoderLayer}")
    assert stages_of_module(program, "transformer_encoder.layers.0") == {0}
    assert stages_of_module(program, "transformer_encoder.layers.1") == {1}


def test_pin_errors_name_the_module_paths_not_graph_nodes():
    model, inputs = mlp()
    with pytest.raises(InfeasibleSplitError, match=r"cut_before asks for 2 boundaries but 2 stages have only 1 "
                                                   r"\('linears\.2', 'linears\.5'\); ask for at least 3 stages"):
        run(model, inputs, "split{stages=2 cut-before=linears.5,linears.2}")
    with pytest.raises(InfeasibleSplitError, match=r"meets cut_before \['linears\.7'\] and the budgets"):
        run(model, inputs, "split{stages=3 cut-before=linears.7 max-memory=3000 memory-cost=params}")


def test_no_split_of_the_whole_model_allows_one_stage_and_says_so_for_more():
    model, inputs = mlp()
    for entry in ("<root>", "ResidualMLP"):
        with pytest.raises(InfeasibleSplitError, match=rf"no-split {entry} \(the whole model\).*at most 1 stage; "
                                                       "ask for at most 1 stage"):
            run(model, inputs, f"split{{stages=2 no-split={entry}}}")
        assert len(run(model, inputs, f"split{{stages=1 no-split={entry}}}").sharded.stages) == 1
    with pytest.raises(InfeasibleSplitError, match=r"cut-before 'linears\.2' falls inside no-split <root> \(the "
                                                   r"whole model\), .*; drop one of the two"):
        run(model, inputs, "split{stages=2 no-split=<root> cut-before=linears.2}")


def test_no_split_groups_too_large_for_k_say_how_many_stages_fit():
    model, inputs = mlp()
    with pytest.raises(InfeasibleSplitError, match=r"together groups \['no-split linears'\]: keeping the together "
                                                   r"groups whole leaves 1 place to cut, so at most 2 stages; ask "
                                                   "for at most 2 stages"):
        run(model, inputs, "split{stages=3 no-split=linears}")
    assert len(run(model, inputs, "split{stages=2 no-split=linears}").sharded.stages) == 2


def test_capacities_give_a_faster_stage_more_work():
    model, inputs = mlp()
    program = run(model, inputs, "split{stages=2 capacities=1,3}")
    assert stages_of_module(program, "linears.1") == {0} and stages_of_module(program, "linears.2") == {1}
    info = program.partition.info
    assert info.bottleneck == pytest.approx(info.bound)


def test_max_memory_limits_each_stage_under_the_named_cost_model():
    model, inputs = mlp()
    per_block = 16 * 16 * 4 + 16 * 4
    program = run(model, inputs, f"split{{stages=2 max-memory={2 * per_block},{8 * per_block} memory-cost=params}}")
    assert stages_of_module(program, "linears.1") == {0} and stages_of_module(program, "linears.2") == {1}
    with pytest.raises(InfeasibleSplitError, match="the budgets sum to"):
        run(model, inputs, f"split{{stages=2 max-memory={per_block} memory-cost=params}}")
    with pytest.raises(InfeasibleSplitError) as refused:  # the sum fits, no split of the order does
        run(model, inputs, f"split{{stages=2 max-memory={3.5 * per_block:.0f},{4.6 * per_block:.0f} "
                           "memory-cost=params}")
    # the splitter's own advice about the order its bound comes from is no part of a budget the caller gave
    assert "meets the budgets [3,808; 5,005] at once); in the best-balanced plan" in str(refused.value)
    assert "the budget comes from that order" not in str(refused.value) and "relax one" not in str(refused.value)


class SharedTwice(nn.Module):
    """``shared`` runs twice in a row; by cost alone the balanced cut falls between the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.shared, self.b, self.c = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.shared(self.shared(self.a(x)))))


class TiedLM(nn.Module):
    """An LM head tied to the embedding: the tie spans the whole model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.body = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(idx)))


def test_keep_tied_holds_a_shared_module_in_one_stage_when_the_balance_allows():
    torch.manual_seed(0)
    model, inputs = SharedTwice().eval(), (torch.randn(2, 8),)
    loose = run(model, inputs, "split{stages=2 keep-tied=false}")
    assert stages_of_module(loose, "shared") == {0, 1}  # the cost-only split cuts between the calls
    tied = run(model, inputs, "split{stages=2}")
    assert stages_of_module(tied, "shared") == {0}
    assert tied.partition.info.separated == ()
    # Charged to its first reader only, the shared weight looked free to the loose split: it
    # balanced 576 bytes a stage, but both of its stages hold the weight, so one truly holds 864.
    per_linear = 8 * 8 * 4 + 8 * 4
    assert loose.partition.info.bound == tied.partition.info.bound == 2 * per_linear
    assert tied.partition.info.bottleneck == 2 * per_linear
    assert loose.partition.info.bottleneck == 3 * per_linear


def test_a_tie_the_balance_cannot_afford_is_reported():
    torch.manual_seed(0)
    model, inputs = TiedLM().eval(), (torch.randint(0, 50, (2, 5)),)
    program = run(model, inputs, "split{stages=2}")
    assert program.partition.info.separated == ("embed.weight",)
    assert torch.equal(program.sharded(*inputs), model(*inputs))


@pytest.mark.parametrize("spec, strategy", [
    ("split-greedy", "greedy"), ("split-uniform", "uniform"), ("split-fixed-order", "fixed-order"),
    ("split-exact{time-limit=10}", "exact"),
])
def test_each_strategy_is_its_own_pass_over_the_same_partition(spec, strategy):
    model, inputs = mlp()
    spec = spec.replace("{", "{stages=3 ") if "{" in spec else spec + "{stages=3}"
    own = run(model, inputs, spec)
    via_option = run(model, inputs, f"split{{stages=3 strategy={strategy}}}")
    assert own.partition == via_option.partition
    assert own.partition.info.strategy == strategy
    assert len(own.sharded.stages) == 3 and torch.equal(own.sharded(*inputs), model(*inputs))
    if strategy == "exact":
        assert own.partition.info.proven_optimal is True


def test_baseline_passes_take_only_the_options_they_use():
    model, inputs = mlp()
    with pytest.raises(InvalidArgumentError, match="strategy 'greedy' cannot honour no-split"):
        run(model, inputs, "split{strategy=greedy stages=2 no-split=linears.1}")
    for spec in ("split-greedy{stages=2 no-split=linears.1}", "split-uniform{tolerance=0.1}"):
        with pytest.raises(SpecError, match="unknown option .* its options are: stages, cost"):
            Pipeline.parse(f"trace,build-dag,linearize,{spec},emit", REGISTRY)
    assert [f.name for f in SplitGreedyPass.options()] == [f.name for f in SplitUniformPass.options()] == [
        "stages", "cost"]


@pytest.mark.parametrize("split, message", [
    ("split{stages=0}", r"'split' needs stages >= 1, got stages=0"),
    ("split{stages=4 capacities=0,1,1,1}", r"'split' capacities: entry 0 is 0\.0; each must be finite and > 0"),
    ("split{stages=4 capacities=-1,1,1,1}", r"capacities: entry 0 is -1\.0; each must be finite and > 0"),
    ("split{stages=4 capacities=1,2}", r"'split' capacities has 2 values for 4 stages"),
    ("split{stages=4 max-memory=nan}", r"'split' max-memory: entry 0 is nan; each must be finite and >= 0"),
    ("split{stages=4 max-memory=1e9,1e9}", r"'split' max-memory has 2 values for 4 stages"),
    ("split{strategy=uniform stages=4 cut-before=linears.2}",
     r"'split' with strategy 'uniform' cannot honour cut-before: leave it out, or pick a strategy that "
     r"does \(min-cut, fixed-order, exact\)"),
    ("split{strategy=greedy stages=4 capacities=1,2,1,1 max-memory=1e9}",
     r"cannot honour capacities, max-memory: leave them"),
    ("split-exact{stages=4 time-limit=0}", r"'split-exact' needs time-limit > 0 seconds, got 0\.0"),
])
def test_split_option_values_no_split_can_use_are_refused_before_anything_runs(split, message):
    """Validated before the capture, in the spec's own option names: the splitter would refuse them only
    after a capture (minutes on a large model) and call them memory_budgets, cut_before, time_limit."""
    pipeline = Pipeline.parse(f"trace,build-dag,linearize,{split},emit", REGISTRY)
    with pytest.raises(InvalidArgumentError, match=message):
        pipeline.validate()


def test_one_capacity_or_budget_is_every_stages_and_a_pipeline_without_a_count_validates():
    Pipeline.parse("trace,build-dag,linearize,split{stages=4 capacities=2 max-memory=1e9 memory-cost=params},emit",
                   REGISTRY).validate()
    Pipeline.parse("trace,build-dag,linearize,split{capacities=1,2,3},emit", REGISTRY).validate()


def order_pass(make_order):
    """A pass of the user's that provides ``order`` as ``make_order(dag)`` says."""
    @function_pass("my-order", requires=("dag",), provides=("order",), register=False)
    def my_order(program, ctx):
        """The user's order."""
        return dataclasses.replace(program, order=tuple(make_order(program.dag)))

    return my_order()


@pytest.mark.parametrize("make_order, message", [
    (lambda dag: reversed(list(nx.topological_sort(dag))), r"the order puts '\w+' before its input"),
    (lambda dag: list(nx.topological_sort(dag))[:-1], r"must list each of the \d+ nodes exactly once"),
])
def test_an_order_that_is_not_topological_is_refused_not_silently_replaced(make_order, message):
    """The splitter makes its input order topological, so a wrong order from the user's pass was cut
    along another order without a word (reversed), or failed on a missing 'cost' attribute (a dropped node)."""
    model, inputs = mlp()
    pipeline = Pipeline.parse("trace,build-dag", REGISTRY) + order_pass(make_order) + Pipeline.parse(
        "split{stages=2},emit", REGISTRY)
    with pytest.raises(InvalidArgumentError, match="the 'order' artifact is not a topological order") as info:
        run_pipeline(model, pipeline, ExampleInputs(inputs))
    assert re.search(message, str(info.value))
    assert "in pass 'split' (position 3)" in info.value.__notes__[0]


def test_a_partition_built_without_checks_is_refused_by_emit_with_what_is_wrong():
    """``Partition(assignment, k)`` and ``dataclasses.replace`` skip ``from_assignment``'s checks; a pass
    moving a node behind its reader crashed emit with a bare KeyError."""
    @function_pass("move-last-back", requires=("partition", "order"), provides=("partition",), register=False)
    def move_last_back(program, ctx):
        """Put the last node in stage 0."""
        assignment = {**program.partition.assignment, program.order[-1]: 0}
        return dataclasses.replace(program, partition=Partition(assignment, program.partition.num_stages))

    model, inputs = mlp()
    pipeline = (Pipeline.parse("trace,build-dag,linearize,split{stages=2}", REGISTRY) + move_last_back()
                + Pipeline.parse("emit", REGISTRY))
    with pytest.raises(InvalidArgumentError, match=r"the 'partition' artifact is not a valid split of the DAG: "
                                                   r"ordered: backward edge .*Partition\.from_assignment"):
        run_pipeline(model, pipeline, ExampleInputs(inputs))


def test_a_copied_spec_naming_a_cost_function_says_to_pass_the_function():
    """``cost=fn`` shows as ``cost=custom-fn`` in specs and notes; run again without the function, the
    name is not a misspelt cost model."""
    model, inputs = mlp()
    pipeline = Pipeline.parse("trace,build-dag,linearize,split{stages=2 cost=custom-mycost},emit", REGISTRY)
    with pytest.raises(InvalidArgumentError, match=r"'custom-mycost' is the name a cost function passed as "
                                                   r"shard_model\(\.\.\., cost=fn\) goes by"):
        run_pipeline(model, pipeline, ExampleInputs(inputs))


def test_a_cost_needing_shape_prop_names_every_capture_pass_it_may_follow():
    model, inputs = mlp()
    with pytest.raises(PipelineValidationError, match=r"add `shape-prop` after the capture \(`capture`, `export` or "
                                                      r"`trace`\) and before `build-dag` \(position 1\)"):
        run(model, inputs, "split{stages=2 cost=flops}")


@pytest.mark.parametrize("spec, moves, coarsen", [
    ("split{stages=3}", True, True),
    ("split{stages=3 moves=false}", False, True),
    ("split{stages=3 coarsen=false}", True, False),
])
def test_min_cut_fast_modes_can_be_chosen_from_a_spec(monkeypatch, spec, moves, coarsen):
    """``moves=false`` and ``coarsen=false`` are the fast modes: the options must reach the splitter,
    and the split stays valid."""
    import autoshard.costs.split_search.placements as split_module

    seen = []
    real = split_module.split_dag

    def recording(*args, **kwargs):
        seen.append((kwargs.get("moves"), kwargs.get("coarsen")))
        return real(*args, **kwargs)

    monkeypatch.setattr(split_module, "split_dag", recording)
    model, inputs = mlp()
    program = run(model, inputs, spec)
    assert seen and set(seen) == {(moves, coarsen)}
    assert len(program.sharded.stages) == 3 and torch.equal(program.sharded(*inputs), model(*inputs))


def wide_blocks(blocks: int = 3) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Blocks of Linear(16, 64), ReLU, Linear(64, 16): the best balance of two stages cuts inside one,
    sending its 64-wide hidden value; a cut between blocks sends 16 wide."""
    torch.manual_seed(0)
    layers = [layer for _ in range(blocks) for layer in (nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))]
    return nn.Sequential(*layers).eval(), (torch.randn(8, 16),)


def test_shard_model_trades_balance_within_its_tolerance_for_fewer_boundary_bytes():
    model, inputs = wide_blocks()
    tight = autoshard.shard_model(model, 2, inputs).plan.split_info
    loose = autoshard.shard_model(model, 2, inputs, tolerance=0.5)
    info = loose.plan.split_info
    assert info.boundary_bytes == tight.boundary_bytes / 4  # a 16-wide value instead of a 64-wide one
    assert tight.bottleneck < info.bottleneck <= 1.5 * tight.bottleneck
    assert torch.equal(loose(*inputs), model(*inputs))


def test_a_tolerance_the_pipeline_sets_otherwise_or_cannot_take_is_refused():
    model, inputs = wide_blocks(1)
    with pytest.raises(InvalidArgumentError, match=r"has tolerance=0.2 but shard_model was asked for tolerance=0.5"):
        autoshard.shard_model(model, 2, inputs, tolerance=0.5,
                              pipeline="capture,shape-prop,build-dag,linearize,split{tolerance=0.2},emit")
    with pytest.raises(InvalidArgumentError, match=r"tolerance= was given, but no pass of the pipeline"):
        autoshard.shard_model(model, 1, inputs, tolerance=0.5, pipeline="capture,emit")
    with pytest.raises(InvalidArgumentError, match=r"tolerance must be finite and >= 0, got -1"):
        autoshard.shard_model(model, 2, inputs, tolerance=-1)


def test_shard_model_verifies_the_stages_unless_told_not_to(monkeypatch):
    from autoshard.passes.verify import VerifyPass

    ran = []
    real = VerifyPass.run
    monkeypatch.setattr(VerifyPass, "run", lambda self, program, ctx: ran.append(1) or real(self, program, ctx))
    model, inputs = wide_blocks(1)
    autoshard.shard_model(model, 2, inputs)
    assert ran == [1]
    for pipeline in (None, "capture,shape-prop,build-dag,linearize,split,emit,verify"):
        sharded = autoshard.shard_model(model, 2, inputs, pipeline=pipeline, verify=False)
        assert ran == [1] and torch.equal(sharded(*inputs), model(*inputs))
    with pytest.raises(autoshard.InvalidArgumentTypeError, match="verify must be True or False, got 'no'"):
        autoshard.shard_model(model, 2, inputs, verify="no")
