"""The ``load-partition`` pass: take the partition from a saved plan instead of splitting."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import ClassVar

from autoshard.errors import InvalidArgumentError, PlanError, user_stacklevel
from autoshard.graph import Partition
from autoshard.passes.base import Pass, PassContext, ShardProgram, option
from autoshard.plan_format.files import read_plan
from autoshard.plan_format.fits import StalePlanWarning, check_fits, weight_size_changes


@dataclass(frozen=True)
class LoadPartitionPass(Pass):
    """Use the node-to-stage assignment of a plan saved with ``--out`` (or ``save_plan``).

    The plan must have been made for this graph (same nodes and edges) and be a valid split of it;
    otherwise the error says which. Example: ``trace,build-dag,load-partition{path=plan.json},emit``.
    """

    name: ClassVar[str] = "load-partition"
    requires: ClassVar[frozenset[str]] = frozenset({"dag"})
    provides: ClassVar[frozenset[str]] = frozenset({"partition"})

    path: str = option(help="the plan file (JSON) to read")

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        plan = read_plan(self.path)
        check_fits(plan, program.dag, self.path)
        resized = weight_size_changes(plan, program.dag)
        if resized:
            warnings.warn(StalePlanWarning(
                f"plan {self.path} was made for other weights ({'; '.join(resized[:3])}"
                f"{'; ...' if len(resized) > 3 else ''}): its stages are rebuilt as saved, but the balance it "
                "records was measured on those; make a new plan to balance this model"),
                stacklevel=user_stacklevel())
        try:
            # A hand edit or other weight sizes void the splitter's record of bound and bottleneck.
            info = plan.split.info if plan.split_is_current and not resized else None
            partition = Partition.from_assignment(program.dag, plan.assignment(), plan.num_stages, info)
        except InvalidArgumentError as exc:
            raise PlanError(f"plan {self.path} is not a valid split of this model's graph: {exc}") from exc
        return dataclasses.replace(program, partition=partition)
