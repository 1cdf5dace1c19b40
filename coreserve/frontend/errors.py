"""Errors the frontend raises to users."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process died, hung, or failed; no request on it can finish."""


class RequestFailedError(ValueError):
    """One request was refused by the engine core (bad input the frontend could not see), or handling
    its output failed; the engine and every other request go on. A ValueError, like every bad input."""
