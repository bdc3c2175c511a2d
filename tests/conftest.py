"""Shared fixtures: the built-in examples and a fingerprint of a model's observable state."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import settings
from torch import nn

from autoshard.isolation import trace_values_on

# CI draws the same hypothesis examples on every run, so a red CI comes from a change and not
# from a lucky draw; local runs keep drawing new ones, which is where new bugs are found.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("AUTOSHARD_HYPOTHESIS_PROFILE", "default"))

# The machine's calibrated speed is cached under $XDG_CACHE_HOME: tests (and the processes they
# start) write theirs to a folder of the run's own, not to the user's ~/.cache/autoshard. A process
# the tests start imports this file again: it keeps the run's folder, which the run removes (its own
# would stay behind, as a spawned worker exits without running atexit).
_CACHE_PREFIX = os.path.join(tempfile.gettempdir(), "autoshard-test-cache-")
if not os.environ.get("XDG_CACHE_HOME", "").startswith(_CACHE_PREFIX):
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix=os.path.basename(_CACHE_PREFIX))
    atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

# The processes multi-process tests start (spawned workers, torchrun, the CLI) run one torch
# thread each: several of them share the machine's cores, and more threads than cores made
# each step many times slower. (This process has set its own threads already.)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Under pytest-xdist (pytest -n auto) each worker takes one core: one torch thread each, or the
# workers' threads outnumber the cores (a test took 20x longer that way).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def model_fingerprint(model: nn.Module) -> dict:
    """Everything shard_model promises not to change: values, identities, flags, hooks, tree."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "ids": {k: id(v) for k, v in model.named_parameters()},
        "training": {name: m.training for name, m in model.named_modules()},
        "hooks": {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()},
        "tree": [(name, type(m).__name__) for name, m in model.named_modules()],
        "trace values": {name: trace_values_on(m) for name, m in model.named_modules()},
    }


def assert_same_fingerprint(before: dict, after: dict) -> None:
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(value, after["state"][key]), f"{key} changed"
    for field in ("ids", "training", "hooks", "tree", "trace values"):
        assert before[field] == after[field], f"{field} changed"


@pytest.fixture
def empty_calibration_cache(tmp_path, monkeypatch):
    """A calibration cache directory of its own and a process that has read nothing from it yet."""
    from autoshard.costs import estimate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(estimate.RECALIBRATE_ENV, raising=False)
    monkeypatch.setattr(estimate, "_THIS_PROCESS", {})


@pytest.fixture
def fingerprint():
    return model_fingerprint


class Framed(nn.Module):
    """``inner`` between two linear layers (``pre``, ``post``), so it is a child the capture can
    keep whole while the split has modules on either side."""

    def __init__(self, inner: nn.Module, width: int = 8) -> None:
        super().__init__()
        self.pre, self.inner, self.post = nn.Linear(width, width), inner, nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.inner(self.pre(x)))


class DoublesWhen(nn.Module):
    """Code that chooses its path by a mode torch reports (``torch.is_grad_enabled``, as
    nn.TransformerEncoder's fast path does, or ``is_inference_mode_enabled``), asked by name on each call."""

    def __init__(self, asked: str, width: int = 4) -> None:
        super().__init__()
        self.asked = asked
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if getattr(torch, self.asked)():
            h = h * 2
        return self.b(h)


class SignGate(nn.Module):
    """A branch on a tensor's value: kept whole by either front end, with its own child ``lin``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h if h.sum() > 0 else -h


class StackedLSTMs(nn.Module):
    """The first LSTM's final state ``(h, c)`` starts the second: a tuple used whole."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.LSTM(4, 4, batch_first=True), nn.LSTM(4, 4, batch_first=True)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.first(x)
        out, _ = self.second(torch.relu(out), state)
        return self.head(out)


class Masked(nn.Module):
    """Optional ``mask`` and ``bias`` inputs, for binding a call as the model binds it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        h = self.second(torch.tanh(self.first(x)))
        h = h if mask is None else h * mask
        return h if bias is None else h + bias


class _Problem:
    problem_type = None


class FillsInItsProblemType(nn.Module):
    """Fills in ``config.problem_type`` from its labels on its first call and computes its loss by it, as
    Hugging Face's sequence classifiers do."""

    def __init__(self) -> None:
        super().__init__()
        self.config, self.a, self.b = _Problem(), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None:
            self.config.problem_type = "single" if labels.dtype == torch.long else "multi"
        logits = self.b(torch.tanh(self.a(x)))
        if self.config.problem_type == "single":
            return nn.functional.cross_entropy(logits, labels)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)
