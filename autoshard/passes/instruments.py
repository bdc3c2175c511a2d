"""Pass instruments: hooks around every pass of a pipeline run (MLIR's ``PassInstrumentation``).

Pass bodies never time or print; instruments do. ``Pipeline.run`` calls, for the instruments in
``ctx.instruments``::

    before_pipeline (registration order)
      before_pass (registration order) -> pass -> after_pass / after_pass_failed (reverse order)
    after_pipeline (reverse order)

Reverse order for the after-hooks (as in MLIR and Hidet) nests the instruments: the first one
registered wraps all the others. ``after_pipeline`` runs only when every pass succeeded.
"""

from __future__ import annotations

import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Sequence, TextIO

from autoshard.errors import AutoshardError, InvalidArgumentError, InvalidArgumentTypeError, PassContractError
from autoshard.isolation import trace_values_on
from autoshard.passes.base import ExampleInputs, Instrument, Pass, ShardProgram
from autoshard.passes.options import format_pass

if TYPE_CHECKING:  # pragma: no cover
    from rich.table import Table

__all__ = [
    "DumpDir",
    "Instrument",
    "ModelUnchanged",
    "PrintAfter",
    "Timing",
    "TimingRow",
    "VerifyEach",
    "describe_artifact",
    "describe_program",
    "model_fingerprint",
]


def _spec(pass_: Pass) -> str:
    return format_pass(pass_)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------
class TimingRow(NamedTuple):
    index: int
    name: str
    spec: str
    seconds: float
    status: str  # "ok" or "failed"


class Timing(Instrument):
    """Wall-clock seconds per pass, like ``-mlir-timing-display=list``.

    Rows accumulate over every run the instrument sees; use a fresh ``Timing`` per run.
    """

    def __init__(self) -> None:
        self._rows: list[TimingRow] = []
        self._starts: list[float] = []
        self._pipeline_starts: list[float] = []
        self.pipeline_seconds = 0.0

    def before_pipeline(self, pipeline: Sequence[Pass], program: ShardProgram) -> None:
        self._pipeline_starts.append(time.perf_counter())

    def before_pass(self, pass_: Pass, index: int, program: ShardProgram) -> None:
        self._starts.append(time.perf_counter())

    def _stop(self, pass_: Pass, index: int, status: str) -> None:
        seconds = time.perf_counter() - self._starts.pop()
        self._rows.append(TimingRow(index, pass_.name, _spec(pass_), seconds, status))

    def after_pass(self, pass_: Pass, index: int, program: ShardProgram) -> None:
        self._stop(pass_, index, "ok")

    def after_pass_failed(self, pass_: Pass, index: int, program: ShardProgram, exc: BaseException) -> None:
        self._stop(pass_, index, "failed")

    def after_pipeline(self, pipeline: Sequence[Pass], program: ShardProgram) -> None:
        self.pipeline_seconds += time.perf_counter() - self._pipeline_starts.pop()

    def rows(self) -> list[TimingRow]:
        """One ``TimingRow`` per pass run, in the order the passes finished."""
        return list(self._rows)

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self._rows)

    def table(self, title: str = "autoshard pass timing") -> "Table":
        """The rows as a ``rich`` table with each pass's share of the total."""
        from rich.table import Table

        total = self.total_seconds
        table = Table(title=title)
        table.add_column("#", justify="right")
        table.add_column("pass")
        table.add_column("time (ms)", justify="right")
        table.add_column("share", justify="right")
        for r in self._rows:
            share = f"{100 * r.seconds / total:.1f}%" if total > 0 else "-"
            label = r.spec if r.status == "ok" else f"{r.spec} [red](failed)[/red]"
            table.add_row(str(r.index), label, f"{1000 * r.seconds:.3f}", share)
        table.add_section()
        table.add_row("", "total", f"{1000 * total:.3f}", "100.0%" if total > 0 else "-")
        return table


# --------------------------------------------------------------------------------------------
# Describing programs (DumpDir, PrintAfter)
# --------------------------------------------------------------------------------------------
_MAX_LINES = 400


