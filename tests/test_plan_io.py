"""Plans as files: saved, read back, rebuilt into the same stages, and hand edits checked."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autoshard
from autoshard.api import default_pipeline
from autoshard.errors import PlanError
from autoshard.examples import load_example
from autoshard.passes import PassContext, PassRegistry, Pipeline, ShardProgram, default_registry
from autoshard.passes.base import ExampleInputs
from autoshard.passes.plan import LoadPartitionPass
from autoshard.plan_io import (
    load_plan,
    plan_from_dict,
    plan_from_program,
    read_plan,
    rebuild_pipeline,
    report_costs,
    save_plan,
)


def make_plan(model: nn.Module, k: int, args: tuple = (), pipeline: Pipeline | None = None):
    """Run a pipeline up to its split and return the plan and the program."""
    pipeline = pipeline or default_pipeline(k, verify=bool(args))
    inputs = ExampleInputs(args) if args else None
    ctx = PassContext()
    program = pipeline.run(ShardProgram(model=model, example_inputs=inputs), ctx).program
    reported = report_costs(program, ctx, "params")
    plan = plan_from_program(program, str(pipeline), "params", reported.costs, time_estimate=reported.time_estimate)
    return plan, program


@pytest.fixture(scope="module")
def residual():
    model, args, _ = load_example("residual-mlp")
    plan, program = make_plan(model, 4, args)
    return model, args, plan, program


@pytest.fixture
def saved(residual, tmp_path):
    return save_plan(residual[2], tmp_path / "plan.json")


def edited(path, change) -> dict:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return data


def node(data: dict, name: str) -> dict:
    return next(n for n in data["nodes"] if n["name"] == name)


def model_input(data: dict) -> dict:
    return next(n for n in data["nodes"] if n.get("input"))


# --------------------------------------------------------------------------------------------
# Saving and reading
# --------------------------------------------------------------------------------------------
def test_the_file_holds_nodes_modules_costs_boundaries_pipeline_and_versions(residual, saved):
    _, _, plan, program = residual
    data = json.loads(saved.read_text())
    assert {n["name"]: n["stage"] for n in data["nodes"]} == dict(program.partition.assignment)
    assert data["modules"]["linears.0"] == 0 and data["modules"]["linears.7"] == 3
    assert data["modules"]["linears"] == [0, 1, 2, 3]
    assert node(data, "linears_0")["costs"]["params"] == 16 * 16 * 4 + 16 * 4
    assert data["summary"]["stage_costs"] == [2176, 2176, 2176, 2176]
    assert data["boundaries"] == [["add_1"], ["add_3"], ["add_5"]]
    assert data["pipeline"] == str(default_pipeline(4, verify=True))
    assert data["versions"]["torch"] == torch.__version__
    assert data["versions"]["autoshard"] == autoshard.__version__
    assert ["x", "linears_0"] in data["edges"]


def test_read_back_equals_what_was_saved(residual, saved):
    plan = residual[2]
    again = read_plan(saved)
    assert again == plan
    assert again.to_dict() == plan.to_dict()
    assert again.weights == plan.weights and again.time_estimate == plan.time_estimate and again.split == plan.split


def test_the_file_says_how_the_split_was_made_and_what_each_stage_needs(residual, saved):
    _, _, plan, program = residual
    data = json.loads(saved.read_text())
    info = program.partition.info
    assert data["split"]["strategy"] == info.strategy == "min-cut"
    assert data["split"]["bottleneck"] == info.bottleneck and data["split"]["tolerance"] == 0.0
    assert data["time_estimate"]["model"] == "roofline" and data["summary"]["stage_seconds"]["source"] == "estimated"
    assert data["weights"]["linears.0.weight"] == {"aliases": ["linears.0.weight"], "numel": 256, "bytes": 1024,
                                                   "kind": "parameter", "trainable": True, "device": "cpu"}
    assert node(data, "linears_0")["weights"] == ["linears.0.weight", "linears.0.bias"]
    assert node(data, "linears_0")["allocated"] == node(data, "linears_0")["bytes"]
    assert [s["in_flight"] for s in data["summary"]["training_memory"]["stages"]] == [4, 3, 2, 1]
    assert plan.split_is_current


def test_saving_is_deterministic(residual, tmp_path):
    plan = residual[2]
    assert save_plan(plan, tmp_path / "a.json").read_bytes() == save_plan(plan, tmp_path / "b.json").read_bytes()


def test_one_line_per_node_so_a_person_can_edit_it(saved):
    lines = saved.read_text().splitlines()
    assert sum('"name": "linears_' in line and '"stage": ' in line for line in lines) == 8


# --------------------------------------------------------------------------------------------
# Rebuilding
# --------------------------------------------------------------------------------------------
def test_load_plan_rebuilds_the_same_stages(residual, saved):
    model, args, _, _ = residual
    original = autoshard.shard_model(model, 4, example_inputs=args)
    rebuilt = load_plan(saved, model, args)
    assert rebuilt.plan.assignment == original.plan.assignment
    assert rebuilt.plan.boundaries == original.plan.boundaries
    assert [s.code for s in rebuilt.stages] == [s.code for s in original.stages]
    assert torch.equal(rebuilt(*args), model(*args))
    assert rebuilt.plan.split_info is not None
    assert rebuilt.plan.split_info == read_plan(saved).split.info == original.plan.split_info


def test_a_read_plan_given_to_plan_report_is_refused_saying_how_to_report_it(residual, saved):
    model, args, _, _ = residual
    with pytest.raises(autoshard.InvalidArgumentTypeError, match=r"got a SavedPlan .* holds no stages: report the "
                       r"stages it makes, plan_report\(autoshard.load_plan\(path, model, example_inputs\)\)"):
        autoshard.plan_report(read_plan(saved))
    assert len(autoshard.plan_report(load_plan(saved, model, args)).stages) == 4  # as it says


def test_a_hand_moved_node_is_used(residual, saved):
    """Moving linears_2 (and the add after it) back into stage 0 is a valid edit, and it sticks."""
    model, args, _, _ = residual

    def move(data):
        node(data, "linears_2")["stage"] = 0
        node(data, "add_2")["stage"] = 0
        del data["modules"]

    edited(saved, move)
    rebuilt = load_plan(saved, model, args)
    assert rebuilt.plan.assignment["linears_2"] == 0
    assert rebuilt.plan.split_info is None, "the splitter's record no longer describes an edited plan"
    assert rebuilt.plan.boundaries[0] == ("add_2",)
    assert torch.equal(rebuilt(*args), model(*args))


def test_load_partition_runs_from_a_text_spec(residual, saved):
    model, args, plan, program = residual
    registry = PassRegistry()
    for cls in [*default_registry.passes(), LoadPartitionPass]:
        if cls.name not in registry:
            registry.register(cls)
    spec = plan.pipeline.replace("split{stages=4}", f'load-partition{{path="{saved}"}}')
    assert "load-partition" in spec
    result = Pipeline.parse(spec, registry).run(ShardProgram(model=model, example_inputs=ExampleInputs(args)))
    assert dict(result.program.partition.assignment) == dict(program.partition.assignment)


def test_rebuild_pipeline_swaps_the_split_and_can_drop_verify(residual, saved):
    plan = residual[2]
    steps = [step.name for step in rebuild_pipeline(plan, saved)]
    assert steps == ["load-partition" if s.name == "split" else s.name for s in Pipeline.parse(plan.pipeline)]
    assert steps[-2:] == ["emit", "verify"]
    assert "verify" not in [step.name for step in rebuild_pipeline(plan, saved, verify=False)]


@pytest.mark.parametrize("constraint", [{"cut_before": ["2"]}, {"pin": {"0": 0}}, {"no_split": ["1"]}])
def test_a_plan_made_under_constraints_loads_without_them(constraint, tmp_path):
    """The constraint passes instruct the split alone, which a saved plan replaces: kept, the rebuilt
    pipeline refused to run ('provides constraints, but no pass reads it')."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), torch.randn(2, 8)
    sharded = autoshard.shard_model(model, 2, (x,), **constraint)
    rebuilt = load_plan(sharded.save_plan(tmp_path / "plan.json"), model, (x,))
    assert rebuilt.plan.assignment == sharded.plan.assignment and torch.equal(rebuilt(x), model(x))


