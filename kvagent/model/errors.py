"""Errors with a stable machine-readable code (the websocket API's error codes)."""

from __future__ import annotations

__all__ = ["KvAgentError"]

ERROR_CODES = frozenset(
    {
        "bad_request",
        "unknown_op",
        "unauthorized",
        "identity_mismatch",
        "generation_mismatch",
        "not_ready",
        "too_large",
        "internal",
        "conflict",
    }
)


class KvAgentError(Exception):
    """A lifecycle or request failure; ``code`` is one of :data:`ERROR_CODES`."""

    def __init__(self, message: str, *, code: str = "bad_request") -> None:
        assert code in ERROR_CODES, code
        super().__init__(message)
        self.code = code
        self.message = message