def _clip(text: str, max_lines: int = _MAX_LINES) -> str:
    lines = text.splitlines()
    if len(lines) <= max_lines:
        return text
    return "\n".join(lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"])


def _short(obj: Any, limit: int = 200) -> str:
    try:
        import torch

        if isinstance(obj, torch.Tensor):
            return (f"Tensor(shape={list(obj.shape)}, dtype={str(obj.dtype).removeprefix('torch.')}, "
                    f"device={obj.device})")
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, (list, tuple)):
        inner = ", ".join(_short(o, limit) for o in obj[:20]) + (", ..." if len(obj) > 20 else "")
        return f"[{inner}]" if isinstance(obj, list) else f"({inner}{',' if len(obj) == 1 else ''})"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k!r}: {_short(v, limit)}" for k, v in list(obj.items())[:20]) + "}"
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_artifact(value: Any) -> str:
    """A compact, readable description of one artifact.

    Uses the artifact's own ``describe()`` when it has one; otherwise knows modules, example
    inputs, graphs and ``GraphModule`` code (also under a ``.gm`` attribute), and falls back to ``repr``.
    """
    describe = getattr(value, "describe", None)
    if callable(describe):
        return _clip(str(describe()))
    if isinstance(value, ExampleInputs):
        lines = [f"args[{i}]: {_short(a)}" for i, a in enumerate(value.args)]
        lines += [f"kwargs[{k!r}]: {_short(v)}" for k, v in value.kwargs.items()]
        return "\n".join(lines) or "(no inputs)"
    code = getattr(value, "code", None)
    if code is None:
        code = getattr(getattr(value, "gm", None), "code", None)
    if isinstance(code, str):
        head = _short(value) if not hasattr(value, "graph") else type(value).__name__
        return _clip(f"{head}\n{code.strip()}")
    try:
        import torch

        if isinstance(value, torch.nn.Module):
            n = sum(p.numel() for p in value.parameters())
            return _clip(f"{type(value).__name__}: {n} parameters, training={value.training}\n{value!r}")
    except ImportError:  # pragma: no cover
        pass
    if hasattr(value, "nodes") and hasattr(value, "edges") and hasattr(value, "number_of_nodes"):
        lines = [f"{type(value).__name__}: {value.number_of_nodes()} nodes, {value.number_of_edges()} edges"]
        lines += [f"  node {n!s}" + (f" {_short(a)}" if a else "") for n, a in value.nodes(data=True)]
        lines += [f"  edge {u!s} -> {v!s}" + (f" {_short(a)}" if a else "") for u, v, a in value.edges(data=True)]
        return _clip("\n".join(lines))
    return _clip(_short(value, limit=4000))


def describe_program(program: ShardProgram) -> str:
    """Which artifacts are set, then a description of each set one."""
    names = program.artifact_names()
    have = [n for n in names if getattr(program, n) is not None]
    missing = [n for n in names if n not in have]
    parts = [f"artifacts set: {', '.join(have) or '(none)'}", f"not set: {', '.join(missing) or '(none)'}"]
    for n in have:
        parts.append(f"\n== {n} ==\n{describe_artifact(getattr(program, n))}")
    return "\n".join(parts) + "\n"


def _file_name(index: int, name: str, suffix: str = "") -> str:
    return f"{index:03d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}{suffix}.txt"