def test_a_plan_for_another_model_is_refused(saved):
    other = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    with pytest.raises(PlanError, match="was made for another graph.*ResidualMLP.*torch"):
        load_plan(saved, other, torch.randn(2, 16))


class WithLabels(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, labels=None):
        for layer in self.layers:
            x = layer(x)
        return x if labels is None else ((x - labels) ** 2).mean()


@pytest.mark.parametrize("saved_kwargs,loaded_kwargs,change", [
    ({}, {"labels": True}, "'labels' added"), ({"labels": True}, {}, "'labels' left out")])
def test_a_plan_loaded_with_other_arguments_names_them(tmp_path, saved_kwargs, loaded_kwargs, change):
    """Other arguments than the plan's example change the graph; the refusal names the arguments (not a
    node such as 'labels_unchecked') and says to pass the plan's, whose stages then take the others too."""
    model, x = WithLabels(), torch.randn(2, 8)
    path = autoshard.shard_model(model, 2, (x,), {k: x for k in saved_kwargs}).save_plan(tmp_path / "plan.json")
    planned = "'x', 'labels'" if saved_kwargs else "'x'"
    with pytest.raises(PlanError, match=rf"made for a call with the arguments {planned}, .*\({change}\).*"
                                        rf"Pass example inputs for the same arguments \({planned}\) to load_plan"):
        load_plan(path, model, (x,), {k: x for k in loaded_kwargs})
    rebuilt = load_plan(path, model, (x,), {k: x for k in saved_kwargs})
    assert torch.equal(rebuilt(x, labels=x), model(x, labels=x)) and torch.equal(rebuilt(x), model(x))


