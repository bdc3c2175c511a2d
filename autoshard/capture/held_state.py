"""The one check a stage makes of the modules it holds, cheap enough to run on every microbatch.

A stage's graph fixed what its modules' code read from ``self.training`` and from their weights'
dtypes, so every call checks that the stage and the modules it calls are in the modes they were
captured in and that no weight was converted (``check_mode``, ``check_weight_dtypes`` say what is
wrong). Walking the module tree by path for that (``getattr(self.blocks, "0").ln_1.training``)
cost more than small layers compute. As torch.compile's guards do, the walk is done once and its
result kept as flat tuples that a call reads with C-level ``map``: the modules with their
captured modes, the registries holding the parameters whose dtypes count, and every step of the
paths to them (the container's ``_modules`` dict, the name, the module found there). A call first
checks that each step still leads where it did, by identity: a submodule replaced in any way
(``setattr``, ``_modules[name] = ...`` as quantization's convert does) makes it walk again.
Parameters are read from their registries on every call, so a conversion is seen whether it
swaps a parameter's data or registers a new one; none is kept (a runtime may swap in device
copies for one call, ``functional_call``, which must not outlive it). Everything a call reads is
compared at once with what the last call read (one tuple, ``seen``); only a difference runs the
refusing checks.

The check returns the modules it has just checked, by path, and the stage's code calls those
(``HeldModulesCodeGen``): fx's code would find each one again through ``nn.Module.__getattr__``
(an attribute miss and a Python call per step of its path), which cost more than the check.
"""

from __future__ import annotations

import operator
from typing import Any

from torch import nn

from autoshard.capture.guard import _converts, check_mode, check_weight_dtypes

_training = operator.attrgetter("training")
_dtype = operator.attrgetter("dtype")


class HeldState:
    """What a stage checks of itself on every call: its own mode and its modules' (``leaves``,
    paths of the modules its graph calls), and the dtypes of the parameters it reads directly
    (``weights``, paths) or inside those modules (each module's first convertible parameter, its
    own or its children's: a conversion converts them all, and reading one per module keeps the
    check short)."""

    def __init__(self, owner: nn.Module, leaves: tuple[str, ...], weights: tuple[str, ...]) -> None:
        self.owner = owner
        self.leaves = leaves
        self.weight_paths = weights
        self.captured_training = owner.training
        self._walk()
        self.modes = list(map(_training, self.modules))
        self.dtypes = frozenset(map(_dtype, self.weights()))
        self._remember(self.captured_training)

    def _walk(self) -> None:
        """Find the modules and parameters by path again, as the graph's code does."""
        self.modules = tuple(self.owner.get_submodule(path) for path in self.leaves)
        self.by_path = dict(zip(self.leaves, self.modules))
        inside = ((leaf, _first_parameter(module)) for leaf, module in zip(self.leaves, self.modules))
        found = [*self.weight_paths, *(f"{leaf}.{path}" for leaf, path in inside if path is not None)]
        steps: dict[tuple[int, str], tuple[dict[str, Any], str, nn.Module]] = {}
        for path in (*self.leaves, *(p.rpartition(".")[0] for p in found)):
            module = self.owner
            for name in path.split(".") if path else ():
                child = module._modules[name]
                steps.setdefault((id(module._modules), name), (module._modules, name, child))
                module = child
        self.step_dicts, self.step_names, self.step_modules = (tuple(s[i] for s in steps.values()) for i in range(3))
        owners = [self.owner.get_submodule(p.rpartition(".")[0]) for p in found]
        self.registries = tuple(module._parameters for module in owners)
        self.names = tuple(p.rpartition(".")[2] for p in found)

    def _reads(self, training: bool) -> tuple[Any, ...]:
        """What a call reads, in one tuple: the stage's flag, whether each step of the kept paths
        still leads to the module it led to (by identity), the modules' flags and the kept
        parameters' dtypes (KeyError or AttributeError: a parameter deleted or set to None)."""
        return (training, *map(operator.is_, map(dict.get, self.step_dicts, self.step_names), self.step_modules),
                *map(_training, self.modules), *map(_dtype, map(dict.__getitem__, self.registries, self.names)))

    def weights(self) -> list[Any]:
        """The parameters whose dtypes count, as registered now."""
        return [w for w in map(dict.get, self.registries, self.names) if w is not None]

    def check(self, training: bool) -> dict[str, nn.Module]:
        """The modules the stage calls, by path; raise ``InputMismatchError`` when the stage
        (``training``: its flag now) or one of them is in another mode than at capture, or a weight
        was converted. A call that reads what the last one read passes at once."""
        try:
            if self._reads(training) == self.seen:
                return self.by_path
        except (KeyError, AttributeError):  # a parameter deleted or set to None: found again below
            pass
        self._walk()
        check_mode(training, self.captured_training, tuple(map(_training, self.modules)), tuple(self.modes))
        check_weight_dtypes(self.dtypes, *self.weights())
        self._remember(training)
        return self.by_path

    def _remember(self, training: bool) -> None:
        """Keep what a call that passed read, for the next call to compare with."""
        try:
            self.seen: tuple[Any, ...] | None = self._reads(training)
        except (KeyError, AttributeError):
            self.seen = None  # checked in full on every call while a parameter is missing

    def __deepcopy__(self, memo: dict[int, Any]) -> HeldState:
        """A copy watches the copied stage (``memo`` maps the stage to its copy), found by path."""
        copied = HeldState.__new__(HeldState)
        copied.__setstate__({**self.__getstate__(), "owner": memo.get(id(self.owner), self.owner)})
        return copied

    def __getstate__(self) -> dict[str, Any]:
        return {"owner": self.owner, "leaves": self.leaves, "weight_paths": self.weight_paths,
                "captured_training": self.captured_training, "modes": self.modes, "dtypes": self.dtypes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # found by path on the first call, which nothing read before matches
        self.modules, self.registries, self.names = (), (), ()
        self.step_dicts, self.step_names, self.step_modules = (), (), ()
        self.by_path, self.seen = {}, None


def _first_parameter(module: nn.Module) -> str | None:
    """The path, from ``module``, of its first convertible parameter (its own, then its children's)."""
    for name, tensor in module._parameters.items():
        if tensor is not None and _converts(tensor.dtype):
            return name
    for child_name, child in module._modules.items():
        found = None if child is None else _first_parameter(child)
        if found is not None:
            return f"{child_name}.{found}"
    return None


def checked_modules(state: HeldState, training: bool) -> dict[str, nn.Module]:
    """The graph's call of ``state.check()``, given the stage's own flag (read as ``self.training``,
    so a copy of the stage that shares ``state`` is checked by its own flag): the modules the
    stage's code calls, by path."""
    return state.check(training)