class DumpDir(Instrument):
    """Write the program after each pass to ``path/NNN-<pass>.txt`` (TVM's ``DumpIR``).

    A failing pass leaves ``NNN-<pass>.failed.txt`` with the traceback and the program it was given.
    ``NNN`` counts the files this instrument wrote, so runs that share it (the CLI's ``--compare``
    runs one split per strategy) each keep theirs; each file's header names the pass's position.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.pipeline_spec = ""
        self.files: list[Path] = []

    def before_pipeline(self, pipeline: Sequence[Pass], program: ShardProgram) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidArgumentError(
                f"cannot create the dump directory {str(self.path)!r} ({exc.strerror or exc}); "
                "give a directory that can be created or already exists") from exc
        self.pipeline_spec = str(pipeline)

    def _write(self, name: str, header: str, body: str) -> None:
        target = self.path / name
        target.write_text(f"{header}\n# pipeline: {self.pipeline_spec}\n\n{body}", encoding="utf-8")
        self.files.append(target)

    def after_pass(self, pass_: Pass, index: int, program: ShardProgram) -> None:
        self._write(_file_name(len(self.files), pass_.name), f"# after pass {index}: {_spec(pass_)}",
                    describe_program(program))

    def after_pass_failed(self, pass_: Pass, index: int, program: ShardProgram, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(exc))
        self._write(
            _file_name(len(self.files), pass_.name, ".failed"),
            f"# pass {index} failed: {_spec(pass_)}",
            f"{tb}\n# the program the pass was given:\n{describe_program(program)}",
        )


class PrintAfter(Instrument):
    """Print the program after the named passes (or ``"all"``), like MLIR's ``-mlir-print-ir-after``."""

    def __init__(self, names: str | Iterable[str] = "all", file: TextIO | None = None) -> None:
        chosen = [names] if isinstance(names, str) else names
        if not isinstance(chosen, Iterable) or not all(isinstance(n, str) for n in chosen):
            raise InvalidArgumentTypeError("PrintAfter takes pass names (str, or a list of them) or 'all', "
                                           f"got {names!r}")
        self.names = None if names == "all" else frozenset(chosen)
        self.file = file  # None: sys.stderr at the time of printing

    def after_pass(self, pass_: Pass, index: int, program: ShardProgram) -> None:
        if self.names is None or pass_.name in self.names:
            out = self.file if self.file is not None else sys.stderr
            print(f"// ----- after pass {index}: {_spec(pass_)} ----- //\n{describe_program(program)}", file=out)


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------
class VerifyEach(Instrument):
    """Call ``verify()`` on every artifact a pass provides, when the artifact has one.

    ``Pipeline.run`` adds it (first, so it checks after the other after-hooks) when ``ctx.verify_each``.
    """

    def after_pass(self, pass_: Pass, index: int, program: ShardProgram) -> None:
        for name in program.artifact_names():
            if name not in pass_.provides:
                continue
            verify = getattr(getattr(program, name), "verify", None)
            if not callable(verify):
                continue
            try:
                verify()
            except AutoshardError:
                raise
            except Exception as exc:
                raise PassContractError(
                    f"pass '{pass_.name}' (position {index}) produced an invalid '{name}': "
                    f"{type(exc).__name__}: {exc}",
                    pass_.name,
                    index,
                ) from exc


class _TensorPrint(NamedTuple):
    identity: int
    version: int
    shape: tuple[int, ...]
    dtype: str
    device: str
    requires_grad: bool
    checksum: str


_HOOK_ATTRS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _checksum(t: Any) -> str:
    import torch

    try:
        if t.is_meta or t.layout != torch.strided:
            return "-"
        with torch.no_grad():
            x = t.detach()
            if x.is_complex():
                x = torch.view_as_real(x)
            if x.dtype == torch.bool:
                return repr(int(x.sum()))
            if x.is_floating_point():
                return f"{float(x.sum(dtype=torch.float64))!r}/{float(x.abs().sum(dtype=torch.float64))!r}"
            return f"{int(x.sum(dtype=torch.int64))}/{int(x.abs().sum(dtype=torch.int64))}"
    except Exception:  # tensor subclasses that cannot be read; identity and version still count
        return "?"


def _tensor_print(t: Any) -> _TensorPrint:
    return _TensorPrint(
        id(t), int(getattr(t, "_version", 0)), tuple(t.shape), str(t.dtype), str(t.device),
        bool(t.requires_grad), _checksum(t),
    )


