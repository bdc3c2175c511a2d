"""Plans as files: a split saved as JSON that a person can read and edit and a program can reuse.

``plan_from_program`` captures a split, ``save_plan`` / ``read_plan`` write and check the file,
and ``load_plan`` rebuilds the same stages for the model (``autoshard split --plan``). Stages made
by ``shard_model`` or ``load_plan`` write their own plan (``sharded.save_plan(path)``) through the
``PlanOrigin`` they are given.

The public face of plan files: the format lives in ``autoshard.plan_format`` (below the passes,
whose ``load-partition`` reads it), plans made from a run in ``autoshard.plan_origin`` (beside the
api, which hands stages their origin), and ``load_plan``, which runs the api, here.
"""

from autoshard.plan_format.files import format_plan, plan_from_dict, read_plan, save_plan
from autoshard.plan_format.fits import StalePlanWarning, check_fits, weight_size_changes
from autoshard.plan_format.model import (
    FORMAT,
    FORMAT_VERSION,
    PlanNode,
    SavedPlan,
    SplitRecord,
    assignment_digest,
    module_ancestors,
    versions,
)
from autoshard.plan_io.rebuild import load_plan, rebuild_pipeline
from autoshard.plan_origin import (
    REPORTED_COSTS,
    PlanOrigin,
    ReportedCosts,
    plan_from_program,
    report_costs,
    split_record,
)

__all__ = [
    "FORMAT", "FORMAT_VERSION", "PlanNode", "PlanOrigin", "REPORTED_COSTS", "ReportedCosts", "SavedPlan", "SplitRecord",
    "StalePlanWarning", "assignment_digest", "check_fits", "format_plan", "load_plan", "module_ancestors",
    "plan_from_dict", "plan_from_program", "read_plan", "rebuild_pipeline", "report_costs", "save_plan",
    "split_record", "versions", "weight_size_changes",
]