# --------------------------------------------------------------------------------------------
# Hand edits that break the plan
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,reason", [
    (lambda d: node(d, "linears_1").update(stage=1),
     "ordered: backward edge 'linears_1' -> 'add_1' from stage 1 to stage 0"),
    (lambda d: [n.update(stage=0) for n in d["nodes"] if n["stage"] == 1], "non-empty: stage 1 has no"),
    (lambda d: node(d, "linears_7").update(stage=4), "range: node 'linears_7' is assigned to stage 4"),
    (lambda d: model_input(d).update(stage=1), "inputs: input node '[^']+' is in stage 1"),
])
def test_a_plan_breaking_an_invariant_is_rejected_with_the_reason(saved, change, reason):
    edited(saved, change)
    with pytest.raises(PlanError, match=f"breaks an invariant: .*({reason})"):
        read_plan(saved)


def test_an_edited_module_entry_that_disagrees_with_its_nodes_is_an_error(saved):
    edited(saved, lambda d: d["modules"].update({"linears.3": 2}))
    with pytest.raises(PlanError, match=r"modules\['linears.3'\] says 2 but its nodes are in 1.*edit.*\"stage\""):
        read_plan(saved)


def test_the_documented_edit_of_stage_fields_alone_loads(residual, saved):
    """The docs (docs/runtimes.md) say to edit the nodes' "stage" fields; the `modules` entries written before the edit
    (linears.2 in stage 1) were refused as disagreeing. Nodes that moved make them stale, not wrong."""
    model, args, _, _ = residual

    def move(data):
        assert data["modules"]["linears.2"] == 1
        node(data, "linears_2")["stage"] = 0
        node(data, "add_2")["stage"] = 0

    edited(saved, move)
    plan = read_plan(saved)
    assert plan.module_stages()["linears.2"] == 0 and not plan.split_is_current
    assert load_plan(saved, model, args).plan.assignment["linears_2"] == 0


def test_without_a_split_record_a_stale_module_entry_names_both_fields(saved):
    """Without the record nothing tells a stale entry from one edited in the wrong place: the error
    says to edit the nodes' "stage" and to update or delete the `modules` entry."""
    def move(data):
        del data["split"]
        node(data, "linears_2")["stage"] = 0
        node(data, "add_2")["stage"] = 0

    edited(saved, move)
    with pytest.raises(PlanError, match=r"modules\['linears.2'\] says 1 .*\"stage\" of its nodes.*update or delete"):
        read_plan(saved)


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(format="other"), "is not an autoshard plan"),
    (lambda d: d.update(format_version=99), "format_version is 99"),
    (lambda d: d.update(format_version=1), r"format_version is 1; this autoshard reads version 2.*make a new plan"),
    (lambda d: node(d, "add").update(stage="1"), r"nodes\[\d+\].stage must be int, got '1'"),
    (lambda d: node(d, "add").pop("stage"), r"nodes\[\d+\] has no 'stage'"),
    (lambda d: d["nodes"].append(dict(node(d, "linears_0"))), "list 'linears_0' twice"),
    (lambda d: d["edges"].append(["add", "nowhere"]), "names 'nowhere', which is not in nodes"),
    (lambda d: node(d, "add").update(readers=["nowhere"]), "names the reader 'nowhere', which is not in nodes"),
    (lambda d: node(d, "add")["costs"].update(params=float("nan")), "must be finite"),
    (lambda d: d["edges"].append(["add_7", "x"]), "inputs must be sources|cycle"),
    (lambda d: node(d, "linears_0").update(weights=["nowhere.weight"]),
     "node 'linears_0' reads the weight 'nowhere.weight', which is not in `weights`"),
    (lambda d: d["weights"]["linears.0.weight"].update(numel="256"),
     r"weights\['linears.0.weight'\].numel must be int"),
    (lambda d: d["time_estimate"].update(bandwidth=-1), "time_estimate a device model's bandwidth must be"),
    (lambda d: d["time_estimate"].update(model="magic"), "time_estimate.model must be \"roofline\""),
    (lambda d: d["split"].pop("assignment_digest"), "split has no 'assignment_digest'"),
    (lambda d: d["split"].update(proven_optimal="yes"), "split.proven_optimal must be bool"),
    (lambda d: node(d, "add")["training"].update(parts=[[1, 2, 3]]),
     r"training.parts must be a list of \[bytes, saved bytes\] pairs"),
    (lambda d: node(d, "add")["training"].update(part=[-1]), r"training.part must be a list of storage indices"),
])
def test_malformed_plans_say_what_and_where(saved, change, message):
    data = json.loads(saved.read_text())
    change(data)
    saved.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        read_plan(saved)


