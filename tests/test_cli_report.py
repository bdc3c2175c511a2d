"""What the tables say about a plan: module ranges, costs, the bottleneck and the boundaries."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from rich.console import Console

from autoshard.capture.result import WrappedLeaf
from autoshard.costs.estimate import DeviceModel
from autoshard.errors import InvalidArgumentError
from autoshard.graph import SplitInfo
from autoshard.plan_io import PlanNode, SavedPlan, SplitRecord, assignment_digest
from autoshard.report import (
    boundary_table,
    compare_tables,
    compress_module_ranges,
    format_cost,
    how_made_lines,
    human_bytes,
    kept_whole_why,
    module_legend,
    plan_renderables,
    stage_modules,
    stage_rows,
    stage_table,
    summary_lines,
    value_columns,
    wrapped_tables,
)

TENSOR = {"kind": "tensor", "shape": [4, 16], "dtype": "float32", "bytes": 256}


def hand_plan(stages: dict[str, int] | None = None, sized: bool = True, k: int = 2) -> SavedPlan:
    """x -> enc.layers.0 -> .1 -> .2 -> enc.norm -> add(x, norm): a skip over an encoder."""
    placed = {"x": 0, "l0": 0, "l1": 0, "l2": 1, "norm": 1, "add": 1, **(stages or {})}
    spec = [("x", "", 0.0), ("l0", "enc.layers.0", 10.0), ("l1", "enc.layers.1", 10.0),
            ("l2", "enc.layers.2", 10.0), ("norm", "enc.norm", 2.0), ("add", "", 0.0)]
    nodes = tuple(
        PlanNode(name=name, stage=placed[name], op="placeholder" if name == "x" else "call_module", target=module,
                 module=module, costs={"params": cost, "flops": 3 * cost}, bytes=256.0 if sized else 1.0,
                 param_bytes=cost, input=name == "x", output=name == "add", value=TENSOR if sized else None)
        for name, module, cost in spec
    )
    edges = (("x", "l0"), ("l0", "l1"), ("l1", "l2"), ("l2", "norm"), ("norm", "add"), ("x", "add"))
    return SavedPlan(num_stages=k, cost_model="params", pipeline="trace,build-dag,linearize,split{stages=2},emit",
                     model="Skip", versions={}, nodes=nodes, edges=edges,
                     wrapped=(WrappedLeaf("module", "enc.layers.2", "TraceError: control flow [on values]"),))


def rendered(table) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(table)
    return console.file.getvalue()


def test_compress_module_ranges():
    assert compress_module_ranges(["layers.0", "layers.1", "layers.2", "head"]) == ["layers.0-2", "head"]
    assert compress_module_ranges(["a.0.attn", "a.1.attn", "a.3.attn"]) == ["a.0-1.attn", "a.3.attn"]


def test_stage_modules_are_as_coarse_as_possible_and_ranged():
    plan = hand_plan()
    assert stage_modules(plan, 0) == ["enc.layers.0-1"]
    assert stage_modules(plan, 1) == ["enc.layers.2", "enc.norm", "(root)"]


def test_a_whole_module_is_named_once_and_a_split_one_is_marked():
    whole = hand_plan({"l2": 0, "norm": 0})
    assert stage_modules(whole, 0) == ["enc"]
    assert stage_modules(hand_plan({"l2": 0}), 0) == ["enc.layers.0-2"]  # a whole numbered list reads as its range
    assert stage_modules(hand_plan({"l1": 1}), 0) == ["enc.layers.0"]


def test_stage_rows_add_costs_sizes_and_boundaries():
    rows = stage_rows(hand_plan())
    assert [r.costs["params"] for r in rows] == [20.0, 12.0]
    assert [r.costs["flops"] for r in rows] == [60.0, 36.0]
    assert [r.nodes for r in rows] == [2, 3]  # the input is not stage content
    assert rows[0].values_out == ("x", "l1") and rows[1].values_in == ("x", "l1")
    assert rows[0].bytes_out == 512.0 and rows[0].activation_bytes == 512.0


def test_summary_gives_the_bottleneck_over_its_lower_bound_and_the_traffic():
    bottleneck, traffic = summary_lines(hand_plan())
    assert "stage 0 at 20 B = 1.250× the lower bound 16 B" in bottleneck
    assert "total / 2 = 16 B" in bottleneck and "largest node = 10 B" in bottleneck
    assert traffic == "boundaries: 2 value crossings, 512 B in total, largest boundary 512 B"


def test_a_stage_computing_nothing_the_costs_count_is_said():
    """A plan of more stages than the model's work fills (8 of a small transformer LM: three passed values on)."""
    assert not any("nothing the costs count" in line for line in summary_lines(hand_plan()))
    idle = summary_lines(hand_plan({"l0": 1, "l1": 1}))[-1]
    assert idle.startswith("stage 0 computes nothing the costs count (params, flops: 0)")


