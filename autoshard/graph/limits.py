"""Per-stage budgets on additive node weights, where what a node needs may depend on its stage.

Stage cost is one such budget (a node costs the same in every stage). Training memory under a
pipeline schedule is another: stage j keeps a node's weights once but its activations once per
microbatch in flight there, so the same node needs more memory in an early stage under 1F1B.
``StageLimit`` covers both, so the DP, the min-cut refinement, the MILP and the validity check
read one definition of "stage j fits".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Relative round-off allowance for sums: prefix differences are not exact in floating point.
REL_EPS = 1e-9


def slack(scale: float) -> float:
    """The round-off allowance for comparing sums whose magnitude is at most ``scale``.

    Relative, but never under a few units in the last place, so sums of subnormal weights
    (where a relative allowance underflows to zero) still compare as equal to themselves.
    """
    return max(REL_EPS * scale, 4 * math.ulp(scale))


@dataclass(frozen=True)
class StageLimit:
    """Stage j fits when sum(held) + scale[j] x sum(scaled) over its nodes is at most budgets[j].

    ``held`` and ``scaled`` are per node (or per position of a sequence); ``scale`` and
    ``budgets`` per stage. ``name`` says which budget a violation breaks.
    """

    name: str
    held: np.ndarray
    budgets: np.ndarray
    scaled: np.ndarray | None = None
    scale: np.ndarray | None = None

    def weights(self, j: int) -> np.ndarray:
        """What each node needs when it sits in stage j."""
        if self.scaled is None:
            return self.held
        return self.held + self.scale[j] * self.scaled

    def least(self) -> np.ndarray:
        """What each node needs in the stage where it needs the least: a lower bound anywhere."""
        if self.scaled is None:
            return self.held
        return self.held + float(self.scale.min()) * self.scaled

    def total(self, j: int) -> float:
        """What all nodes together would need in stage j."""
        return float(self.weights(j).sum())

    def round_off(self, j: int) -> float:
        """The float allowance for stage j's sums."""
        return slack(self.total(j))

    def sums(self, stages: np.ndarray, k: int) -> np.ndarray:
        """What each stage of ``stages`` needs."""
        need = np.bincount(stages, weights=self.held, minlength=k)[:k]
        if self.scaled is not None:
            need = need + self.scale * np.bincount(stages, weights=self.scaled, minlength=k)[:k]
        return need

    def along(self, sequence: np.ndarray, num_inputs: int) -> StageLimit:
        """This limit over the non-input ``sequence`` of an order (see ``laid_along``)."""
        scaled = None if self.scaled is None else laid_along(self.scaled, sequence, num_inputs)
        return StageLimit(self.name, laid_along(self.held, sequence, num_inputs), self.budgets, scaled, self.scale)

    def prefix(self, j: int) -> np.ndarray:
        """Prefix sums of what the entries need in stage j (entry c: the first c entries)."""
        return np.concatenate(([0.0], np.cumsum(self.weights(j))))


def laid_along(values: np.ndarray, sequence: np.ndarray, num_inputs: int) -> np.ndarray:
    """Per-node ``values`` along the non-input ``sequence`` of an order, the inputs' (nodes
    0..num_inputs-1) added to its first entry: they always sit in stage 0 with it."""
    laid = values[sequence].copy()
    laid[0] += values[:num_inputs].sum()
    return laid