def test_not_json_and_missing_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(PlanError, match="not valid JSON.*line 1"):
        read_plan(bad)
    with pytest.raises(PlanError, match="cannot read the plan"):
        read_plan(tmp_path / "missing.json")


def test_plan_from_dict_accepts_the_derived_sections_missing(residual):
    data = residual[2].to_dict()
    for derived in ("summary", "boundaries", "modules"):
        del data[derived]
    assert plan_from_dict(data) == residual[2]


def test_a_plan_without_the_split_time_and_weight_sections_still_reads(residual):
    """Plans saved before these sections existed: readable, with what they cannot tell left unknown."""
    data = residual[2].to_dict()
    for section in ("split", "time_estimate", "weights"):
        del data[section]
    for entry in data["nodes"]:
        entry.pop("weights", None)
        entry.pop("allocated", None)
        entry["costs"].pop("time")
    plan = plan_from_dict(data)
    assert plan.split is None and not plan.split_is_current and plan.time_estimate is None
    assert plan.training_memory() is None and plan.stage_seconds() is None
    assert plan.assignment() == residual[2].assignment()


def test_a_plan_saved_with_two_stages_per_rank_under_1f1b_still_reads(residual):
    """Plans written before ``MemoryModel`` refused stages per rank for 1F1B saved the default 2 there,
    which counted for nothing; under interleaved 1F1B the saved count is kept."""
    data = residual[2].to_dict()
    data["memory_model"].update(schedule="1f1b", stages_per_rank=2)
    assert plan_from_dict(data).memory_model == autoshard.MemoryModel()
    data["memory_model"].update(schedule="interleaved-1f1b", stages_per_rank=4)
    assert plan_from_dict(data).memory_model.stages_per_rank == 4


def test_a_plan_measured_on_inputs_needs_inputs_to_rebuild(residual, saved):
    """The default pipeline with example inputs runs shape-prop, which cannot run without them."""
    model = residual[0]
    with pytest.raises(PlanError, match="runs shape-prop.*pass example inputs of the same kind to load_plan"):
        load_plan(saved, model)


def test_a_loaded_partition_with_another_stage_count_than_asked_is_refused(residual, saved):
    """shard_model promises exactly k stages; a pipeline whose partition comes from a plan of 4
    must not hand back 4 when 2 were asked for."""
    model, args = residual[0], residual[1]
    registry = PassRegistry()
    for cls in [*default_registry.passes(), LoadPartitionPass]:
        if cls.name not in registry:
            registry.register(cls)
    spec = f'trace,shape-prop,build-dag,linearize,load-partition{{path="{saved}"}},emit'
    with pytest.raises(autoshard.errors.InvalidArgumentError, match="2 stages were asked for but .* made 4"):
        autoshard.shard_model(model, 2, example_inputs=args, pipeline=Pipeline.parse(spec, registry))
    with pytest.raises(autoshard.errors.InvalidArgumentError, match="cost= was given, but no pass"):
        autoshard.shard_model(model, 4, example_inputs=args, cost="flops", pipeline=Pipeline.parse(spec, registry))
    assert len(autoshard.shard_model(model, 4, example_inputs=args,
                                     pipeline=Pipeline.parse(spec, registry)).stages) == 4


