"""Errors a caller of the capacity model can trigger.

"It does not fit" is usually an answer, not an error: `max_concurrent_sequences`
returns 0 and the planners return rows marked as not fitting. The exceptions below
mean the caller asked a question that has no answer as written. Each message names
the offending value and what would fix it.

Like every error of the package they are `placement.errors.PlacementError`s (one root
to catch), and also the built-in kinds they always were:

    PlacementError
    ├── UnsupportedModel      (ValueError) a config.json this model cannot read (unknown
    │                         attention layout, unknown quantization method, missing field)
    ├── InvalidEngineShape    (ValueError) a TP / DCP / PP combination no engine can run
    ├── CapacityError         (ValueError) a question that needs the model to fit, asked
    │                         of a device or shape that cannot hold it at all
    └── UnknownDevice         (LookupError) a device name that is not in the catalog
"""

from __future__ import annotations

from placement.errors import PlacementError

__all__ = ["CapacityError", "InvalidEngineShape", "UnknownDevice", "UnsupportedModel"]


class UnsupportedModel(PlacementError, ValueError):
    """The Hugging Face config describes something the model spec cannot represent."""


class InvalidEngineShape(PlacementError, ValueError):
    """A parallel layout that the engine rejects (e.g. DCP not dividing TP)."""


class CapacityError(PlacementError, ValueError):
    """The model cannot be held at all by the device or shape that was asked about."""


class UnknownDevice(PlacementError, LookupError):
    """A device name that the catalog does not list."""