def model_fingerprint(model: Any, example_inputs: ExampleInputs | None = None) -> dict[str, Any]:
    """A comparable snapshot of everything a pass must not change about the user's model.

    Keys are human-readable ("parameter 'fc.weight'"); values compare equal iff unchanged:
    the module tree, each module's ``training`` flag, hook counts and attributes holding what only a
    trace makes (a Proxy, a symbolic int, a fake tensor), the state_dict keys, and
    each parameter/buffer's identity, ``_version`` counter, shape, dtype, device, requires_grad and
    a cheap checksum (sum and absolute sum). Example-input tensors are included too.
    """
    import torch

    fp: dict[str, Any] = {}
    modules = list(model.named_modules(remove_duplicate=False))
    fp["the module tree"] = tuple((n, type(m).__qualname__) for n, m in modules)
    for n, m in modules:
        label = f"'{n}'" if n else "the root module"
        fp[f"training flag of {label}"] = m.training
        fp[f"hooks of {label}"] = tuple(len(getattr(m, a, None) or ()) for a in _HOOK_ATTRS)
        fp[f"trace values left on {label}"] = tuple(trace_values_on(m))
    fp["the state_dict keys"] = tuple(model.state_dict(keep_vars=True).keys())
    for n, p in model.named_parameters(remove_duplicate=False):
        fp[f"parameter '{n}'"] = _tensor_print(p)
    for n, b in model.named_buffers(remove_duplicate=False):
        fp[f"buffer '{n}'"] = _tensor_print(b) if b is not None else None
    if example_inputs is not None:
        for i, a in enumerate(example_inputs.args):
            if isinstance(a, torch.Tensor):
                fp[f"example input args[{i}]"] = _tensor_print(a)
        for k, v in example_inputs.kwargs.items():
            if isinstance(v, torch.Tensor):
                fp[f"example input kwargs[{k!r}]"] = _tensor_print(v)
    return fp


def _diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for key in before.keys() - after.keys():
        out.append(f"{key} was removed")
    for key in after.keys() - before.keys():
        out.append(f"{key} was added")
    for key, old in before.items():
        new = after.get(key, old)
        if new == old:
            continue
        if isinstance(old, _TensorPrint) and isinstance(new, _TensorPrint):
            if old.identity != new.identity:
                out.append(f"{key} was replaced by another tensor")
            elif old.version != new.version:
                out.append(f"{key} was modified in place (version {old.version} -> {new.version})")
            elif old.checksum != new.checksum:
                out.append(f"the values of {key} changed (checksum {old.checksum} -> {new.checksum})")
            else:
                changed = [f"{f} {getattr(old, f)} -> {getattr(new, f)}"
                           for f in old._fields if getattr(old, f) != getattr(new, f)]
                out.append(f"{key} changed: {', '.join(changed)}")
        elif key.startswith("hooks of"):
            names = [a.strip("_") for a in _HOOK_ATTRS]
            changed = [f"{nm} {o} -> {n}" for nm, o, n in zip(names, old, new) if o != n]
            out.append(f"{key} changed: {', '.join(changed)}")
        elif key == "the module tree":
            old_names, new_names = {n for n, _ in old}, {n for n, _ in new}
            added = sorted(new_names - old_names)
            removed = sorted(old_names - new_names)
            detail = "; ".join(
                x for x in (f"added {added}" if added else "", f"removed {removed}" if removed else "") if x
            )
            out.append(f"the module tree changed ({detail or 'module types changed'})")
        else:
            out.append(f"{key} changed from {old!r} to {new!r}")
    return sorted(out)


@dataclass
class _Snapshot:
    model: Any
    example_inputs: Any
    fingerprint: dict[str, Any]


class ModelUnchanged(Instrument):
    """Fail with the name of the pass that changed the user's model (TVM's ``testing.immutable_module``).

    Fingerprints ``program.model`` (and the example-input tensors) before each pass and compares
    after it; raises ``PassContractError``. Costs one pass over the parameters per check: meant for
    tests and for debugging a pass of your own (``shard_model(..., instruments=[ModelUnchanged()])``;
    the command line's ``--debug`` only shows tracebacks and does not add it).
    """

    def __init__(self) -> None:
        self._stack: list[_Snapshot] = []

    def before_pass(self, pass_: Pass, index: int, program: ShardProgram) -> None:
        self._stack.append(
            _Snapshot(program.model, program.example_inputs, model_fingerprint(program.model, program.example_inputs))
        )

    def after_pass(self, pass_: Pass, index: int, program: ShardProgram) -> None:
        snap = self._stack.pop()
        changes = _diff(snap.fingerprint, model_fingerprint(snap.model, snap.example_inputs))
        if changes:
            shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
            raise PassContractError(
                f"pass '{pass_.name}' (position {index}) modified the user's model: {shown}. Passes must "
                "treat the model as read-only; copy what you need to change (copy.deepcopy).",
                pass_.name,
                index,
            )

    def after_pass_failed(self, pass_: Pass, index: int, program: ShardProgram, exc: BaseException) -> None:
        self._stack.pop()