def test_a_plan_path_of_the_wrong_type_or_a_binary_file_is_refused(residual, tmp_path):
    model, args = residual[0], residual[1]
    with pytest.raises(autoshard.errors.InvalidArgumentTypeError, match="plan path must be a str"):
        autoshard.load_plan(None, model, args)
    binary = tmp_path / "plan.json"
    binary.write_bytes(b"\xff\xfe\x00plan")
    with pytest.raises(PlanError, match="not a text"):
        autoshard.load_plan(binary, model, args)
    with pytest.raises(autoshard.errors.InvalidArgumentTypeError, match="verify must be True or False, got 'no'"):
        autoshard.load_plan(binary, model, args, verify="no")  # (checked first: it verified)


def test_load_plan_keeps_the_memory_model_the_plan_was_made_for(residual, tmp_path):
    model, args, _, program = residual
    sgd = autoshard.MemoryModel(optimizer_bytes_per_param=0, microbatches=1)
    reported = report_costs(program, PassContext(), "params")
    plan = plan_from_program(program, str(default_pipeline(4)), "params", reported.costs,
                             time_estimate=reported.time_estimate, memory_model=sgd)
    rebuilt = load_plan(save_plan(plan, tmp_path / "sgd.json"), model, args)
    assert rebuilt.plan.memory_model == sgd
    assert [s.memory.total for s in autoshard.plan_report(rebuilt).stages] == \
        [s.total for s in autoshard.costs.memory.stage_memory(rebuilt.plan.dag, rebuilt.plan.assignment, 4, sgd)]


def test_a_plan_file_keeps_how_the_optimizer_steps_and_where_the_weights_were(tmp_path):
    """``optimizer_foreach``, ``keep_gradients`` and each weight's device round-trip; a plan whose weights were on a GPU
    counts torch's foreach step there when the model leaves the choice to torch (None)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    x = torch.randn(2, 16)
    foreach = autoshard.MemoryModel(microbatches=1, optimizer_foreach=True, keep_gradients=True)
    path = autoshard.shard_model(model, 2, (x,), memory_model=foreach).save_plan(tmp_path / "plan.json")
    assert read_plan(path).memory_model == foreach
    data = json.loads(path.read_text())
    assert {w["device"] for w in data["weights"].values()} == {"cpu"}
    default = autoshard.MemoryModel(microbatches=1)
    on_cpu = read_plan(path).training_memory(default)
    for weight in data["weights"].values():
        weight["device"] = "cuda"
    path.write_text(json.dumps(data))
    on_gpu, stepped_at_once = read_plan(path).training_memory(default), read_plan(path).training_memory(foreach)
    assert [s.step_bytes for s in on_gpu] == [s.step_bytes for s in stepped_at_once] != [s.step_bytes for s in on_cpu]


def test_a_budgeted_plan_loaded_with_bigger_inputs_says_it_no_longer_fits(tmp_path):
    """A plan made under max_memory, loaded with a bigger microbatch, predicted stages several times
    the budget without a word (a new user's first hour)."""
    import warnings

    from autoshard.plan_io import StalePlanWarning

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 32)).train()
    small, big = torch.randn(8, 32), torch.randn(256, 32)
    fullest = max(s.memory.total for s in autoshard.plan_report(autoshard.shard_model(model, 2, (small,))).stages)
    path = autoshard.shard_model(model, 2, (small,), max_memory=1.2 * fullest).save_plan(tmp_path / "plan.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the inputs it was made for: silent
        load_plan(path, model, (small,))
    with pytest.warns(StalePlanWarning,
                      match=r"made under max_memory .* on these example inputs and training settings stage \d needs"):
        load_plan(path, model, (big,))


class TiedLM(nn.Module):
    """An embedding and a head that reuse one table, or not (``tie=False``), as GPT-2 and its untied
    variants do."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.body = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
        self.head = nn.Linear(16, 64, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


@pytest.mark.parametrize("made_tied", [True, False])
def test_a_plan_loaded_into_a_model_tied_otherwise_warns_and_drops_the_balance_it_recorded(tmp_path, made_tied):
    """A plan made with the head tied to the embedding, loaded into the model untied (or the other way
    round), was rebuilt without a word though the last stage holds a whole table more (or less) than
    the balance it recorded."""
    import warnings

    from autoshard.plan_io import StalePlanWarning

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 5))
    path = autoshard.shard_model(TiedLM(tie=made_tied), 2, (ids,)).save_plan(tmp_path / "plan.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # into the model it was made for: silent
        load_plan(path, TiedLM(tie=made_tied), (ids,))
    where = "in the plan, not here" if made_tied else "here, not in the plan"
    with pytest.warns(StalePlanWarning, match=f"'embed.weight' and 'head.weight' are one weight {where}"):
        rebuilt = load_plan(path, TiedLM(tie=not made_tied), (ids,))
    assert rebuilt.plan.split_info is None
