"""The slot coordinator's counters (bumped on the hot path) and their frozen snapshot (sans-IO)."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

__all__ = ["CoordinatorCounters", "CoordinatorStatistics"]


@attrs.frozen(slots=True)
class CoordinatorStatistics:
    """A snapshot of one slot coordinator's counters (all count since the agent started, never reset).

    Attributes:
        events_in: placement events taken from ingress chunks.
        events_published: RouterEvents the sink accepted.
        events_out_ids: outbound event ids assigned (published or not).
        events_filtered: events dropped before publication, by reason.
        dropped_events: raw batches lost to source cursor gaps (``engines_dropped_events``).
        quarantines: quarantines of an attachment, by reason.
        attachments: attachments that became ready.
        restarts: in-place engine restarts detected from a regressing raw sequence.
        publications: sink calls (one per published chunk).
        publication_failures: sink calls that raised.
        source_losses: raw batches the listener reported as unrepairable.
        ingress_chunks: ingress chunks handled (live and detach drain).
        ingress_queue_depth: chunks and signals admitted but not yet handled (0 for the bare sans-IO
            coordinator).
        degradations: times the attachment went ``degraded`` (history lost).
        disconnects: times the attachment went ``disconnected`` (the engine's connection dropped).
        resyncs: times the attachment returned to ``ready`` from degraded or disconnected.
        source_resets: Worker reset barriers published for a listener's source signal.
        signals_ignored: source signals for a generation that was not the open attachment.
        ingress_bytes: raw payload bytes of the chunks admitted but not yet handled (0 for the bare core).
    """

    events_in: int
    events_published: int
    events_out_ids: int
    events_filtered: Mapping[str, int]
    dropped_events: int
    quarantines: Mapping[str, int]
    attachments: int
    restarts: int
    publications: int
    publication_failures: int
    source_losses: int
    ingress_chunks: int
    ingress_queue_depth: int = 0
    degradations: int = 0
    disconnects: int = 0
    resyncs: int = 0
    source_resets: int = 0
    signals_ignored: int = 0
    ingress_bytes: int = 0


@attrs.define(slots=True)
class CoordinatorCounters:
    """The coordinator's plain counters, bumped on the hot path; :meth:`statistics` snapshots them."""

    events_in: int = 0
    events_published: int = 0
    events_out_ids: int = 0
    events_filtered: dict[str, int] = attrs.Factory(dict)
    dropped_events: int = 0
    quarantines: dict[str, int] = attrs.Factory(dict)
    attachments: int = 0
    restarts: int = 0
    publications: int = 0
    publication_failures: int = 0
    source_losses: int = 0
    ingress_chunks: int = 0
    degradations: int = 0
    disconnects: int = 0
    resyncs: int = 0
    source_resets: int = 0
    signals_ignored: int = 0

    def count_filtered(self, reason: str, n: int = 1) -> None:
        if n:
            self.events_filtered[reason] = self.events_filtered.get(reason, 0) + n

    def statistics(self, *, ingress_queue_depth: int = 0, ingress_bytes: int = 0) -> CoordinatorStatistics:
        # asdict copies the labelled counters, so the snapshot never changes afterwards.
        return CoordinatorStatistics(
            **attrs.asdict(self), ingress_queue_depth=ingress_queue_depth, ingress_bytes=ingress_bytes
        )
