"""Export a plan as a ``{module_path: device}`` map of the kind ``accelerate`` dispatches.

Such a map places whole modules; a hook on each mapped module moves its inputs to its device.
So it can express a plan only where every value crossing to another device enters a mapped module.
The map is the coarsest one: a module all of whose operations run in one stage is mapped whole,
otherwise its children are considered. A crossing value consumed by the code of a module that is
not mapped whole (a residual ``x + f(x)`` cut between ``f`` and the add, an input added at the end
of the model) means the cut falls inside that module's forward: that module is *split*, and no
module map can run the plan. A weight read directly by such code gets an entry of its own.
"""

from __future__ import annotations

import warnings
from typing import Any, Hashable, Sequence

import torch

from autoshard.errors import (
    InvalidArgumentError, InvalidArgumentTypeError, ModuleSplitError, shown, user_stacklevel)
from autoshard.sharded import ShardedModel

ROOT = ""


def _device_key(device: Any) -> Hashable:
    return str(device) if isinstance(device, torch.device) else device


class _Placement:
    """Which device every node, module and directly-read weight of the plan ends up on."""

    def __init__(self, sharded: ShardedModel, devices: Sequence[Any]) -> None:
        self.dag = sharded.plan.dag
        self.devices = list(devices)
        assignment = sharded.plan.assignment
        self.node_device = {node: _device_key(devices[assignment.get(node, 0)]) for node in self.dag.nodes}
        spans: dict[str, set[Hashable]] = {ROOT: set()}  # in program order of each module's first node
        for node, data in self.dag.nodes(data=True):
            if data.get("readers"):  # a size each reader's stage recomputes: no one device runs it, and no
                continue  # value of it crosses (placed with its first reader, it showed its own module cut)
            for path, _ in data.get("scopes", ()):
                spans.setdefault(path, set()).add(self.node_device[node])
            spans[ROOT].add(self.node_device[node])
        self.spans = spans
        self.mapped = self._coarsest_cover()

    def _coarsest_cover(self) -> dict[str, Hashable]:
        """Modules running on one device whose ancestors do not, in program order."""
        mapped: dict[str, Hashable] = {}
        for path in sorted(self.spans, key=lambda p: -1 if p == ROOT else p.count(".")):
            inside_mapped = ROOT in mapped or any(path.startswith(m + ".") for m in mapped)
            if len(self.spans[path]) == 1 and not inside_mapped:
                mapped[path] = next(iter(self.spans[path]))
        return {path: mapped[path] for path in self.spans if path in mapped}

    def mapped_scope(self, node: str) -> str | None:
        if ROOT in self.mapped:
            return ROOT
        return next((p for p, _ in self.dag.nodes[node].get("scopes", ()) if p in self.mapped), None)

    def owner_device(self, weight: str) -> Hashable | None:
        return _owner_device(self.mapped, weight)


def _owner_device(mapped: dict[str, Any], weight: str) -> Any:
    """The device of the module of ``mapped`` that owns ``weight``, if any does."""
    parts = weight.split(".")
    owners = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
    return next((mapped[o] for o in owners if o in mapped), None)


def _module_of(node_data: dict[str, Any]) -> str:
    return node_data.get("module") or ROOT


