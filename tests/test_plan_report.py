"""The plan report: per stage, costs under each model, weights, and boundary values with shape,
dtype and bytes; plain data that serialises to JSON."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autoshard
from autoshard.costs.flops import flop_counter_mode
from autoshard.costs.memory import stage_memory
from autoshard.examples import load_example
from autoshard.plan_reporting import plan_report

from autoshard.examples import GPTStyleLM


def test_the_report_has_every_measured_cost_per_stage_and_adds_up():
    model, args, _ = load_example("transformer-lm")
    sharded = autoshard.shard_model(model, 3, example_inputs=args)
    report = plan_report(sharded)
    assert set(report.cost_models) == {"params", "nodes", "flops", "activations", "memory"}
    dag = sharded.plan.dag
    total_flops = sum(d["flops"] for _, d in dag.nodes(data=True))
    assert sum(s.costs["flops"] for s in report.stages) == total_flops
    assert sum(s.nodes for s in report.stages) == sum(1 for _, d in dag.nodes(data=True) if not d["input"])
    assert sum(s.param_count for s in report.stages) == sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers())
    for stage in report.stages:
        assert stage.memory is not None and stage.costs["memory"] == stage.memory.total
        assert stage.memory.in_flight == 3 - stage.index
    assert report.bottleneck("flops") == max(s.costs["flops"] for s in report.stages)


def test_boundary_values_in_the_report_match_what_the_stages_send():
    model, args, _ = load_example("transformer-lm")
    sharded = autoshard.shard_model(model, 3, example_inputs=args)
    report = plan_report(sharded)
    values = sharded.stages[0](*args)
    for j, stage in enumerate(sharded.stages[1:]):
        sent = report.stages[j].values_out
        assert sent == report.stages[j + 1].values_in
        assert [v.name for v in sent] == list(sharded.plan.boundaries[j])
        for described, actual in zip(sent, values):
            assert described.meta.shape == tuple(actual.shape)
            assert described.meta.dtype == str(actual.dtype).removeprefix("torch.")
            assert described.nbytes == actual.numel() * actual.element_size()
        values = stage(*values)


def test_the_report_is_json_and_lists_ties_and_extra_costs():
    torch.manual_seed(0)
    model = GPTStyleLM(vocab=100, width=32, layers=2).eval()
    idx = torch.randint(0, 100, (2, 8))
    sharded = autoshard.shard_model(model, 2, example_inputs=(idx,))
    ones = {n: 1.0 for n in sharded.plan.dag.nodes}
    report = plan_report(sharded, extra_costs={"mine": ones})
    data = json.loads(json.dumps(report.to_dict()))
    assert [s["costs"]["mine"] for s in data["stages"]] == [
        float(sum(1 for n, j in sharded.plan.assignment.items() if j == s)) for s in range(2)]
    (tie,) = [w for w in data["shared_weights"] if w["name"] == "wte.weight"]
    assert tie["aliases"] == ["wte.weight", "lm_head.weight"]
    first_out = data["stages"][0]["values_out"][0]
    assert first_out["value"]["kind"] == "tensor" and first_out["bytes"] == first_out["value"]["bytes"]
    assert first_out["text"].startswith("float32[")


def test_the_reports_data_holds_every_part_of_a_stages_training_memory():
    """to_dict() gave only the weight state, the saved activations, the microbatches in flight and the
    total: the received and sent values, one backward and the receive buffers the total also counts,
    which the tables name, were missing from the data."""
    model, args, _ = load_example("gpt-lm")
    sharded = autoshard.shard_model(model, 4, example_inputs=args)
    data = json.loads(json.dumps(plan_report(sharded).to_dict()))
    for stage, memory in zip(data["stages"], stage_memory(sharded.plan.dag, sharded.plan.assignment, 4)):
        assert stage["memory"]["total"] == memory.total
        for part in ("state_bytes", "weight_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes",
                     "received_bytes", "sent_bytes", "backward_bytes", "forward_bytes", "buffer_bytes", "in_flight"):
            assert stage["memory"][part] == getattr(memory, part)
    assert any(stage["memory"]["received_bytes"] and stage["memory"]["buffer_bytes"] for stage in data["stages"])


def test_the_report_carries_the_splitters_record_and_stage_times():
    model, args, _ = load_example("residual-mlp")
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    info = sharded.plan.split_info
    assert info is not None and info.strategy == "min-cut" and info.proven_optimal is None
    assert info.bottleneck == max(sharded.plan.stage_costs("params"))
    report = plan_report(sharded)
    assert report.split == info
    assert report.time_estimate is not None and report.time_estimate.calibrated
    assert all(stage.seconds > 0 for stage in report.stages)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["split"]["strategy"] == "min-cut" and data["time_estimate"]["model"] == "roofline"


def test_measured_times_are_reported_as_measured():
    model, args, _ = load_example("residual-mlp")
    sharded = autoshard.shard_model(model, 2, example_inputs=args, cost="time")
    report = plan_report(sharded)
    assert report.time_estimate is None
    assert [s.seconds for s in report.stages] == sharded.plan.stage_costs("time") == [
        s.costs["time"] for s in report.stages]


def test_print_shows_the_tables_the_cli_prints(capsys, monkeypatch):
    """One renderer: the report's text is the CLI's output for the same split, line for line, but for
    the title (the CLI names the TARGET, the report the model's class)."""
    from autoshard import cli

    monkeypatch.delenv("COLUMNS", raising=False)  # the CLI's width for a pipe, the report's for a string
    assert cli.main(["split", "residual-mlp", "-k", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    model, args, _ = load_example("residual-mlp")
    shown = str(plan_report(autoshard.shard_model(model, 2, example_inputs=args))).splitlines()
    assert printed[0].strip().startswith("residual-mlp: 2 stages (")
    assert shown[0].strip().startswith("ResidualMLP: 2 stages (")
    assert len(shown) > 10 and printed[1:len(shown)] == shown[1:]


def test_the_reports_data_names_the_models_own_operations_as_its_tables_do():
    """``(root)``, as the tables and pictures write it; ``<root>`` is the entry of a ``no-split=<root>``
    rule, where it means the whole model rather than the operations of its own forward."""
    model, args, _ = load_example("residual-mlp")  # the residual adds are the model's own operations
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    report = plan_report(sharded)
    assert [stage.modules for stage in report.stages] == [tuple(sharded.plan.modules(j)) for j in range(2)]
    assert all("(root)" in stage.modules for stage in report.stages), [stage.modules for stage in report.stages]
    assert "<root>" not in json.dumps(report.to_dict()) and "(root)" in str(report)


def test_the_report_renders_with_rich_in_a_notebook_and_reprs_in_one_line():
    import io

    import rich.console

    model, args, _ = load_example("transformer-lm")
    report = plan_report(autoshard.shard_model(model, 2, example_inputs=args))
    console = rich.console.Console(file=io.StringIO(), width=160, color_system=None)
    console.print(report)  # rich.print(report) goes through __rich_console__
    assert console.file.getvalue().rstrip("\n") == str(report)
    assert "kept whole by design" in str(report) and "(part): a module split between stages" in str(report)
    html = report._repr_html_()
    assert html.startswith("<!DOCTYPE html>") and "values crossing each boundary" in html
    assert repr(report) == ("<PlanReport: 2 stages, cost models params, nodes, flops, activations, memory; "
                            "print() it for the tables, .to_dict() for the data>")


def test_the_tables_follow_the_reports_device_and_extra_costs():
    model, args, _ = load_example("residual-mlp")
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    report = plan_report(sharded, extra_costs={"mine": {n: 1.0 for n in sharded.plan.dag.nodes}},
                         device=autoshard.DeviceModel(1e12, 1e12))
    assert report.plan.time_estimate == report.time_estimate
    header = next(line for line in str(report).splitlines() if line.startswith("┃"))
    assert "mine" in header


@pytest.mark.parametrize("column, costs, expected", [
    ("params", "ones", r"names a column 'params'; name it otherwise than the built-in columns \(params, "),
    ("mine", "partial", r"extra_costs\['mine'\] must give a cost for each node .*; it leaves out '"),
    ("mine", "unknown", r"; the DAG has no 'nope'"),
    ("mine", "nan", r"extra_costs\['mine'\]\[.*\] is float nan; each cost must be a finite number >= 0"),
    ("mine", "negative", r"is float -1.0; each cost must be a finite number >= 0"),
    ("mine", 5, r"extra_costs\['mine'\] must map each node's name to its cost, got int 5"),
])
def test_extra_costs_must_be_a_new_column_with_a_finite_cost_for_each_node(column, costs, expected):
    """A column named 'params' replaced the built-in numbers silently, a node left out was a KeyError,
    NaN and negative costs were summed."""
    model, args, _ = load_example("residual-mlp")
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    nodes = list(sharded.plan.dag.nodes)
    given = {"ones": dict.fromkeys(nodes, 1.0), "partial": {nodes[-1]: 1.0},
             "unknown": {**dict.fromkeys(nodes, 1.0), "nope": 1.0}, "nan": dict.fromkeys(nodes, float("nan")),
             "negative": dict.fromkeys(nodes, -1.0)}.get(costs, costs)
    with pytest.raises((autoshard.errors.InvalidArgumentError, autoshard.errors.InvalidArgumentTypeError),
                       match=expected):
        plan_report(sharded, extra_costs={column: given})


def test_stages_without_an_origin_say_why_there_are_no_tables():
    model, args, _ = load_example("residual-mlp")
    report = plan_report(autoshard.shard_model(model, 2, example_inputs=args).plan)  # a StagePlan alone
    assert report.plan is None and str(report).startswith("no tables: these stages record no pipeline spec")


def test_the_public_plan_report_stays_the_function_after_its_module_is_imported():
    import importlib

    import autoshard
    first = autoshard.plan_report
    importlib.import_module(first.__module__)
    assert callable(autoshard.plan_report) and autoshard.plan_report is first


class _TiedTwiceInPlace(nn.Module):
    """A tied head, a layer called twice, an in-place write and attention: what per-node sums can miscount."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.l1, self.l2 = nn.Embedding(50, 16), nn.Linear(16, 48), nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.l1(self.emb(ids)).unsqueeze(1).chunk(3, dim=-1)
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)
        h = torch.relu_(self.l2(h))
        return self.head(self.l2(h))


@pytest.mark.parametrize("k", [2, 3])
def test_stage_flops_and_weights_are_what_each_stage_module_runs_and_holds(k):
    """Each stage module run alone on the values it receives: the FLOPs torch counts and the distinct
    parameters and buffers it holds (a tied weight once in every stage holding it) are the report's."""
    torch.manual_seed(0)
    model, ids = _TiedTwiceInPlace().eval(), torch.randint(0, 50, (2, 12))
    sharded = autoshard.shard_model(model, k, example_inputs=(ids,), cost="flops")
    report = plan_report(sharded)
    values: tuple = (ids,)
    for stage, described in zip(sharded.stages, report.stages):
        counter = flop_counter_mode()
        with counter, torch.no_grad():
            out = stage(*values)
        assert described.costs["flops"] == counter.get_total_flops()
        held = {id(t): t for t in [*stage.parameters(), *stage.buffers()]}.values()
        assert described.param_bytes == sum(t.numel() * t.element_size() for t in held)
        assert described.param_count == sum(t.numel() for t in held)
        values = out
    assert sum(s.costs["flops"] for s in report.stages) == flop_counter_mode_total(model, ids)


def flop_counter_mode_total(model: nn.Module, *args: torch.Tensor) -> int:
    counter = flop_counter_mode()
    with counter, torch.no_grad():
        model(*args)
    return counter.get_total_flops()


class Recurrents(nn.Module):
    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.LSTM(8, 8, batch_first=True) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)[0]
        return x


def test_the_report_names_the_nodes_whose_memory_was_not_measured():
    """A fused LSTM's fake kernel cannot size its workspace: where shape propagation runs fake tensors,
    the report says the layers' memory is a stand-in, and how to check a budget. Where it runs real
    ones, those layers, and the branched example's blocks, which fake tensors cannot run at all,
    are probed on them."""
    x = torch.randn(2, 4, 8)
    pipeline = "capture,shape-prop{mode=fake},build-dag,linearize,split{stages=2},emit"
    text = " ".join(str(autoshard.plan_report(autoshard.shard_model(Recurrents(), 2, example_inputs=(x,),
                                                                    pipeline=pipeline))).split())
    assert ("train mem: 6 nodes not measured (layers_0, layers_1, layers_2, layers_3, layers_4 and 1 more: fake "
            "tensors could not run or size them, nor could a real run) count their output bytes as saved") in text
    sharded = autoshard.shard_model(Recurrents(), 2, example_inputs=(x,))
    assert "not measured" not in str(autoshard.plan_report(sharded))
    for name in ("branched", "gpt-lm"):
        model, args, _ = load_example(name)
        assert "not measured" not in str(autoshard.plan_report(autoshard.shard_model(model, 2, example_inputs=args)))


@pytest.mark.parametrize("wrong, expected", [
    ({"step": "gpipe"}, r"step must be a StepTimeModel, got str 'gpipe': StepTimeModel\('gpipe'\)"),
    ({"memory": "gpipe"}, "memory must be a MemoryModel, got str"),
    ({"device": 1e12}, "device must be a DeviceModel, got float"),
    ({"extra_costs": [1.0]}, "extra_costs must map a column name to per-node costs, got list"),
])
def test_an_argument_of_the_wrong_type_is_refused_naming_what_to_pass(wrong, expected):
    # each was an AttributeError deep inside the report ('str' object has no attribute 'backward_ratio')
    model, args, _ = load_example("residual-mlp")
    sharded = autoshard.shard_model(model, 2, example_inputs=args)
    with pytest.raises(autoshard.errors.InvalidArgumentTypeError, match=expected):
        plan_report(sharded, **wrong)
    with pytest.raises(autoshard.errors.InvalidArgumentTypeError, match="takes a ShardedModel .* got ResidualMLP"):
        plan_report(model)


class _WidthBranch(nn.Module):
    """Branches on a width its convolutions computed: in training mode the plan checks it over the input's size."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.net(x)
        return y * 2 if y.shape[-1] > 10 else y


class _DictOfTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.a, self.b = nn.Embedding(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.b(self.a(self.embed(batch["ids"]) + batch["x"]))


def test_the_report_says_what_inputs_the_plan_serves():
    """The input guard's checks, its conditions over the inputs' sizes in arithmetic as one writes it
    (sympy's ``(-4) + x.shape[3]`` reads ``x.shape[3] - 4``), in the tables and the data."""
    sharded = autoshard.shard_model(_WidthBranch().train(), 2, (torch.randn(2, 3, 16, 16),))
    report = autoshard.plan_report(sharded)
    assert report.inputs == sharded.served_inputs() == report.to_dict()["inputs"]
    assert report.inputs.startswith("x; where ") and "x.shape[3] - 4 > 10" in report.inputs
    assert " ".join(str(report).split()).endswith(f"inputs served: {report.inputs}")  # (wrapped to the width)
    plain = autoshard.shard_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 2, (torch.randn(2, 4),))
    assert autoshard.plan_report(plain).inputs is None  # no guard: nothing said
    # a container's tensors with the dtypes its layout checks, as a lone tensor's (it gave their names alone)
    batch = {"ids": torch.tensor([[1, 2]]), "x": torch.randn(1, 2, 4)}
    held = autoshard.shard_model(_DictOfTwo(), 2, (batch,))
    assert held.served_inputs() == "batch['ids']: int64, batch['x']: float32"
    assert "inputs served" not in str(autoshard.plan_report(plain))
