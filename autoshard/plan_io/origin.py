"""How a ``ShardedModel`` was made, so that it can write its own plan file.

A plan file records what the stages alone do not know: the pipeline spec that made the split, its
cost model, the model's class name and the device model of the time column. ``shard_model`` and
``load_plan`` hand the stages a ``PlanOrigin`` with these (``sharded.plan_origin``), and
``ShardedModel.save_plan`` hands itself to it: ``autoshard.sharded`` sits below this package, so
the file format reaches the stages this way rather than by an import from below. Everything else
is read from the stages' ``StagePlan`` when the file is written, with the functions the CLI uses,
so ``sharded.save_plan(path)`` writes the file ``autoshard split TARGET --stages K --out`` writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from autoshard.costs.estimate import DeviceModel
from autoshard.graph import Partition
from autoshard.plan_io.files import save_plan
from autoshard.plan_io.from_program import plan_of_split, report_costs
from autoshard.plan_io.model import SavedPlan, SplitRecord
from autoshard.sharded import ShardedModel

if TYPE_CHECKING:  # pragma: no cover
    from autoshard.passes.base import ShardProgram
    from autoshard.passes.pipeline import Pipeline


@dataclass(frozen=True)
class PlanOrigin:
    """What a plan file of these stages records beyond their ``StagePlan``.

    ``costs`` holds the per-node costs of cost models that exist only for the run that made the
    stages (a user's ``cost(node)`` function, a file's cost model not registered here); the others
    are computed again from the DAG when the file is written. ``split`` is the split record of
    the file the stages were rebuilt from (None: the splitter's own, on the stages); ``device`` the
    device model its time column was estimated with (None: this machine's, calibrated).
    """

    pipeline: str
    cost_model: str
    model: str
    costs: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    split: SplitRecord | None = None
    device: DeviceModel | None = None

    @classmethod
    def made(cls, program: "ShardProgram", pipeline: "Pipeline",
             cost_models: Mapping[str, Callable[["ShardProgram"], dict[str, float]]]) -> PlanOrigin:
        """Of the stages ``pipeline`` made from ``program``'s model; ``cost_models`` are the run's own
        (a user's cost function), recorded now: after the run nothing knows them."""
        cost_model = next((getattr(step, "cost", "params") for step in pipeline if "partition" in step.provides),
                          "params")
        return cls(str(pipeline), cost_model, type(program.model).__qualname__,
                   {name: model(program) for name, model in cost_models.items()})

    @classmethod
    def rebuilt(cls, saved: SavedPlan, program: "ShardProgram", split: SplitRecord | None) -> PlanOrigin:
        """Of the stages rebuilt from ``saved``, as ``autoshard split --plan`` records them: the file's
        pipeline, cost model and device model, and ``split`` (the file's record, unless the weights
        have other sizes now)."""
        from autoshard.passes.analyses import COST_MODELS  # passes imports this package: not at load

        costs = {} if saved.cost_model in COST_MODELS else {
            saved.cost_model: {n.name: n.costs[saved.cost_model] for n in saved.nodes}}
        return cls(saved.pipeline, saved.cost_model, type(program.model).__qualname__, costs, split,
                   saved.time_estimate)

    def saved_plan(self, sharded: ShardedModel) -> SavedPlan:
        """The plan of ``sharded``, with the costs the CLI shows (``report_costs``). Cost models read
        the DAG, so the stages stand in for the model in the program they are given."""
        from autoshard.passes.analyses import use_cost_model, use_memory_model  # as in ``rebuilt``
        from autoshard.passes.base import PassContext, ShardProgram

        plan = sharded.plan
        partition = Partition(dict(plan.assignment), plan.num_stages, plan.split_info)
        ctx = PassContext()
        use_memory_model(ctx, plan.memory_model)
        for name, costs in self.costs.items():
            use_cost_model(ctx, name, lambda _program, recorded=costs: dict(recorded))
        reported = report_costs(ShardProgram(model=sharded, dag=plan.dag, partition=partition), ctx,
                                self.cost_model, self.device)
        return plan_of_split(plan.dag, partition, plan.wrapped, self.model, self.pipeline, self.cost_model,
                             reported.costs, time_estimate=reported.time_estimate, split=self.split,
                             memory_model=plan.memory_model)

    def save(self, sharded: ShardedModel, path: str | os.PathLike[str]) -> Path:
        """Write the plan of ``sharded`` to ``path`` (``ShardedModel.save_plan`` calls this)."""
        return save_plan(self.saved_plan(sharded), path)
