"""The manual in docs/ builds, and its runnable examples run as written.

The build is ``mkdocs build --strict`` (warnings are errors: a broken link, an anchor that does
not exist, a page missing from the nav) into a temporary folder, with every proxy pointed at a
closed port so that nothing can be fetched. ``docs/hooks/pass_reference.py`` renders the pass
reference from the registry during the build.

Runnable examples: on the pages in ``RUNNABLE``, every block fenced exactly as ```python runs, in
order, in one namespace per page, in an empty folder. A block to show and not run is fenced
otherwise (```python title="..." for a file included from the repository, ```text, ```bash).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard.passes import BUILTIN_PASSES, default_registry

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: Pages whose ```python blocks all run (tests below check what each leaves behind).
RUNNABLE = ("getting-started.md", "pipelines.md", "testing.md", "huggingface.md")
BUILD_DEADLINE_S = 240
TORCHRUN_DEADLINE_S = 300


def python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(encoding="utf-8"), flags=re.S | re.M)


def run_page(page: str) -> dict:
    """Run the page's blocks in order in one namespace; return it."""
    blocks = python_blocks(page)
    assert blocks, f"docs/{page} has no ```python block to run"
    namespace: dict = {"__name__": f"docs_{page.removesuffix('.md').replace('-', '_')}"}
    for block in blocks:
        exec(compile(block, str(DOCS / page), "exec", dont_inherit=True), namespace)
    return namespace


def offline_env() -> dict[str, str]:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's end-of-life banner, not a build warning
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env[proxy] = "http://127.0.0.1:9"  # the discard port: any fetch fails at once
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    return env


@pytest.mark.slow
@pytest.mark.timeout(BUILD_DEADLINE_S + 60)
def test_docs_build_strict_offline_with_the_generated_pass_reference(tmp_path):
    for module in ("mkdocs", "material", "pymdownx"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[test]' installs the docs builder")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=BUILD_DEADLINE_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert not re.search(r"^(WARNING|ERROR)\b", output, flags=re.M), output
    reference = (site / "passes" / "index.html").read_text(encoding="utf-8")
    assert "passes: generated" not in reference
    for cls in BUILTIN_PASSES:
        assert f'id="{cls.name}"' in reference, f"the pass reference has no section for {cls.name}"
    walkthrough = (site / "huggingface" / "index.html").read_text(encoding="utf-8")
    assert "check_pipeline_step" in walkthrough and "--8&lt;--" not in walkthrough  # the script is included


def test_every_docs_page_is_in_the_nav():
    """mkdocs --strict refuses a page left out of the nav; this says so without building."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert pages and all(f": {page}" in nav for page in pages), pages


def test_getting_started_quickstart_runs_verbatim(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = run_page("getting-started.md")
    model, src, mask = ns["model"], ns["src"], ns["mask"]
    assert len(ns["sharded"].stages) == 4
    assert torch.equal(ns["out"], model(src, mask))
    assert torch.equal(ns["sharded"](src, mask), model(src, mask))
    assert ns["again"].plan.assignment == ns["sharded"].plan.assignment


def test_readme_quickstart_is_the_getting_started_one():
    """The README's quickstart is a copy of the manual's, so the two cannot drift apart."""
    readme = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S | re.M)
    assert readme == python_blocks("getting-started.md")


def test_custom_pipeline_and_pass_examples_run_verbatim(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        ns = run_page("pipelines.md")
    finally:
        if "name-order" in default_registry:
            default_registry.unregister("name-order")
    model, src, mask = ns["model"], ns["src"], ns["causal_mask"](12)
    assert len(ns["sharded"].stages) == 4
    assert torch.equal(ns["sharded"](src, mask), model(src, mask))


def test_splitter_kit_example_runs_verbatim(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = run_page("testing.md")
    assert callable(ns["test_my_splitter"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(TORCHRUN_DEADLINE_S + 240)
def test_hugging_face_walkthrough_runs_and_its_plan_checks_on_two_processes(tmp_path, monkeypatch):
    """Steps 1-3 in this process; step 4 under torchrun on the plan they saved: the pipeline step
    must match the unsplit model (check_pipeline_step raises on every rank otherwise)."""
    monkeypatch.chdir(tmp_path)
    ns = run_page("huggingface.md")
    plan = tmp_path / "gpt2-plan.json"
    assert plan.is_file() and len(ns["sharded"].stages) == 2
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "check_gpt2_step.py"), "--plan", str(plan)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=TORCHRUN_DEADLINE_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^loss \S+, unsplit \S+ .* 0 beyond rtol", done.stdout, flags=re.M), done.stdout
