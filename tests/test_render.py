"""Pictures: the collapsed graph is right, and the files are real images of the promised size."""

from __future__ import annotations

import struct
import sys
import xml.etree.ElementTree as ET

from dataclasses import replace

import pytest
from matplotlib import image
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Annotation, Text
from matplotlib.transforms import Bbox

from autoshard.errors import InvalidArgumentError, MissingDependencyError
from autoshard.examples import load_example
from autoshard.plan_io import PlanNode, SavedPlan
from autoshard.render import DPI, draw_plan, figure_size, layout, plan_figure, stage_colours
from autoshard.report import stage_modules

from test_cli_report import hand_plan
from test_plan_io import make_plan


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def gpt():
    """A small GPT: inputs checked by capture (``idx_unchecked``), a split block, the head tied to the embedding."""
    model, args, _ = load_example("gpt-lm")
    return make_plan(model, 4, args)[0]


def texts_of(plan) -> list[Text]:
    fig = plan_figure(plan)
    FigureCanvasAgg(fig).draw()  # lays the text out as the PNG has it
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text()]


def test_layout_lists_each_stages_modules_and_what_each_box_sends():
    shown = layout(hand_plan())
    assert [(b.label, b.stage, b.row) for b in shown.boxes] == [
        ("input: x", 0, 0), ("enc.layers.0", 0, 1), ("enc.layers.1", 0, 2),
        ("enc.layers.2", 1, 0), ("enc.norm", 1, 1), ("(root)", 1, 2)]
    assert [b.sends for b in shown.boxes] == [256.0, 0.0, 256.0, 0.0, 0.0, 0.0]
    named = {(shown.boxes[link.source].label, shown.boxes[link.target].label) for link in shown.links}
    assert named == {("enc.layers.1", "enc.layers.2"), ("input: x", "(root)")}


def test_inputs_are_named_by_the_models_own_arguments(gpt):
    assert [n.name for n in gpt.nodes if n.input] == ["idx_unchecked"]  # capture's name for the checked input
    assert [b.label for b in layout(gpt).boxes if b.input] == ["input: idx"]
    shown = [t.get_text() for t in texts_of(gpt)]
    assert "input: idx" in shown and not any("_unchecked" in text for text in shown)


def test_one_box_per_module_range_per_stage(gpt):
    for plan in (gpt, hand_plan()):
        labels = [(b.stage, b.label) for b in layout(plan).boxes]
        assert len(labels) == len(set(labels)), labels
    assert [b.label for b in layout(gpt).boxes if b.stage == 0 and not b.input] == stage_modules(gpt, 0)
    # ranged like the table's when one box per module is too many
    ranged = layout(hand_plan(), max_boxes=5).boxes
    assert [(b.label, b.stage) for b in ranged] == [
        ("input: x", 0), ("enc.layers.0-1", 0), ("enc.layers.2", 1), ("enc.norm", 1), ("(root)", 1)]


def test_the_picture_goes_coarser_when_there_are_too_many_boxes():
    boxes = layout(hand_plan(), max_boxes=4).boxes
    assert [(b.label, b.stage) for b in boxes] == [("input: x", 0), ("enc (part)", 0), ("enc (part)", 1), ("(root)", 1)]


def test_a_legend_says_what_part_and_root_mean_when_they_show(gpt):
    shown = [t.get_text() for t in texts_of(gpt)]
    assert any(text.startswith("(part): a module split between stages") for text in shown)
    assert any(text.startswith("(root): operations written in the model's own forward") for text in shown)
    plain = replace(hand_plan(), nodes=tuple(replace(n, module="head") if n.name == "add" else n
                                             for n in hand_plan().nodes))
    assert not any(text.startswith(("(part):", "(root):")) for text in (t.get_text() for t in texts_of(plain)))


def overlaps(texts: list[Text]) -> list[tuple[str, str]]:
    """Pairs of labels whose drawn extents (a box label's box included) overlap."""
    def extent(text: Text):
        patch = text.get_bbox_patch()
        return Bbox.union([text.get_window_extent()] + ([patch.get_window_extent()] if patch else []))

    boxes = [(t.get_text(), extent(t)) for t in texts]
    return [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:] if box.overlaps(other)]


