"""Pictures: the collapsed graph is right, and the files are real images of the promised size."""

from __future__ import annotations

import struct
import sys
import xml.etree.ElementTree as ET

import networkx as nx
import pytest
from matplotlib import image

from autoshard.errors import InvalidArgumentError, MissingDependencyError
from autoshard.examples import load_example
from autoshard.render import DPI, collapse, draw_plan, figure_size, stage_colours

from test_cli_report import hand_plan
from test_plan_io import make_plan


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_collapse_keeps_modules_and_labels_cut_edges_with_bytes():
    boxes, links = collapse(hand_plan())
    assert [(b.label, b.stage) for b in boxes] == [
        ("input x", 0), ("enc.layers.0", 0), ("enc.layers.1", 0), ("enc.layers.2", 1), ("enc.norm", 1), ("(root)", 1)]
    cuts = {(boxes[link.source].label, boxes[link.target].label): link.size for link in links if link.is_cut(boxes)}
    assert cuts == {("enc.layers.1", "enc.layers.2"): 256.0, ("input x", "(root)"): 256.0}


def test_collapse_goes_coarser_when_there_are_too_many_boxes():
    boxes, _ = collapse(hand_plan(), max_boxes=4)
    assert [(b.label, b.stage) for b in boxes] == [("input x", 0), ("enc", 0), ("enc", 1), ("(root)", 1)]


def test_the_collapsed_graph_of_a_residual_model_has_no_cycles():
    model, args, _ = load_example("residual-mlp")
    plan, _ = make_plan(model, 4)
    boxes, links = collapse(plan)
    graph = nx.DiGraph([(link.source, link.target) for link in links])
    assert nx.is_directed_acyclic_graph(graph)
    cuts = [link for link in links if link.is_cut(boxes)]
    # the residual stream leaves each stage once and feeds the next stage's linear and its add
    assert len({link.source for link in cuts}) == 3 and len(cuts) == 6
    assert all(boxes[link.source].label == "(root)" and link.size == 1 for link in cuts)


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
    model, _, _ = load_example("transformer-lm")
    small = hand_plan()
    assert figure_size(small)[1] == 6.0
    tall, _ = make_plan(model, 1)
    assert figure_size(tall)[1] > 6.0


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
