"""The vLLM wire decoder (kvagent.vllm.decode): documented byte examples, every event layout, hash forms, replay frames, fuzzing."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagent.model.errors import WireDecodeError
from kvagent.model.events import WorkerWithDpRank
from kvagent.model.hashing import pack_tokens
from kvagent.vllm.decode import (
    RawAllBlocksCleared,
    RawBlockRemoved,
    RawBlockStored,
    RawEagleBlockStored,
    RawIgnored,
    decode,
    decode_payload,
    decode_seq,
)
from kvagent.vllm.normalize import AttachmentNormalizer
from tests.support.vectors import load_live, load_structs

H = 15760518052499183552  # docs/spec/vllm-wire.md 6.5: a real hash >= 2^63 from a 0.26.0 capture
SEQ1 = (1).to_bytes(8, "big")
END = b"\xff" * 8


def payload(*events: object, rank: object = 0) -> bytes:
    packed: bytes = msgpack.packb([1.0, list(events), rank])
    return packed


def one(*event: object) -> object:
    (decoded,) = decode_payload(payload(list(event) if len(event) > 1 else event[0])).events
    return decoded


# --- docs/spec/vllm-wire.md 6.5 byte-level examples ---------------------------------------------------------------


def test_v0_9_example_42_bytes() -> None:
    data = bytes.fromhex("92cb41d954fc402000009196ab426c6f636b53746f72656491cfdab89baa7b5857c0c0940102030404c0")
    assert len(data) == 42
    batch = decode_payload(data)
    assert (batch.ts, batch.data_parallel_rank) == (1700000000.5, None)
    assert batch.events == (RawBlockStored((H,), None, (1, 2, 3, 4), 4),)


def test_legacy_array_example_99_bytes() -> None:
    data = bytes.fromhex(
        "93cb41d954fc40200000939cab426c6f636b53746f72656491cfdab89baa7b5857c0c0940102030404c0a3475055"
        "c0c0c0c0c094ac426c6f636b52656d6f76656491cfdab89baa7b5857c0a3475055c091b0416c6c426c6f636b73436c"
        "656172656400"
    )
    assert len(data) == 99
    batch = decode_payload(data)
    assert (batch.ts, batch.data_parallel_rank) == (1700000000.5, 0)
    assert batch.events == (
        RawBlockStored((H,), None, (1, 2, 3, 4), 4, medium="GPU"),
        RawBlockRemoved((H,), "GPU", None),
        RawAllBlocksCleared(),
    )


def test_map_example_275_bytes() -> None:
    data = bytes.fromhex(
        "93cb41d954fc40200000938ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfdab89b"
        "aa7b5857c0b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73"
        "697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391"
        "c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84"
        "a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfdab89baa7b5857c0a66d65646975"
        "6da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400"
    )
    assert len(data) == 275
    batch = decode_payload(data)
    assert (batch.ts, batch.data_parallel_rank) == (1700000000.5, 0)
    assert batch.events == (
        RawBlockStored(
            (H,),
            None,
            (1, 2, 3, 4),
            4,
            medium="GPU",
            extra_keys=(None,),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        RawBlockRemoved((H,), "GPU", 0),
        RawAllBlocksCleared(),
    )


# --- envelope and frames --------------------------------------------------------------------------------


def test_envelope_lengths_and_extras() -> None:
    assert decode_payload(msgpack.packb([2.0, []])).data_parallel_rank is None
    batch = decode_payload(msgpack.packb([2, [], 5, "extra", None]))
    assert (batch.ts, batch.events, batch.data_parallel_rank) == (2.0, (), 5)
    with pytest.raises(WireDecodeError, match="^envelope: expected"):
        decode_payload(msgpack.packb([2.0]))
    with pytest.raises(WireDecodeError, match="^envelope.ts: expected a float, got str"):
        decode_payload(msgpack.packb(["now", []]))
    with pytest.raises(WireDecodeError, match="^envelope.data_parallel_rank"):
        decode_payload(msgpack.packb([1.0, [], -1]))


def test_map_envelope_is_rejected_like_dynamo() -> None:
    with pytest.raises(WireDecodeError, match="^envelope: expected an array"):
        decode_payload(msgpack.packb({"ts": 1.0, "events": [], "data_parallel_rank": 0}))


def test_payload_bound_is_checked_before_unpacking() -> None:
    too_big = b"\xc1" * (8 * 1024 * 1024 + 1)  # 0xc1 is never valid msgpack: only the bound can reject first
    with pytest.raises(WireDecodeError, match="^ZMQ payload exceeds 8388608 bytes$"):
        decode_payload(too_big)
    with pytest.raises(WireDecodeError, match="^ZMQ payload exceeds 10 bytes$"):
        decode_payload(payload(), max_payload_bytes=10)
    with pytest.raises(WireDecodeError, match="^ZMQ payload exceeds 8388608 bytes$"):
        decode([b"t", SEQ1, too_big])


def test_frames_and_sequence() -> None:
    message = decode([b"kv-events", (2**40 + 3).to_bytes(8, "big"), payload()])
    assert (message.topic, message.seq, message.batch.events) == (b"kv-events", 2**40 + 3, ())
    assert decode_seq(b"\x00" * 7 + b"\x09") == 9
    for bad in (b"", b"\x00" * 7, b"\x00" * 9):
        with pytest.raises(WireDecodeError, match="exactly 8 bytes"):
            decode_seq(bad)
    with pytest.raises(WireDecodeError, match="got 4"):
        decode([b"t", SEQ1, payload(), b""])
    with pytest.raises(WireDecodeError, match="reserved for the replay end marker"):
        decode([b"t", END, payload()])


def test_invalid_msgpack_is_a_typed_error() -> None:
    with pytest.raises(WireDecodeError, match="^payload is not valid msgpack"):
        decode_payload(payload()[:-1] + b"\xc1")
    with pytest.raises(WireDecodeError, match="^payload is not valid msgpack"):
        decode_payload(payload() + b"\x00")  # trailing data


# --- events ---------------------------------------------------------------------------------------------


def test_dynamo_14_slot_positional_store() -> None:
    event = one("BlockStored", [1, 2], 9, [5] * 8, 4, 7, "CPU", "ad", [None, None], 1, "full_attention", None,
                "LOCAL", "kvcr", "ignored trailing")  # fmt: skip
    assert event == RawBlockStored(
        (1, 2), 9, (5,) * 8, 4, 7, "CPU", "ad", (None, None), 1, "full_attention", None, "LOCAL", "kvcr"
    )


def test_legacy_positional_tail_reads_numbers_in_order() -> None:
    event = one("BlockStored", [1], None, [5] * 4, 4, None, None, None, None, 2, "sliding_window", 128)
    assert isinstance(event, RawBlockStored)
    assert (event.group_idx, event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (
        2,
        "sliding_window",
        128,
    )
    assert (event.locality, event.ownership) == (None, None)


def test_removed_and_cleared_positional_layouts() -> None:
    assert one("BlockRemoved", [3]) == RawBlockRemoved((3,))
    assert one("BlockRemoved", [3], "DISK", 0, "full_attention", None, "REMOTE", "kvcr", 99) == (
        RawBlockRemoved((3,), "DISK", 0, "full_attention", None, "REMOTE", "kvcr")
    )
    assert one(["AllBlocksCleared"]) == RawAllBlocksCleared()
    assert one("AllBlocksCleared", "kvcr", "extra") == RawAllBlocksCleared(ownership="kvcr")


def test_map_events_ignore_unknown_keys_and_order() -> None:
    event = one(
        {
            "session_id": "req-1",
            "future_field": [1, 2],
            "token_ids": [1, 2, 3, 4],
            "block_size": 4,
            "type": "BlockStored",
            "block_hashes": [7],
            "ownership": "kvcr",
            "locality": "LOCAL",
            "cache_salt": "ns",
        }
    )
    assert event == RawBlockStored(
        (7,), None, (1, 2, 3, 4), 4, ownership="kvcr", locality="LOCAL", session_id="req-1", cache_salt="ns"
    )
    assert one({"type": "AllBlocksCleared", "ownership": "kvcr", "locality": "LOCAL"}) == RawAllBlocksCleared(
        None, "kvcr", "LOCAL"
    )


def test_unknown_ownership_decodes() -> None:
    event = one({"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU", "ownership": "future_owner"})
    assert isinstance(event, RawBlockRemoved) and event.ownership == "future_owner"


def test_tier_blocks_cleared_is_a_known_tag() -> None:
    assert one({"type": "TierBlocksCleared", "medium": "CPU"}) == RawIgnored("TierBlocksCleared")
    assert one("TierBlocksCleared", "CPU") == RawIgnored("TierBlocksCleared")


def test_unknown_tag_fails_the_whole_batch() -> None:
    good = {"type": "BlockRemoved", "block_hashes": [1]}
    with pytest.raises(WireDecodeError, match=r"^events\[1\]: unknown event tag 'BlockTeleported'"):
        decode_payload(payload(good, {"type": "BlockTeleported"}))
    with pytest.raises(WireDecodeError, match=r"^events\[0\]: event tag must be a string, got list"):
        decode_payload(payload([[1], 2]))
    with pytest.raises(WireDecodeError, match=r"^events\[0\].type: required field is missing"):
        decode_payload(payload({"block_hashes": [1]}))
    with pytest.raises(WireDecodeError, match=r"^events\[0\]: expected an array or a map, got int"):
        decode_payload(payload(5))


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({"type": "BlockStored", "block_hashes": 5, "token_ids": [], "block_size": 4},
         "BlockStored.block_hashes: expected a list, got int"),
        ({"type": "BlockStored", "block_hashes": [], "token_ids": [], "block_size": "4"},
         "BlockStored.block_size: expected an integer, got str"),
        ({"type": "BlockStored", "block_hashes": [], "block_size": 4},
         "BlockStored.token_ids: required field is missing"),
        ({"type": "BlockStored", "block_hashes": [], "token_ids": [1, -1], "block_size": 4},
         r"BlockStored.token_ids\[1\]: expected a u32 token id, got -1"),
        ({"type": "BlockStored", "block_hashes": [], "token_ids": [True], "block_size": 4},
         r"BlockStored.token_ids\[0\]: expected a u32 token id, got True"),
        ({"type": "BlockStored", "block_hashes": [], "token_ids": [], "block_size": 4, "medium": 3},
         "BlockStored.medium: expected a string, got int"),
        ({"type": "BlockStored", "block_hashes": [], "token_ids": [], "block_size": 4, "extra_keys": 3},
         "BlockStored.extra_keys: expected a list or nil, got int"),
        ({"type": "BlockStored", "block_hashes": ["x"], "token_ids": [], "block_size": 4},
         r"BlockStored.block_hashes\[0\]: expected an integer hash, got str"),
        ({"type": "BlockStored", "block_hashes": [], "parent_block_hash": 1.5, "token_ids": [], "block_size": 4},
         "BlockStored.parent_block_hash: expected an integer hash, got float"),
        ({"type": "BlockRemoved", "block_hashes": [1], "group_idx": "0"},
         "BlockRemoved.group_idx: expected an integer, got str"),
        ({"type": "BlockRemoved"}, "BlockRemoved.block_hashes: required field is missing"),
        ({"type": "AllBlocksCleared", "ownership": 1}, "AllBlocksCleared.ownership: expected a string, got int"),
        (["BlockStored", [1], None], "BlockStored: positional form needs at least 5 fields"),
        (["BlockRemoved"], "BlockRemoved.block_hashes: required field is missing"),
    ],
)  # fmt: skip
def test_malformed_fields_are_named(event: object, message: str) -> None:
    with pytest.raises(WireDecodeError, match="^" + message):
        decode_payload(payload(event))


def test_sglang_bigram_tokens_flatten_and_mark_eagle() -> None:
    event = one({"type": "BlockStored", "block_hashes": [1], "token_ids": [[1, 2], [2, 3], [3, 4]],
                 "block_size": 2})  # fmt: skip
    assert isinstance(event, RawEagleBlockStored)
    assert (event.token_ids, event.is_eagle) == ((1, 2, 3, 4), True)
    assert pack_tokens(event.token_ids) == b"".join(t.to_bytes(4, "little") for t in (1, 2, 3, 4))


# --- hashes (docs/spec/vllm-wire.md 7.1) --------------------------------------------------------------------------


def test_hash_forms_normalize_to_u64() -> None:
    sha = bytes(range(32))
    event = one({"type": "BlockRemoved", "block_hashes": [0, 2**64 - 1, -1, -(2**63), sha, b"\x01\x02"]})
    assert isinstance(event, RawBlockRemoved)
    assert event.block_hashes == (
        0,
        2**64 - 1,
        2**64 - 1,
        2**63,
        int.from_bytes(sha[-8:], "big"),
        0x0102,
    )
    stored = one({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": -2, "token_ids": [],
                  "block_size": 4})  # fmt: skip
    assert isinstance(stored, RawBlockStored) and stored.parent_block_hash == 2**64 - 2


def test_bytes_hashes_can_be_rejected_like_dynamo() -> None:
    data = payload({"type": "BlockRemoved", "block_hashes": [b"\x00" * 32]})
    with pytest.raises(WireDecodeError, match=r"block_hashes\[0\]: expected an integer hash, got bytes"):
        decode_payload(data, accept_bytes_hashes=False)
    with pytest.raises(WireDecodeError, match="empty bytes hash"):
        decode_payload(payload({"type": "BlockRemoved", "block_hashes": [b""]}))


def test_out_of_range_hashes_are_rejected() -> None:
    # msgpack cannot carry these, so build the unpacked form directly through the positional reader.
    from kvagent.vllm.decode import _hash

    with pytest.raises(WireDecodeError, match="outside the i64/u64 range"):
        _hash(2**64, "h", True)
    with pytest.raises(WireDecodeError, match="outside the i64/u64 range"):
        _hash(-(2**63) - 1, "h", True)


# --- replay frames --------------------------------------------------------------------------------------


def test_replay_reply_forms() -> None:
    data = payload({"type": "BlockRemoved", "block_hashes": [1]})
    old = decode([b"", SEQ1, data], replay=True)
    new = decode([b"", b"kv", SEQ1, data], replay=True)
    assert old is not None and new is not None
    assert (old.topic, old.seq, new.topic, new.seq) == (b"", 1, b"kv", 1)
    assert old.batch == new.batch
    for marker in ([b"", END, b""], [b"", b"", END, b""], [b"", b"kv", END, b""]):
        assert decode(marker, replay=True) is None
    # Not end markers: a seq with an empty payload, and a live-shaped message carrying the marker seq.
    for not_marker in ([b"", b"", SEQ1, b""], [b"kv", END, b""]):
        with pytest.raises(WireDecodeError):
            decode(not_marker, replay=True)


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"", b"kv", SEQ1, b""], "replay reply for seq 1 has an empty payload"),
        ([b"", SEQ1, b""], "replay reply for seq 1 has an empty payload"),
        ([b"", b"", END, b"x"], "replay end marker carries a non-empty payload"),
        ([b"", END, b"x"], "replay end marker carries a non-empty payload"),
        ([b"x"], "malformed replay reply: 1 frames"),
        ([b"x", SEQ1, b"\x90"], "malformed replay reply: 3 frames"),
        ([b"", b"kv", b"\x01", b"\x90"], "exactly 8 bytes"),
    ],
)
def test_malformed_replay_replies(frames: list[bytes], message: str) -> None:
    with pytest.raises(WireDecodeError, match=message):
        decode(frames, replay=True)


# --- fuzzing: only the typed error escapes; normalize accepts whatever decode accepted --------------------

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=20), children, max_size=6),
    max_leaves=40,
)
TAGS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "TierBlocksCleared", "Other"])
map_events = st.fixed_dictionaries(
    {"type": TAGS},
    optional={
        "block_hashes": st.lists(st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=33), max_size=4),
        "parent_block_hash": st.none() | st.integers(0, 2**64 - 1),
        "token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=40)
        | st.lists(st.lists(st.integers(0, 9), min_size=2, max_size=2), max_size=6),
        "block_size": st.integers(-1, 20),
        "medium": st.none() | st.sampled_from(["GPU", "CPU", "CPU_PINNED", "STORAGE", "DISK", "FS", ""]),
        "ownership": st.none() | st.sampled_from(["kvcr", "future_owner"]),
        "locality": st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
        "group_idx": st.none() | st.integers(0, 3),
        "kv_cache_spec_kind": st.none() | st.sampled_from(["full_attention", "sliding_window", "x"]),
        "extra_keys": st.none() | st.lists(st.none() | st.lists(st.text(max_size=70), max_size=3), max_size=4),
        "lora_name": st.none() | st.text(max_size=8),
        "cache_salt": st.none() | st.text(max_size=8),
    },
)
array_events = st.tuples(TAGS, st.lists(msgpack_values, max_size=14)).map(lambda t: [t[0], *t[1]])
envelopes = st.tuples(
    st.floats(allow_nan=False),
    st.lists(map_events | array_events | msgpack_values, max_size=8),
    st.none() | st.integers(0, 4),
).map(list)


def fresh_normalizer() -> AttachmentNormalizer:
    return AttachmentNormalizer(kv_block_size=4, worker=WorkerWithDpRank(17, 3))


@settings(max_examples=300, deadline=None)
@given(msgpack_values | envelopes)
def test_random_msgpack_only_raises_the_typed_error(value: object) -> None:
    try:
        batch = decode_payload(msgpack.packb(value))
    except WireDecodeError:
        return
    fresh_normalizer().normalize(batch)


SEEDS = [frames for (_note, frames) in load_structs().values() if len(frames) == 3] + load_live()[0][:12]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(SEEDS),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
    st.integers(0, 10_000),
)
def test_mutated_vectors_only_raise_the_typed_error(
    frames: list[bytes], flips: list[tuple[int, int]], cut: int
) -> None:
    data = bytearray(frames[2])
    for position, value in flips:
        if data:
            data[position % len(data)] = value
    if cut and data:
        data = data[: cut % (len(data) + 1)]
    try:
        message = decode([frames[0], frames[1], bytes(data)])
    except WireDecodeError:
        return
    fresh_normalizer().normalize(message.batch)
