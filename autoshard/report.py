"""Human-readable descriptions of a plan: module ranges and per-stage rows."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from autoshard.sharded import StagePlan

_LAST_INDEX = re.compile(r"^(?P<head>.*?)(?P<index>\d+)(?P<tail>(?:\.[^.\d][^.]*)*)$")


def compress_module_ranges(paths: Sequence[str]) -> list[str]:
    """``['layers.0', 'layers.1', 'layers.2', 'head']`` → ``['layers.0-2', 'head']``.

    Consecutive paths that differ only in their last numeric component, by one each, merge.
    """
    out: list[str] = []
    run: tuple[str, int, int, str] | None = None  # head, first, last, tail

    def flush() -> None:
        if run is not None:
            head, first, last, tail = run
            out.append(f"{head}{first}{tail}" if first == last else f"{head}{first}-{last}{tail}")

    for path in paths:
        match = _LAST_INDEX.match(path)
        if match is None:
            flush()
            run = None
            out.append(path)
            continue
        head, index, tail = match["head"], int(match["index"]), match["tail"]
        if run is not None and run[0] == head and run[3] == tail and index == run[2] + 1:
            run = (head, run[1], index, tail)
            continue
        flush()
        run = (head, index, index, tail)
    flush()
    return out


@dataclass(frozen=True)
class StageRow:
    """One stage of a plan, as shown in tables."""

    index: int
    modules: list[str]
    nodes: int
    param_bytes: int
    values_in: tuple[str, ...]
    values_out: tuple[str, ...]


def stage_rows(plan: StagePlan) -> list[StageRow]:
    rows = []
    for stage in range(plan.num_stages):
        rows.append(StageRow(
            index=stage,
            modules=compress_module_ranges(plan.modules(stage)),
            nodes=len(plan.stage_nodes(stage)),
            param_bytes=plan.param_bytes(stage),
            values_in=plan.boundaries[stage - 1] if stage > 0 else (),
            values_out=plan.boundaries[stage] if stage < plan.num_stages - 1 else (),
        ))
    return rows