def chain(modules: list[str], stages: list[int]) -> SavedPlan:
    """An input through one node per module, each on its stage; the input also feeds the last node."""
    nodes = [PlanNode(name="x_unchecked", stage=0, op="placeholder", target="x", module="", costs={"params": 0.0},
                      bytes=4096.0, param_bytes=0.0, input=True)]
    nodes += [PlanNode(name=f"n{i}", stage=s, op="call_module", target=m, module=m, costs={"params": 1.0},
                       bytes=4096.0, param_bytes=1.0, output=i == len(modules) - 1)
              for i, (m, s) in enumerate(zip(modules, stages))]
    names = [n.name for n in nodes]
    edges = list(zip(names, names[1:])) + [("x_unchecked", names[-1])]
    return SavedPlan(num_stages=max(stages) + 1, cost_model="params", pipeline="p", model="Chain", versions={},
                     nodes=tuple(nodes), edges=tuple(edges))


@pytest.mark.parametrize("k", [2, 4, 8, 16])
def test_no_two_labels_overlap_with_long_names_and_many_stages(k):
    """T5-long module names, each split between two stages: the longest labels a column gets."""
    texts = texts_of(chain([f"decoder.block.{(i + 1) // 2}.layer.0.SelfAttention.relative_attention_bias"
                            for i in range(2 * k)], [i // 2 for i in range(2 * k)]))
    assert any(t.get_text().startswith("decoder.") and "_bias (part)" in t.get_text() for t in texts)
    assert overlaps(texts) == []


def test_no_two_labels_overlap_in_a_real_plan(gpt):
    assert overlaps(texts_of(gpt)) == []


def test_a_shared_weight_is_a_link_between_the_stages_that_hold_it(gpt):
    assert [(w.name, w.stages) for w in gpt.shared_weights()] == [("wte.weight", (0, 3))]
    fig = plan_figure(gpt)
    FigureCanvasAgg(fig).draw()
    tied = [a for a in fig.findobj(Annotation) if a.get_gid() == "tie:wte.weight"]
    assert len(tied) == 1
    ends = {(end.get_position()[0], end.get_text()) for end in (tied[0].anncoords, tied[0].xycoords)}
    assert ends == {(0, "wte"), (3, "lm_head")}
    shown = [t.get_text() for t in fig.findobj(Text)]
    assert "one weight held by stages 0, 3: wte.weight = lm_head.weight" in shown


def test_the_graph_of_a_residual_model_sends_the_stream_once_per_stage():
    model, args, _ = load_example("residual-mlp")
    plan, _ = make_plan(model, 4, args)
    shown = layout(plan)
    boxes = shown.boxes
    assert all(boxes[link.source].stage < boxes[link.target].stage for link in shown.links)
    # the residual stream leaves each stage once and feeds the next stage's linear and its add
    assert len({link.source for link in shown.links}) == 3 and len(shown.links) == 6
    assert all(boxes[link.source].label == "(root)" and boxes[link.source].sends == 256 for link in shown.links)


def pixels_of(rgb, colour: str) -> int:
    target = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    close = (abs(rgb[..., :3] - target) < 0.02).all(axis=-1)
    return int(close.sum())


def test_png_is_a_real_image_of_the_promised_size(tmp_path):
    plan = hand_plan()
    path = draw_plan(plan, tmp_path / "plan.png")
    width, height = figure_size(plan)
    assert png_size(path.read_bytes()) == (round(width * DPI), round(height * DPI))
    pixels = image.imread(path)
    for colour in stage_colours(plan.num_stages):
        assert pixels_of(pixels, colour) > 500, f"stage colour {colour} is missing"  # the bars at least


def test_svg_is_a_real_image_of_the_promised_size(tmp_path):
    plan = hand_plan()
    path = draw_plan(plan, tmp_path / "plan.svg")
    root = ET.parse(path).getroot()
    width, height = figure_size(plan)
    assert root.get("width") == f"{width * 72:g}pt" and root.get("height") == f"{height * 72:g}pt"
    text = path.read_text()
    for colour in stage_colours(plan.num_stages):
        assert colour in text
    for label in ("enc.layers.0", "enc.norm", "stage 1", "256 B", "ideal: total / 2"):
        assert label in text, label


def test_svg_is_deterministic(tmp_path):
    plan = hand_plan()
    assert draw_plan(plan, tmp_path / "a.svg").read_bytes() == draw_plan(plan, tmp_path / "b.svg").read_bytes()


def test_a_bigger_plan_gets_a_taller_picture():
    assert figure_size(hand_plan())[1] == 6.0
    assert figure_size(chain([f"layer{i}" for i in range(20)], [0] * 20))[1] > 6.0


def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'autoshard\[plot\]'"):
        draw_plan(hand_plan(), tmp_path / "plan.svg")


def test_an_unknown_picture_format_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="use a .svg or .png file"):
        draw_plan(hand_plan(), tmp_path / "plan.gif")


def test_stage_colours_are_distinct_for_many_stages():
    for k in (1, 4, 12, 30):
        assert len(set(stage_colours(k))) == k
