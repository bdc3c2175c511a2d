"""Turn a device spec into a ``torch.device`` that exists here, or say why it cannot be used;
point a stage's graph at the device it runs on.

Checked before anything is sent: a stage placed on a GPU the machine lacks would otherwise fail
inside the first collective, after its peers are already waiting.

A plan is made where the example inputs are, usually the CPU, and the capture freezes what the
model asked of them: ``torch.arange(n, device=x.device)`` becomes ``device=cpu``. Emitted stages
read that device from their inputs at run time (``autoshard.emit.stage_device``), falling back to
the captured one when a stage has no tensor input; a runtime that knows its device names it there
too, so the stage's copy holds no CPU device at all.
"""

from __future__ import annotations

from typing import Union

import torch
import torch.fx as fx

from autoshard.errors import DeviceUnavailableError, InvalidArgumentError

DeviceLike = Union[str, int, torch.device]


def resolve_device(device: DeviceLike, what: str = "the stage") -> torch.device:
    """``device`` as a ``torch.device``; ``DeviceUnavailableError`` if this machine has no such device."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(
            f"{what} was given device {device!r}, which is not a device: {exc}; "
            "use 'cpu', 'cuda', 'cuda:1' or a torch.device") from None
    if resolved.type in ("cpu", "meta"):
        return resolved
    backend = getattr(torch, resolved.type, None)
    if backend is None or not backend.is_available():
        raise DeviceUnavailableError(
            f"{what} is placed on {resolved} but this machine has no {resolved.type} device "
            f"(torch.{resolved.type}.is_available() is False); place it on 'cpu' or run where "
            f"a {resolved.type} device exists")
    count = backend.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise DeviceUnavailableError(
            f"{what} is placed on {resolved} but this machine has {count} {resolved.type} "
            f"device(s), numbered 0 to {count - 1}; pick one of those (with torchrun, usually "
            f"{resolved.type}:LOCAL_RANK)")
    return resolved


def retarget_devices(module: fx.GraphModule, device: torch.device) -> None:
    """Replace every ``torch.device`` constant in ``module``'s graph by ``device``, in place: a
    stage runs on one device, whichever device the model's example inputs were on."""
    def swap(value: object) -> object:
        return device if isinstance(value, torch.device) else value

    for node in module.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    module.recompile()