def _analyse(sharded: ShardedModel, devices: Sequence[Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    place = _Placement(sharded, devices)
    dag = place.dag
    split: set[str] = set()
    for producer, consumer in dag.edges:
        # a shape carrier (``lowering.shape_carriers``) is a size where the model runs: no tensor moves
        crosses = (place.node_device[producer] != place.node_device[consumer]
                   and not dag.nodes[producer].get("made_from"))
        if crosses and place.mapped_scope(consumer) is None:
            split.add(_module_of(dag.nodes[consumer]))
    weight_devices: dict[str, set[Hashable]] = {}
    for node, data in dag.nodes(data=True):
        if place.mapped_scope(node) is not None:
            continue
        for weight in data.get("weights", ()):
            owner = place.owner_device(weight)
            if owner is not None and owner != place.node_device[node]:
                split.add(_module_of(data))
            elif owner is None:
                weight_devices.setdefault(weight, set()).add(place.node_device[node])
    entries = {path: device for path, device in place.mapped.items()}
    for weight, found in weight_devices.items():
        if len(found) > 1:
            split.add(weight.rpartition(".")[0])
        else:
            entries[weight] = next(iter(found))
    by_key = {_device_key(d): d for d in devices}
    return {path: by_key[key] for path, key in entries.items()}, tuple(sorted(split))


def _devices_for(sharded: ShardedModel, devices: Sequence[Any] | None) -> list[Any]:
    """One device per stage, each as a device map names one (GPU index, 'cpu', 'cuda:1', 'disk'),
    where it need not exist: a map may be planned for another machine."""
    if not isinstance(sharded, ShardedModel):
        raise InvalidArgumentTypeError(f"a device map is made of shard_model's result, got {type(sharded).__name__}")
    if devices is None:
        return list(range(sharded.num_stages))
    if isinstance(devices, (str, int, torch.device)):
        raise InvalidArgumentTypeError(f"devices takes one device per stage, such as {list(range(sharded.num_stages))} "
                                       f"or ['cuda:0', 'cpu'], got {shown(devices)}")
    devices = list(devices)
    if len(devices) != sharded.num_stages:
        raise InvalidArgumentError(
            f"the plan has {sharded.num_stages} stages but {len(devices)} devices were given; "
            "give one per stage")
    for j, device in enumerate(devices):
        if not _is_device(device):
            raise InvalidArgumentError(f"devices[{j}] is {shown(device)}, which is not a device: give a GPU index, "
                                       "'cpu', 'cuda:1', 'disk' or a torch.device")
    return devices


def _is_device(device: Any) -> bool:
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        return False
    if isinstance(device, int) or device == "disk":  # (accelerate offloads to disk)
        return device == "disk" or device >= 0
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        return False
    return True


def split_modules(sharded: ShardedModel, devices: Sequence[Any] | None = None) -> tuple[str, ...]:
    """Modules whose own forward a stage boundary cuts through ('' is the model's own forward)."""
    return _analyse(sharded, _devices_for(sharded, devices))[1]


def device_map(sharded: ShardedModel, devices: Sequence[Any] | None = None) -> dict[str, Any]:
    """``{module_path: device}`` placing stage ``i`` on ``devices[i]`` (default: GPU ``i``).

    Raises ``ModuleSplitError`` naming the modules a boundary cuts through when there are any.
    Modules no stage runs (a head the forward skips) are in no entry, since the plan does not
    hold them: place them yourself where a dispatcher needs every module.
    """
    mapping, split = _analyse(sharded, _devices_for(sharded, devices))
    if split:
        raise ModuleSplitError(_split_message(split), split)
    _warn_of_ties_across_devices(sharded, mapping)
    return mapping


class TiedAcrossDevicesWarning(UserWarning):
    """A device map places the modules holding one tied weight on different devices."""


def _warn_of_ties_across_devices(sharded: ShardedModel, mapping: dict[str, Any]) -> None:
    """A weight several modules hold (an LM head tied to the embedding) is one tensor, on one device: a
    dispatcher following the map finds it on the other module's device, where the pipeline runtimes
    hold a copy per stage and sum their gradients (``TiedGradients``)."""
    def device_of(name: str) -> Any:  # its module's, or its own entry's (a weight the model's forward reads)
        owner = _owner_device(mapping, name)
        return mapping.get(name) if owner is None else owner
    ties = [names for info in sharded.plan.dag.graph.get("weights", {}).values()
            if len(names := tuple(getattr(info, "names", ()))) > 1
            and len({_device_key(device_of(n)) for n in names}) > 1]
    if ties:
        listed = "; ".join(", ".join(f"{n!r} on {device_of(n)!r}" for n in names) for names in ties)
        warnings.warn(
            f"tied weights on different devices ({listed}): a tensor lives on one device, so a dispatcher "
            "following this map must move it for the other module's forward on every call; place the holders "
            "in one stage (shard_model(..., pin={module: stage})) to map them together, or run the stages "
            "themselves (pipeline_stage), which hold a copy per stage",
            TiedAcrossDevicesWarning, stacklevel=user_stacklevel())


def _split_message(split: tuple[str, ...]) -> str:
    """What is cut and what to do: a submodule can be kept whole; the model's own forward cannot."""
    names = ", ".join("'' (the model's own forward)" if m == ROOT else repr(m) for m in split)
    advice = []
    children = [m for m in split if m != ROOT]
    if children:
        advice.append(f"keep {'it' if len(children) == 1 else 'them'} whole in the split "
                      f"(shard_model(..., no_split={children!r}), or the pipeline option "
                      f"split{{no-split={','.join(children)}}})")
    if ROOT in split:
        advice.append("the model's own forward cannot be kept whole, so start the stages where only a "
                      "submodule's input crosses, if the model has such points "
                      "(cut_before=[PATH], split{cut-before=PATH})")
    advice.append("or run the stages themselves (pipeline_stage, OffloadRunner), which carry such values")
    return (f"stage boundaries fall inside the forward of {names}: their own code would run on values "
            "from different devices, which a {module: device} map cannot express; " + "; ".join(advice))
