"""``ExampleInputs``: the inputs a model is called with, a value type every layer may import.

The costs, capture and pass modules all take example inputs; defined here, apart from the pass
framework (``autoshard.passes.base`` re-exports it), so the modules below the passes can name
it without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class ExampleInputs:
    """Positional and keyword inputs that the model is called with."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
