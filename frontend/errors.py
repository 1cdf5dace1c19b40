"""Errors the frontend raises to users."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process died, hung, or failed; no request on it can finish."""
