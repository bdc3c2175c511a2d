"""The one check a stage makes of the modules it holds, cheap enough to run on every microbatch.

A stage's graph fixed what its modules' code read from ``self.training`` and from their weights'
dtypes, so every call checks that the stage and the modules it calls are in the modes they were
captured in and that no weight was converted (``check_mode``, ``check_weight_dtypes`` say what is
wrong). Walking the module tree by path for that (``getattr(self.blocks, "0").ln_1.training``)
cost more than small layers compute. As torch.compile's guards do, the walk is done once and its
result kept: the modules and the parameters whose dtypes count, as flat tuples that a call reads
with C-level ``map``. The walk is redone when a module or parameter has been registered into any
module of the stage since (a submodule replaced, ``module.weight = nn.Parameter(...)``): a counter,
bumped by PyTorch's global module and parameter registration hooks, says so. Parameters are read
from their modules' registries on every call, so a conversion is seen whether it swaps a
parameter's data or puts a new one in the registry.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Iterable

from torch import nn
from torch.nn.modules import module as module_hooks

from autoshard.capture.guard import _converts, check_mode, check_weight_dtypes

_training = operator.attrgetter("training")
_dtype = operator.attrgetter("dtype")


class _Registrations:
    """How many modules and parameters have been registered into a module some stage holds, since
    the hooks went in. Registrations elsewhere do not count: a forward that slices a ModuleList
    (``self.layers[:n]``) builds a new container on every call."""

    count = 0
    watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    installed = False

    @classmethod
    def watch(cls, modules: Iterable[nn.Module]) -> None:
        if not cls.installed:
            module_hooks.register_module_module_registration_hook(cls._seen)
            module_hooks.register_module_parameter_registration_hook(cls._seen)
            cls.installed = True
        cls.watched.update(modules)

    @classmethod
    def _seen(cls, parent: nn.Module, *_: Any) -> None:
        if parent in cls.watched:
            cls.count += 1


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
        self._walk()
        self.modes = list(map(_training, self.modules))
        self.dtypes = frozenset(map(_dtype, self.weights()))
        self.seen = _Registrations.count

    def _walk(self) -> None:
        """Find the modules and parameters by path again, as the graph's code does, and watch every
        module under the stage for registrations that would change what the paths lead to."""
        _Registrations.watch(self.owner.modules())
        self.modules = (self.owner, *(self.owner.get_submodule(path) for path in self.leaves))
        held: list[tuple[dict[str, Any], str]] = []
        for path in self.weight_paths:
            owner, _, name = path.rpartition(".")
            held.append((self.owner.get_submodule(owner)._parameters, name))
        held += [found for found in map(_first_parameter, self.modules[1:]) if found is not None]
        self.registries = tuple(registry for registry, _ in held)
        self.names = tuple(name for _, name in held)

    def weights(self) -> list[Any]:
        """The parameters whose dtypes count, as registered now (read on every call, never kept: a
        runtime may swap in copies for one call, ``functional_call``, which must not outlive it)."""
        return [w for w in map(dict.get, self.registries, self.names) if w is not None]

    def check(self) -> None:
        """Raise ``InputMismatchError`` when a mode or a weight dtype changed since capture."""
        if (self.seen == _Registrations.count and list(map(_training, self.modules)) == self.modes
                and set(map(_dtype, self.weights())) <= self.dtypes):
            return
        self._walk()
        self.seen = _Registrations.count
        now = list(map(_training, self.modules))
        check_mode(now[0], self.modes[0], tuple(now[1:]), tuple(self.modes[1:]))
        check_weight_dtypes(self.dtypes, *self.weights())

    def __deepcopy__(self, memo: dict[int, Any]) -> HeldState:
        """A copy watches the copied stage (``memo`` maps the stage to its copy), found by path."""
        copied = HeldState.__new__(HeldState)
        copied.__setstate__({**self.__getstate__(), "owner": memo.get(id(self.owner), self.owner)})
        return copied

    def __getstate__(self) -> dict[str, Any]:
        return {"owner": self.owner, "leaves": self.leaves, "weight_paths": self.weight_paths,
                "modes": self.modes, "dtypes": self.dtypes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.modules, self.registries, self.names = (), (), ()
        self.seen = -1  # found by path on the first call, when the owner is whole


def _first_parameter(module: nn.Module) -> tuple[dict[str, Any], str] | None:
    """Where ``module``'s first convertible parameter is registered (its own, then its children's)."""
    for name, tensor in module._parameters.items():
        if tensor is not None and _converts(tensor.dtype):
            return module._parameters, name
    for child in module._modules.values():
        found = None if child is None else _first_parameter(child)
        if found is not None:
            return found
    return None


def check_held_state(state: HeldState) -> None:
    """The graph's call of ``state.check()``: a function, so a stage's code names it plainly."""
    state.check()