def test_unmeasured_sizes_are_counted_as_values_not_bytes():
    traffic = summary_lines(hand_plan(sized=False))[1]
    assert traffic == "boundaries: 2 value crossings, 2 values in total, largest boundary 2 values"


def test_stage_table_has_a_column_per_cost_model_and_one_row_per_stage():
    text = rendered(stage_table(hand_plan(), "title [with brackets]"))
    assert "title [with brackets]" in text
    assert "params (split)" in text and "flops" in text and "activations" in text
    assert "enc.layers.0-1" in text and "512 B: x, l1" in text and "(model output)" in text


def test_the_activations_column_is_marked_when_the_split_balanced_it():
    """``--cost activations`` has no column of its own: the activations column is what was balanced."""
    plan = hand_plan()
    nodes = tuple(replace(n, costs={**n.costs, "activations": n.bytes}) for n in plan.nodes)
    assert "activations (split)" in rendered(stage_table(replace(plan, nodes=nodes, cost_model="activations"), "t"))
    assert "activations (split)" not in rendered(stage_table(hand_plan(), "t"))


def test_boundary_and_wrapped_tables_show_shapes_and_reasons_verbatim():
    boundaries = rendered(boundary_table(hand_plan()))
    assert "0 → 1" in boundaries and "[4, 16]" in boundaries and "float32" in boundaries
    (failed,) = wrapped_tables(hand_plan())
    wrapped = rendered(failed)
    assert "could not be traced" in wrapped and "enc.layers.2" in wrapped and "control flow [on values]" in wrapped


def test_code_kept_whole_by_design_is_apart_from_code_that_could_not_be_traced():
    """PyTorch's own helpers, fused paths and code that keeps state run whole on purpose: nothing to fix,
    so they are not listed as failures; what could not be traced says why in words, beside its error."""
    kept = (
        WrappedLeaf("function", "torch.nn.functional._none_or_dtype",
                    "RuntimeError: input to _none_or_dtype() must be None or torch.Tensor (at functional.py:6619)"),
        WrappedLeaf("module", "enc.layers.0", "StateWrite: the forward stores a value it computed in its buffer "
                    "'count' (at model.py:12)"),
        WrappedLeaf("module", "enc.layers.1", "kept whole by design: PyTorch's fused inference path (eval mode)"),
        WrappedLeaf("module", "enc.layers.2", "TraceError: symbolically traced variables cannot be used as inputs "
                    "to control flow (at model.py:30)"),
    )
    design, failed = (rendered(t) for t in wrapped_tables(replace(hand_plan(), wrapped=kept)))
    assert "kept whole by design" in design and "could not be traced" in failed
    assert "_none_or_dtype" in design and "PyTorch's own helper" in design and "RuntimeError" not in design
    assert "stores a value it computed in its buffer 'count'" in design and "model.py:12" not in design
    assert "PyTorch's fused inference path (eval mode)" in design
    assert "enc.layers.2" in failed and "enc.layers.2" not in design
    assert "a Python branch or loop on a tensor's value" in failed and "TraceError: symbolically" in failed


def test_the_captures_own_reasons_for_keeping_code_whole_read_as_by_design():
    """A plan file keeps only the reason's text, so the prefix the capture writes is what marks it."""
    from autoshard.capture.fast_paths import FUSED_REASON, PACKED_REASON

    for reason in (FUSED_REASON, PACKED_REASON):
        by_design, why = kept_whole_why(WrappedLeaf("module", "encoder", reason))
        assert by_design and reason.endswith(why) and not why.startswith("kept whole")


def in_modules(plan: SavedPlan, modules: dict[str, str]) -> SavedPlan:
    """``plan`` with the nodes named in ``modules`` moved into those modules."""
    return replace(plan, nodes=tuple(replace(n, module=modules.get(n.name, n.module)) for n in plan.nodes))


def test_a_legend_explains_part_and_root_when_the_table_shows_them():
    split_block = in_modules(hand_plan(), {"l1": "enc.mix", "l2": "enc.mix"})  # one module over both stages
    assert stage_modules(split_block, 0) == ["enc.layers.0", "enc.mix (part)"]
    legend = module_legend(split_block)
    assert legend == ("(part): a module split between stages, listed in each stage that runs some of it; "
                      "(root): operations written in the model's own forward, outside any submodule")
    assert module_legend(in_modules(hand_plan(), {"add": "head"})) is None  # neither shown: no legend
    shown = [rendered(r) for r in plan_renderables(split_block, "t")]
    assert shown[1].startswith("(part): a module split between stages")  # right under the stage table


def test_compare_tables_put_strategies_side_by_side():
    summary, stages = compare_tables({"a": hand_plan(), "b": hand_plan({"l1": 1})})
    ratios = rendered(summary)
    assert "1.250" in ratios and "1.375" in ratios  # a: 20 / 16; b: stage costs 10 and 22, so 22 / 16
    assert "20 B, 12 B" in ratios and "10 B, 22 B" in ratios
    per_stage = rendered(stages)
    assert "enc.layers.0-1" in per_stage and "enc.layers.1-2" in per_stage


