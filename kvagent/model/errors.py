"""One error hierarchy: every error kvagent raises is a :class:`KvAgentError` with a stable ``code``.

``code`` is one of :data:`ERROR_CODES`, the websocket API's error codes; each subclass names its default.
Errors that stand for bad input also keep the builtin base they always had (``ValueError``,
``RuntimeError``), so callers that catch those keep working.
"""

from __future__ import annotations

__all__ = [
    "ERROR_CODES",
    "ChunkingError",
    "CodecError",
    "ConfigError",
    "CoordinatorClosed",
    "CoordinatorError",
    "DiscoveryConflict",
    "DiscoveryError",
    "FollowOverrun",
    "IdentityError",
    "IndexApplyError",
    "KvAgentError",
    "ListenerError",
    "RecoveryClientError",
    "SinkError",
    "SlotOwnershipError",
    "WireDecodeError",
]

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
        "overloaded",
        "slot_owned",
    }
)


class KvAgentError(Exception):
    """The root: a lifecycle or request failure; ``code`` is one of :data:`ERROR_CODES`."""

    default_code = "bad_request"

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        code = self.default_code if code is None else code
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message


# --- model and wire: values that cannot be formed or decoded ----------------------------------------


class IdentityError(KvAgentError, ValueError):
    """Identity material or text that cannot form a valid id."""


class CodecError(KvAgentError, ValueError):
    """A RouterEvent payload that cannot be decoded; the message names the offending field."""


class WireDecodeError(KvAgentError, ValueError):
    """A message or payload that is not a valid vLLM KV event batch."""


class ChunkingError(KvAgentError, ValueError):
    """A raw batch that cannot be split into bounded ingress chunks; it terminates the listener."""


class ConfigError(KvAgentError, ValueError):
    """An invalid configuration; ``errors`` lists each ``path: problem`` line."""

    def __init__(self, message: str, errors: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.errors = errors or (message,)


# --- the pipeline: listener, coordinator, index, sinks ---------------------------------------------


class ListenerError(KvAgentError):
    """A condition that ends the listener (and so quarantines its attachment)."""

    default_code = "internal"


class CoordinatorError(KvAgentError):
    """A lifecycle command or an ingress chunk the coordinator refused or could not complete."""


class CoordinatorClosed(KvAgentError):
    """The coordinator task is gone; nothing can be sent to it any more."""

    default_code = "internal"

    def __init__(self, message: str = "state-agent coordinator is closed") -> None:
        super().__init__(message)


class IndexApplyError(KvAgentError, RuntimeError):
    """An event the index refuses; nothing of it was applied or buffered."""

    default_code = "internal"


class SinkError(KvAgentError, RuntimeError):
    """A publication failed; Stored/Removed are lossy, a failed Cleared retires its domain."""

    default_code = "internal"


# --- discovery ---------------------------------------------------------------------------------------


class DiscoveryError(KvAgentError):
    """A discovery backend failed, or a stored record is malformed."""

    default_code = "internal"


class DiscoveryConflict(DiscoveryError):
    """A record id is already registered with a different payload."""

    default_code = "conflict"


class SlotOwnershipError(DiscoveryError):
    """Another agent (this process or another) already serves the slot's CacheOwnerId in this discovery
    namespace; the message is one line naming the slot, the holder and what to do."""

    default_code = "slot_owned"


# --- the recovery client -------------------------------------------------------------------------------


class RecoveryClientError(KvAgentError):
    """An error response (``code`` is the server's error code, kept as sent) or an unusable server answer."""

    def __init__(self, code: str, message: str) -> None:
        # The code comes from the server and is kept verbatim, even one this version does not know.
        Exception.__init__(self, f"{code}: {message}")
        self.code = code
        self.message = message


class FollowOverrun(KvAgentError):
    """The server dropped this follower for falling behind; resume with ``follow(last_sent)``."""

    default_code = "too_large"

    def __init__(self, last_sent: int) -> None:
        super().__init__(f"follower overrun; resume from {last_sent}")
        self.last_sent = last_sent
