"""Errors a caller of the pure policies can trigger.

The tree::

    PolicyError                      base of every error raised by `policies/`
    ├── InvalidPolicyConfig          a config field is out of range (also a ValueError)
    └── InvalidTurn                  a turn report contradicts itself (also a ValueError)

"Cannot right now" is never an exception here: a turn that cannot reuse KV gets a
`RECOMPUTE` decision with a reason, and reports about unknown sessions are ignored
(they return an empty effect list or ``False``). Exceptions mean the caller passed
something that can never be right, and each message names the value and the fix.
"""

from __future__ import annotations

__all__ = ["InvalidPolicyConfig", "InvalidTurn", "PolicyError"]


class PolicyError(Exception):
    """Base of every error raised by the pure policies."""


class InvalidPolicyConfig(PolicyError, ValueError):
    """A policy config field is out of range; the message names the field and the valid range."""


class InvalidTurn(PolicyError, ValueError):
    """A turn report that can never be valid, e.g. KV kept for zero tokens."""
