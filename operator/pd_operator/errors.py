"""What a failed pass means for the next one: a terminal error waits for a change (or its
`retry_s`), anything else backs off."""
from __future__ import annotations

from .diagnosis import Diagnosis


class TerminalError(Exception):
    """Retrying at once will not help: wait for the spec to change, or `retry_s` (what another
    party may fix, such as a quota or a webhook that refused an object)."""

    def __init__(self, reason: str, message: str, retry_s: float | None = None):
        super().__init__(message)
        self.diagnosis = Diagnosis(reason, message)
        self.retry_s = retry_s


def error_policy(error: Exception, attempts: int) -> float | None:
    """Seconds until the next pass after a failed one; None: wait for a change."""
    if isinstance(error, TerminalError):
        return error.retry_s
    return min(30.0, 0.5 * 2 ** (attempts - 1))


def apply_retry_s(attempts: int) -> float:
    """An apply the API server refused is tried again after this (5 s doubling to 5 min)."""
    return min(300.0, 5.0 * 2 ** (attempts - 1))
