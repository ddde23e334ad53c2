"""Decoder + normalizer fuzzing: ``python -m tests.support.fuzz_decoder`` (``nox -s fuzz``; N from KVAGENT_FUZZ_INPUTS).

Inputs are mutated vector payloads (byte flips, truncation, splices) and generated msgpack batches.
Only the typed errors may escape; anything else is reported and makes the run fail. Every input also goes
through decode (the typed decoder first) next to the checked decoder, and through the normalizer's inlined
shapes next to per-event normalization, each with its own normalizer: any difference in the decoded batch
or the normalized result counts as a failure too.
"""

from __future__ import annotations

import os
import random
import sys
import time
import traceback

import msgpack

from kvagent.model.errors import ChunkingError, WireDecodeError
from kvagent.model.events import WorkerWithDpRank
from kvagent.vllm.decode import RawBatch, _decode_checked, _decode_typed, decode
from kvagent.vllm.normalize import AttachmentNormalizer, NormalizedBatch, build_ingress_chunks
from kvagent.wire.vllm_events import END_SEQ
from tests.support.vectors import load_live, load_structs

TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "TierBlocksCleared", "Bogus"]


def _seeds() -> list[list[bytes]]:
    seeds = [frames for (_note, frames) in load_structs().values() if len(frames) == 3]
    return seeds + load_live()[0]


def _random_value(rng: random.Random, depth: int = 0) -> object:
    choice = rng.randrange(9 if depth < 3 else 6)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([0, 1, -1, 2**63, 2**64 - 1, -(2**63), rng.randrange(2**64)])
    if choice == 2:
        return rng.choice(
            ["GPU", "CPU", "kvcr", "LOCAL", "REMOTE", "", "full_attention", "x" * rng.randrange(80)]
        )
    if choice == 3:
        return rng.random()
    if choice == 4:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    if choice == 5:
        return rng.choice([True, False])
    if choice == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    if choice == 7:
        keys = [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "medium",
            "ownership",
            "locality",
            "group_idx",
            "kv_cache_spec_kind",
            "extra_keys",
            "lora_name",
            "session_id",
        ]
        return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(8))} | (
            {"type": rng.choice(TAGS)} if rng.random() < 0.8 else {}
        )
    return [rng.choice(TAGS), *(_random_value(rng, depth + 1) for _ in range(rng.randrange(14)))]


def generate(rng: random.Random, seeds: list[list[bytes]]) -> list[bytes]:
    frames = list(rng.choice(seeds))
    mode = rng.randrange(4)
    payload = bytearray(frames[2])
    if mode == 0:
        for _ in range(rng.randrange(1, 8)):
            if payload:
                payload[rng.randrange(len(payload))] = rng.randrange(256)
    elif mode == 1 and payload:
        payload = payload[: rng.randrange(len(payload) + 1)]
    elif mode == 2:
        other = rng.choice(seeds)[2]
        cut = rng.randrange(len(payload) + 1)
        payload = payload[:cut] + other[rng.randrange(len(other) + 1) :]
    else:
        events = [_random_value(rng) for _ in range(rng.randrange(6))]
        try:
            payload = bytearray(msgpack.packb([rng.random(), events, rng.choice([None, 0, 1, -1])]))
        except (OverflowError, TypeError, ValueError):
            payload = bytearray(b"\xc1")
    if rng.random() < 0.05:
        frames[1] = frames[1][: rng.randrange(9)]
    return [frames[0], frames[1], bytes(payload)][: 3 if rng.random() > 0.02 else 2]


class _Divergence(Exception):
    """The fast path and the general path disagree on an input."""


def normalize_each(normalizer: AttachmentNormalizer, batch: RawBatch) -> NormalizedBatch:
    """The general path: every event through ``normalize_event``, none inlined by ``normalize``."""
    out = NormalizedBatch([])
    for event in batch.events:
        normalizer.normalize_event(event, out)
    return out


def _check_refusal(frames: list[bytes], error: str) -> None:
    """decode refused the frames: when they are well formed, the checked decoder refuses the payload alike."""
    if len(frames) != 3 or len(frames[1]) != 8 or frames[1] == END_SEQ:
        return  # a frame-level error, before any payload decoder runs
    try:
        _decode_checked(frames[2], True)
    except WireDecodeError as checked:
        if str(checked) != error:
            raise _Divergence(f"different errors: {error!r} vs {str(checked)!r}") from None
    else:
        if "exceeds" not in error:
            raise _Divergence(f"decode refused what the checked decoder accepts: {error}")


def _check(frames: list[bytes], normalizer: AttachmentNormalizer, reference: AttachmentNormalizer) -> None:
    """decode + normalize (fast paths included) against the checked decoder + per-event normalization."""
    try:
        message = decode(frames)
    except WireDecodeError as error:
        _check_refusal(frames, str(error))
        return
    typed = _decode_typed(frames[2])
    try:
        checked = _decode_checked(frames[2], True)
    except WireDecodeError as error:
        # Deliberate: msgspec never decodes the values of keys it does not know (decode's docstring).
        if typed is None or "can't decode" not in str(error):
            raise _Divergence(f"decode accepted what the checked decoder refuses: {error}") from None
        return
    if typed is not None and typed != checked:
        raise _Divergence("typed and checked decoders disagree")
    if message.batch != checked:
        raise _Divergence("decode differs from the checked decoder")
    expected = normalize_each(reference, checked)
    if normalizer.normalize(message.batch) != expected:
        raise _Divergence("fast and general normalization disagree")
    build_ingress_chunks(1, message.seq, expected)


def run(count: int, seed: int = 1) -> int:
    rng = random.Random(seed)
    seeds = _seeds()
    unexpected = 0
    normalizer = AttachmentNormalizer(kv_block_size=16, worker=WorkerWithDpRank(1, 0))
    fast_normalizer = AttachmentNormalizer(kv_block_size=16, worker=WorkerWithDpRank(1, 0))
    for _ in range(count):
        frames = generate(rng, seeds)
        try:
            _check(frames, fast_normalizer, normalizer)
        except ChunkingError:
            continue
        except Exception:
            unexpected += 1
            if unexpected <= 5:
                traceback.print_exc()
                print("input:", [f.hex() for f in frames], file=sys.stderr)
            # Start both normalizers afresh so one divergence is not reported again for every later input.
            normalizer = AttachmentNormalizer(kv_block_size=16, worker=WorkerWithDpRank(1, 0))
            fast_normalizer = AttachmentNormalizer(kv_block_size=16, worker=WorkerWithDpRank(1, 0))
    return unexpected


def main() -> int:
    count = int(os.environ.get("KVAGENT_FUZZ_INPUTS", "1000000"))
    started = time.perf_counter()
    unexpected = run(count)
    print(f"{count} inputs, {unexpected} unexpected exceptions ({time.perf_counter() - started:.1f} s)")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
