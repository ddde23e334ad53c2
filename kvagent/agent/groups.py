"""Exception groups at the edge of a nursery ladder: the caller's own exception comes back as itself."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["sole_exception", "unwrap_sole_exception"]


def sole_exception(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The single exception that nested one-member groups wrap (one group per nursery level), else None."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        if len(error.exceptions) != 1:
            return None
        error = error.exceptions[0]
    return error


@contextmanager
def unwrap_sole_exception() -> Iterator[None]:
    """Re-raise a group that wraps exactly one exception as that exception; real groups pass unchanged.

    Used around ``async with`` blocks that yield from inside nurseries, so a caller whose block raised
    ``KeyError`` gets ``KeyError`` back once the slot has shut down, not three nested groups.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        sole = sole_exception(group)
        if sole is None:
            raise
        raise sole from sole.__cause__