@pytest.mark.parametrize("model,value,shown", [
    ("params", 3 * 1024 * 1024, "3.0 MiB"), ("flops", 2.5e9, "2.5 G"), ("time", 0.0125, "12.500 ms"),
    ("time", 4.25e-6, "4.2 µs"), ("time", 2.5, "2.500 s"), ("time", 0.0, "0.000 ms"), ("nodes", 7, "7"),
])
def test_costs_are_shown_in_their_unit(model, value, shown):
    assert format_cost(model, value) == shown


@pytest.mark.parametrize("value,columns", [
    (None, ("?", "?")),
    (TENSOR, ("[4, 16]", "float32")),
    ({"kind": "constant", "type": "int", "value": "4"}, ("4", "int")),
    ({"kind": "tuple", "keys": ["0", "1"],
      "items": [TENSOR, {"kind": "constant", "type": "NoneType", "value": "None"}]},
     ("tuple of 2", "float32")),
])
def test_value_columns_describe_each_kind_of_value(value, columns):
    assert value_columns(value) == columns


def recorded(plan: SavedPlan, **info) -> SavedPlan:
    """``plan`` as if the splitter had made it, saying ``info`` about its split."""
    split = SplitInfo(**{"strategy": "exact", "bound": 20.0, "bottleneck": 20.0, "boundary_bytes": 512.0,
                         "tolerance": 0.05, **info})
    digest = assignment_digest((n.name, n.stage) for n in plan.nodes)
    return replace(plan, split=SplitRecord(split, digest))


def test_how_the_split_was_made_is_told_plainly():
    plan = recorded(hand_plan(), proven_optimal=False, separated=("enc.layers.0.weight",))
    (line,) = how_made_lines(plan)
    assert line == ("split: exact, tolerance 0.05, bound 20 B per stage, not proven optimal (the solver stopped "
                    "early); tied weights it had to place apart: enc.layers.0.weight")
    edited = replace(hand_plan({"l2": 0}), split=plan.split)
    assert how_made_lines(edited)[0].endswith("then edited by hand: the stages are no longer the splitter's")


def test_time_is_labelled_measured_or_estimated():
    timed = replace(hand_plan(), nodes=tuple(replace(n, costs={**n.costs, "time": 0.002}) for n in hand_plan().nodes))
    measured = rendered(stage_table(timed, "t"))
    assert "time (measured)" in measured and "6.000 ms" in measured  # x, l0, l1 at 2 ms each (the input too)
    estimated = replace(timed, time_estimate=DeviceModel(1e12, 1e9))
    assert "time (est.)" in rendered(stage_table(estimated, "t"))
    assert "1 TFLOP/s, 1 GB/s (given)" in how_made_lines(estimated)[0]
    assert "time" in rendered(stage_table(hand_plan(), "t")) and "?" in rendered(stage_table(hand_plan(), "t"))


@pytest.mark.parametrize("peak, shown", [(989e12, "989 TFLOP/s"), (200e9, "200 GFLOP/s")])
def test_a_device_peak_reads_in_the_unit_it_is_quoted_in(peak, shown):
    """``--device-tflops 989`` read "9.89e+05 GFLOP/s"."""
    assert DeviceModel(peak, 3350e9).describe() == f"{shown}, 3350 GB/s (given)"


def test_human_bytes_reaches_terabytes():
    assert human_bytes(5 * 1024**4) == "5.0 TiB"


def test_a_budget_read_off_the_table_is_the_bytes_the_table_means():
    """The table printed 2^20-byte "MB" that ``--max-memory`` read as 10^6 bytes: a budget copied from
    it was 5% short. Its binary units now read back as the bytes they print."""
    from autoshard.api import stage_limits
    from autoshard.arguments import byte_count

    for n in (22.5 * 2**20, 3.5 * 2**30, 700 * 2**10):
        assert byte_count(human_bytes(n), "--max-memory") == n
    # the Python API reads the same strings as the flag (it asked for "a list of numbers" before)
    assert stage_limits(2, max_memory="22.5 MiB")["max_memory"] == (22.5 * 2**20,) * 2
    assert stage_limits(2, max_memory=["1GB", 2e9])["max_memory"] == (1e9, 2e9)
    with pytest.raises(InvalidArgumentError, match=r"max_memory\[1\] takes bytes per stage.*'2XB'"):
        stage_limits(2, max_memory=["1GB", "2XB"])
    with pytest.raises(InvalidArgumentError, match=r"got '1GB, 2GB': write max_memory=\['1GB', '2GB'\]"):
        stage_limits(2, max_memory="1GB, 2GB")  # --max-memory's form, refused as bytes it could not read
