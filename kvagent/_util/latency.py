"""A latency histogram cheap enough to observe once per drain or request, snapshotted at scrape time.

The metrics collector (:mod:`kvagent.agent.metrics`) renders a :class:`LatencySnapshot` as a Prometheus
histogram (``prometheus_client``'s ``HistogramMetricFamily``: ``_bucket{le}``, ``_sum``, ``_count``), in
the same snapshot style as every other statistic: the observing side only bumps plain counters.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs

__all__ = ["DEFAULT_BUCKETS", "LatencyHistogram", "LatencySnapshot"]

# Upper bounds in seconds, from 10 µs (one small drain) to 10 s (a large dump); +Inf is implied.
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


@attrs.frozen(slots=True)
class LatencySnapshot:
    """Observations per bucket (not cumulative; the last entry counts those above every bound) and their sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of observations <= le)`` per bound, then ``("+Inf", count)``: Prometheus buckets."""
        buckets: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            buckets.append((repr(float(bound)), running))
        buckets.append(("+Inf", self.count))
        return buckets


class LatencyHistogram:
    """Counts observations into fixed buckets; :meth:`observe` is a bisect and two additions."""

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: Sequence[float] = DEFAULT_BUCKETS) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram bounds must be strictly increasing")
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        # bisect_left: an observation equal to a bound belongs to that bound's bucket (le is "<=").
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> LatencySnapshot:
        return LatencySnapshot(self._bounds, tuple(self._counts), self._sum)
