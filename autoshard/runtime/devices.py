"""Turn a device spec into a ``torch.device`` that exists here, or say why it cannot be used.

Checked before anything is sent: a stage placed on a GPU the machine lacks would otherwise fail
inside the first collective, after its peers are already waiting.
"""

from __future__ import annotations

from typing import Union

import torch

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
