"""The ``profile`` pass: measure each node's time on the example inputs, or load a saved profile:
the ``times`` artifact, also carried on the graph's nodes (``costs.facts``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from autoshard.passes.annotate import annotated_copy
from autoshard.costs.timing import TimeProfile, TimingSettings, graph_signature, measure_node_seconds, measured_sizes
from autoshard.errors import InvalidArgumentError
from autoshard.passes.base import Pass, PassContext, ShardProgram, option


@dataclass(frozen=True)
class ProfilePass(Pass):
    """Time every node on the example inputs (warm-up, repeats, the fastest) for ``cost=time``.

    With ``path``, an existing JSON profile there is loaded instead of measuring, and a fresh
    measurement is saved there, so the same path reproduces a time-balanced plan exactly. A loaded
    profile keeps the settings it was measured with (``backward`` among them: the step-time model
    reads it off the nodes); ``threads`` or ``backward=true`` given here and contradicted by them is
    refused. A profile of another graph, or of other input or weight sizes, is refused. Shows a
    progress bar on a terminal.
    Example: ``trace,shape-prop,profile{path=times.json},build-dag,linearize,split{cost=time},emit``.
    """

    name: ClassVar[str] = "profile"
    requires: ClassVar[frozenset[str]] = frozenset({"model", "traced", "example_inputs"})
    provides: ClassVar[frozenset[str]] = frozenset({"traced", "times"})

    warmup: int = option(2, help="untimed runs of each node first")
    repeats: int = option(5, help="timed runs of each node; the fastest counts")
    backward: bool = option(False, help="time forward and backward, not forward only")
    path: str | None = option(None, help="JSON profile: loaded if it exists, else written")
    seed: int = option(0, help="random seed for the runs (dropout)")
    threads: int | None = option(None, help="torch's threads to time on (default: the caller's); give what each "
                                            "rank will run: on a busy CPU two threads can read 100x one")

    def check_options(self) -> None:
        TimingSettings(self.warmup, self.repeats, self.backward, self.threads)  # refuses bad values before capture
        if self.path is not None and not Path(self.path).exists() and not Path(self.path).parent.is_dir():
            # else the profile is measured first, and its file then fails to be written
            raise InvalidArgumentError(f"profile path {self.path!r} is to be written, but there is no folder "
                                       f"{str(Path(self.path).parent)!r}: create it first, or give another path")

    def _check_asked(self, measured: TimingSettings) -> None:
        """Refuse a loaded profile whose settings contradict an option given here: its times would
        be shown under a spec saying ``threads=1`` or ``backward=true`` and balanced as such."""
        contradicted = []
        if self.threads is not None and measured.threads is not None and measured.threads != self.threads:
            contradicted.append(f"it was timed on {measured.threads} threads, not threads={self.threads}")
        if self.backward and not measured.backward:
            contradicted.append("it timed the forward only, not backward=true")
        if contradicted:
            raise InvalidArgumentError(
                f"the time profile {self.path!r} was measured otherwise than this profile pass asks: "
                f"{'; '.join(contradicted)}; delete it (or give another path) to measure again, or drop the option "
                "to use its times as they are")

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        gm = program.traced.graph_module
        # the threads it ran on, not None: a saved profile says what it measured
        settings = TimingSettings(self.warmup, self.repeats, self.backward, self.threads or torch.get_num_threads())
        if self.path is not None and Path(self.path).exists():
            profile = TimeProfile.load(self.path)
            profile.check_matches(gm, self.path, program.example_inputs)
            self._check_asked(profile.settings)
        else:
            profile = TimeProfile(measure_node_seconds(gm, program.example_inputs, settings, self.seed),
                                  settings, graph_signature(gm), sizes=measured_sizes(gm, program.example_inputs))
            if self.path is not None:
                profile.save(self.path)
        # the profile's own setting, not this pass's option: a loaded profile says what it measured
        annotated = annotated_copy(gm, program.model, seconds=profile.seconds, backward=profile.settings.backward)
        return dataclasses.replace(program, traced=dataclasses.replace(program.traced, graph_module=annotated),
                                   times=profile)
