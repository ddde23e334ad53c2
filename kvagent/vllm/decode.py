"""vLLM's ZMQ KV event wire format: frames, the batch envelope and every event encoding seen in the wild.

Decoding is untyped (one ``msgpack.unpackb`` per payload) followed by tolerant hand-written readers, then
dispatch by shape: positional arrays with the tag first (v0.9's 6-slot ``BlockStored`` up to Dynamo's
14-slot layout) and maps with a ``"type"`` key (vLLM ≥ PR #42892, e.g. 0.32.0). Unknown map keys and
trailing array elements are ignored; an unknown tag, a missing required field or a wrong type is a
:class:`WireDecodeError` naming the field. This is the ingest hot path: no cattrs, no per-block objects.

Hash normalization to u64 (vllm-wire.md §7.1):

- unsigned ints are taken as is; negative ints (old ``builtin`` hashing, LMCache, SGLang) are
  reinterpreted as two's complement (``h & (2**64 - 1)``);
- ``bytes`` hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: 32-byte sha256 or 16-byte xxh3_128) are
  accepted by default and folded to their last 8 bytes read big-endian (``int.from_bytes(b, "big") &
  (2**64 - 1)``), which equals the int form vLLM would have sent. Pass ``accept_bytes_hashes=False`` to
  reject them as Dynamo does. An empty ``bytes`` hash is rejected (it carries no value at all);
- ints outside [-2^63, 2^64) are a :class:`WireDecodeError` (msgpack cannot carry them anyway).

Decisions where the references leave a choice:

- The envelope must be an array (2 or more elements, extras ignored), as Dynamo requires. The map
  envelope of one unreleased vLLM branch is rejected, so kvagent and Dynamo agree on what a batch is.
- ``TierBlocksCleared`` (newest Dynamo) and Dynamo's internal ``Ignored`` are known tags: they decode to
  :class:`RawIgnored` and normalization filters them with reason ``ignored_event``. Any other unknown tag
  fails the whole batch (Dynamo's default).
- An unknown ``ownership`` string decodes; it is a source fault at normalization, never a decode error.
- ``token_ids`` must be u32 ints (msgpack booleans are a type error), or SGLang's ``[u32, u32]`` bigram
  pairs, which are flattened and mark the event ``is_eagle``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, TypeAlias

import attrs
import msgpack

from kvagent.model.errors import WireDecodeError
from kvagent.model.events import MAX_RAW_PAYLOAD_BYTES, U32_MAX, U64_MAX

__all__ = [
    "REPLAY_END_SEQ",
    "RawAllBlocksCleared",
    "RawBatch",
    "RawBlockRemoved",
    "RawBlockStored",
    "RawEvent",
    "RawIgnored",
    "RawMessage",
    "WireDecodeError",
    "decode_frames",
    "decode_payload",
    "decode_replay_reply",
    "decode_seq",
    "is_replay_end_marker",
    "u32_packer",
]

I64_MIN = -(1 << 63)
REPLAY_END_SEQ = b"\xff" * 8


@attrs.frozen(slots=True)
class RawBlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    is_eagle: bool = False
    cache_salt: str | None = None
    # The tokens as u32 little-endian bytes, packed once at decode (C speed) for LocalBlockHash slices.
    token_bytes: bytes = attrs.field(default=b"", eq=False, repr=False)


@attrs.frozen(slots=True)
class RawBlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


@attrs.frozen(slots=True)
class RawAllBlocksCleared:
    medium: str | None = None
    ownership: str | None = None
    locality: str | None = None


@attrs.frozen(slots=True)
class RawIgnored:
    """A known tag the agent does not act on (``TierBlocksCleared``, Dynamo's internal ``Ignored``)."""

    tag: str


RawEvent: TypeAlias = RawBlockStored | RawBlockRemoved | RawAllBlocksCleared | RawIgnored


@attrs.frozen(slots=True)
class RawBatch:
    ts: float
    events: tuple[RawEvent, ...]
    data_parallel_rank: int | None


@attrs.frozen(slots=True)
class RawMessage:
    topic: bytes
    seq: int
    batch: RawBatch


# --- field readers ---------------------------------------------------------------------------------


def _type_name(value: object) -> str:
    return "nil" if value is None else type(value).__name__


def _hash(value: object, field: str, accept_bytes: bool) -> int:
    if type(value) is int:
        if 0 <= value <= U64_MAX:
            return value
        if I64_MIN <= value < 0:
            return value & U64_MAX
        raise WireDecodeError(f"{field}: hash {value} is outside the i64/u64 range")
    if isinstance(value, bytes) and accept_bytes:
        if not value:
            raise WireDecodeError(f"{field}: empty bytes hash")
        return int.from_bytes(value, "big") & U64_MAX
    raise WireDecodeError(f"{field}: expected an integer hash, got {_type_name(value)}")


def _hashes(value: object, field: str, accept_bytes: bool) -> tuple[int, ...]:
    if type(value) is not list:
        raise WireDecodeError(f"{field}: expected a list, got {_type_name(value)}")
    # Fast path: the common case is a list of in-range unsigned ints.
    if all(type(h) is int and 0 <= h <= U64_MAX for h in value):
        return tuple(value)
    return tuple(_hash(h, f"{field}[{i}]", accept_bytes) for i, h in enumerate(value))


def _optional_hash(value: object, field: str, accept_bytes: bool) -> int | None:
    return None if value is None else _hash(value, field, accept_bytes)


def _int(value: object, field: str) -> int:
    if type(value) is not int:
        raise WireDecodeError(f"{field}: expected an integer, got {_type_name(value)}")
    return value


def _optional_int(value: object, field: str) -> int | None:
    return None if value is None else _int(value, field)


def _optional_str(value: object, field: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise WireDecodeError(f"{field}: expected a string, got {_type_name(value)}")


def _tokens(value: object, field: str) -> tuple[tuple[int, ...], bool, bytes]:
    """Token ids, whether they came in SGLang's EAGLE bigram form ([u32, u32] pairs), and their u32-LE bytes."""
    if type(value) is not list:
        raise WireDecodeError(f"{field}: expected a list, got {_type_name(value)}")
    try:
        # struct validates every token (an int in u32 range) in C; bools are the only ints it lets through.
        packed = struct.pack(f"<{len(value)}I", *value)
    except struct.error:
        packed = b""
    if packed and not any(type(t) is bool for t in value):
        return tuple(value), False, packed
    if value and all(type(p) is list and len(p) == 2 for p in value):
        flat = [p[0] for p in value] + [value[-1][1]]
        if all(type(t) is int and 0 <= t <= U32_MAX for t in flat):
            return tuple(flat), True, struct.pack(f"<{len(flat)}I", *flat)
    if not value:
        return (), False, b""
    for i, token in enumerate(value):
        if type(token) is not int or not 0 <= token <= U32_MAX:
            raise WireDecodeError(f"{field}[{i}]: expected a u32 token id, got {token!r}")
    raise WireDecodeError(f"{field}: malformed token list")  # pragma: no cover - unreachable


def _extra_keys(value: object, field: str) -> tuple[object, ...] | None:
    if value is None:
        return None
    if type(value) is not list:
        raise WireDecodeError(f"{field}: expected a list or nil, got {_type_name(value)}")
    return tuple(value)


def _required(event: dict[Any, Any], key: str, tag: str) -> object:
    try:
        return event[key]
    except KeyError:
        raise WireDecodeError(f"{tag}.{key}: required field is missing") from None


# --- events ----------------------------------------------------------------------------------------


def u32_packer(count: int) -> struct.Struct:
    """A cached ``struct.Struct`` for ``count`` u32 little-endian values (token ids as LocalBlockHash reads them)."""
    packer = _U32_PACKERS.get(count)
    if packer is None:
        packer = struct.Struct(f"<{count}I")
        if len(_U32_PACKERS) < 4096:  # token counts are few distinct values (blocks x block size)
            _U32_PACKERS[count] = packer
    return packer


_U32_PACKERS: dict[int, struct.Struct] = {}
_NONE = type(None)
_OPTIONAL_INT = frozenset({int, _NONE})
_OPTIONAL_STR = frozenset({str, _NONE})
_OPTIONAL_LIST = frozenset({list, _NONE})


def _stored_from_map(event: dict[Any, Any], accept_bytes: bool) -> RawBlockStored:
    """The hot path (every GPU store of vLLM >= PR #42892): all checks inline, no helper calls.

    Anything unusual (bytes or signed hashes, bigram tokens, a bad type) falls through to the checked
    reader, which produces the same value or the error naming the field.
    """
    get = event.get
    hashes = get("block_hashes")
    parent = get("parent_block_hash")
    tokens = get("token_ids")
    block_size = get("block_size")
    lora_id = get("lora_id")
    medium = get("medium")
    lora_name = get("lora_name")
    extra_keys = get("extra_keys")
    group_idx = get("group_idx")
    kind = get("kv_cache_spec_kind")
    sliding = get("kv_cache_spec_sliding_window")
    locality = get("locality")
    ownership = get("ownership")
    session_id = get("session_id")
    cache_salt = get("cache_salt")
    optional_str = _OPTIONAL_STR
    optional_int = _OPTIONAL_INT
    if (
        type(hashes) is list
        and type(tokens) is list
        and type(block_size) is int
        and (parent is None or (type(parent) is int and 0 <= parent <= U64_MAX))
        and type(extra_keys) in _OPTIONAL_LIST
        and type(medium) in optional_str
        and type(lora_name) in optional_str
        and type(kind) in optional_str
        and type(locality) in optional_str
        and type(ownership) in optional_str
        and type(session_id) in optional_str
        and type(cache_salt) in optional_str
        and type(lora_id) in optional_int
        and type(group_idx) in optional_int
        and type(sliding) in optional_int
        and all(type(h) is int and 0 <= h <= U64_MAX for h in hashes)
    ):
        try:
            # struct checks every token is an int in u32 range, in C; bools are the only other ints.
            token_bytes = u32_packer(len(tokens)).pack(*tokens)
        except struct.error:
            pass
        else:
            if bool not in set(map(type, tokens)):
                return RawBlockStored(
                    tuple(hashes),
                    parent,
                    tuple(tokens),
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    None if extra_keys is None else tuple(extra_keys),
                    group_idx,
                    kind,
                    sliding,
                    locality,
                    ownership,
                    session_id,
                    False,
                    cache_salt,
                    token_bytes,
                )
    return _stored_from_map_checked(event, accept_bytes)


def _stored_from_map_checked(event: dict[Any, Any], accept_bytes: bool) -> RawBlockStored:
    tag = "BlockStored"
    tokens, eagle, token_bytes = _tokens(_required(event, "token_ids", tag), f"{tag}.token_ids")
    get = event.get
    return RawBlockStored(
        _hashes(_required(event, "block_hashes", tag), f"{tag}.block_hashes", accept_bytes),
        _optional_hash(get("parent_block_hash"), f"{tag}.parent_block_hash", accept_bytes),
        tokens,
        _int(_required(event, "block_size", tag), f"{tag}.block_size"),
        _optional_int(get("lora_id"), f"{tag}.lora_id"),
        _optional_str(get("medium"), f"{tag}.medium"),
        _optional_str(get("lora_name"), f"{tag}.lora_name"),
        _extra_keys(get("extra_keys"), f"{tag}.extra_keys"),
        _optional_int(get("group_idx"), f"{tag}.group_idx"),
        _optional_str(get("kv_cache_spec_kind"), f"{tag}.kv_cache_spec_kind"),
        _optional_int(get("kv_cache_spec_sliding_window"), f"{tag}.kv_cache_spec_sliding_window"),
        _optional_str(get("locality"), f"{tag}.locality"),
        _optional_str(get("ownership"), f"{tag}.ownership"),
        _optional_str(get("session_id"), f"{tag}.session_id"),
        eagle,
        _optional_str(get("cache_salt"), f"{tag}.cache_salt"),
        token_bytes,
    )


def _fits_dynamo_trailing(trailing: list[Any]) -> bool:
    pattern = (int, str, int, str, str)
    return len(trailing) >= 4 and all(
        value is None or type(value) is kind for value, kind in zip(trailing, pattern, strict=False)
    )


def _stored_from_array(event: list[Any], accept_bytes: bool) -> RawBlockStored:
    tag = "BlockStored"
    if len(event) < 5:
        raise WireDecodeError(f"{tag}: positional form needs at least 5 fields, got {len(event) - 1}")

    def at(i: int) -> object:
        return event[i] if i < len(event) else None

    tokens, eagle, token_bytes = _tokens(event[3], f"{tag}.token_ids")
    group_idx = kind = sliding = locality = ownership = None
    trailing = event[9:]
    if _fits_dynamo_trailing(trailing):
        group_idx = _optional_int(at(9), f"{tag}.group_idx")
        kind = _optional_str(at(10), f"{tag}.kv_cache_spec_kind")
        sliding = _optional_int(at(11), f"{tag}.kv_cache_spec_sliding_window")
        locality = _optional_str(at(12), f"{tag}.locality")
        ownership = _optional_str(at(13), f"{tag}.ownership")
    elif trailing:
        # Legacy (pre-locality) tail: numbers in order are group_idx then sliding window.
        numbers = [v for v in trailing if type(v) is int]
        strings = [v for v in trailing if type(v) is str]
        group_idx = numbers[0] if numbers else None
        sliding = numbers[1] if len(numbers) > 1 else None
        kind = strings[0] if strings else None
    return RawBlockStored(
        _hashes(event[1], f"{tag}.block_hashes", accept_bytes),
        _optional_hash(event[2], f"{tag}.parent_block_hash", accept_bytes),
        tokens,
        _int(event[4], f"{tag}.block_size"),
        _optional_int(at(5), f"{tag}.lora_id"),
        _optional_str(at(6), f"{tag}.medium"),
        _optional_str(at(7), f"{tag}.lora_name"),
        _extra_keys(at(8), f"{tag}.extra_keys"),
        group_idx,
        kind,
        sliding,
        locality,
        ownership,
        None,
        eagle,
        None,
        token_bytes,
    )


def _removed_from_map(event: dict[Any, Any], accept_bytes: bool) -> RawBlockRemoved:
    tag = "BlockRemoved"
    get = event.get
    return RawBlockRemoved(
        _hashes(_required(event, "block_hashes", tag), f"{tag}.block_hashes", accept_bytes),
        _optional_str(get("medium"), f"{tag}.medium"),
        _optional_int(get("group_idx"), f"{tag}.group_idx"),
        _optional_str(get("kv_cache_spec_kind"), f"{tag}.kv_cache_spec_kind"),
        _optional_int(get("kv_cache_spec_sliding_window"), f"{tag}.kv_cache_spec_sliding_window"),
        _optional_str(get("locality"), f"{tag}.locality"),
        _optional_str(get("ownership"), f"{tag}.ownership"),
    )


def _removed_from_array(event: list[Any], accept_bytes: bool) -> RawBlockRemoved:
    tag = "BlockRemoved"
    if len(event) < 2:
        raise WireDecodeError(f"{tag}.block_hashes: required field is missing")

    def at(i: int) -> object:
        return event[i] if i < len(event) else None

    return RawBlockRemoved(
        _hashes(event[1], f"{tag}.block_hashes", accept_bytes),
        _optional_str(at(2), f"{tag}.medium"),
        _optional_int(at(3), f"{tag}.group_idx"),
        _optional_str(at(4), f"{tag}.kv_cache_spec_kind"),
        _optional_int(at(5), f"{tag}.kv_cache_spec_sliding_window"),
        _optional_str(at(6), f"{tag}.locality"),
        _optional_str(at(7), f"{tag}.ownership"),
    )


_IGNORED_TAGS = frozenset({"TierBlocksCleared", "Ignored"})


def _decode_event(event: object, index: int, accept_bytes: bool) -> RawEvent:
    if type(event) is dict:
        tag = event.get("type")
        if tag == "BlockStored":
            return _stored_from_map(event, accept_bytes)
        if tag == "BlockRemoved":
            return _removed_from_map(event, accept_bytes)
        if tag == "AllBlocksCleared":
            return RawAllBlocksCleared(
                _optional_str(event.get("medium"), "AllBlocksCleared.medium"),
                _optional_str(event.get("ownership"), "AllBlocksCleared.ownership"),
                _optional_str(event.get("locality"), "AllBlocksCleared.locality"),
            )
    elif type(event) is list and event:
        tag = event[0]
        if tag == "BlockStored":
            return _stored_from_array(event, accept_bytes)
        if tag == "BlockRemoved":
            return _removed_from_array(event, accept_bytes)
        if tag == "AllBlocksCleared":
            ownership = event[1] if len(event) > 1 else None
            return RawAllBlocksCleared(None, _optional_str(ownership, "AllBlocksCleared.ownership"))
    elif type(event) is list:
        raise WireDecodeError(f"events[{index}]: empty event array has no tag")
    else:
        raise WireDecodeError(f"events[{index}]: expected an array or a map, got {_type_name(event)}")
    if not isinstance(tag, str):
        if tag is None and type(event) is dict:
            raise WireDecodeError(f"events[{index}].type: required field is missing")
        raise WireDecodeError(f"events[{index}]: event tag must be a string, got {_type_name(tag)}")
    if tag in _IGNORED_TAGS:
        return RawIgnored(tag)
    if tag is None:
        raise WireDecodeError(f"events[{index}].type: required field is missing")
    raise WireDecodeError(f"events[{index}]: unknown event tag {tag!r}")


# --- envelope and frames ---------------------------------------------------------------------------


def decode_payload(
    payload: bytes, *, max_payload_bytes: int = MAX_RAW_PAYLOAD_BYTES, accept_bytes_hashes: bool = True
) -> RawBatch:
    if len(payload) > max_payload_bytes:
        raise WireDecodeError(f"ZMQ payload exceeds {max_payload_bytes} bytes")
    try:
        envelope = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types (ValueError, ExtraData, ...)
        raise WireDecodeError(f"payload is not valid msgpack: {exc}") from None
    if type(envelope) is list:
        if len(envelope) < 2:
            raise WireDecodeError(f"envelope: expected [ts, events, rank], got {len(envelope)} elements")
        ts, events = envelope[0], envelope[1]
        rank = envelope[2] if len(envelope) > 2 else None
    else:
        # Dynamo decodes the envelope only as an array; a map envelope (one unreleased vLLM branch) is
        # rejected the same way so both consumers agree on what a batch is.
        raise WireDecodeError(f"envelope: expected an array [ts, events, rank], got {_type_name(envelope)}")
    if type(ts) is int:
        ts = float(ts)
    if type(ts) is not float:
        raise WireDecodeError(f"envelope.ts: expected a float, got {_type_name(ts)}")
    if type(events) is not list:
        raise WireDecodeError(f"envelope.events: expected a list, got {_type_name(events)}")
    if rank is not None and (type(rank) is not int or not 0 <= rank <= U32_MAX):
        raise WireDecodeError(f"envelope.data_parallel_rank: expected a u32 or nil, got {rank!r}")
    decoded = tuple(_decode_event(event, i, accept_bytes_hashes) for i, event in enumerate(events))
    return RawBatch(ts, decoded, rank)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireDecodeError(f"sequence frame must be exactly 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_frames(
    frames: Sequence[bytes],
    *,
    max_payload_bytes: int = MAX_RAW_PAYLOAD_BYTES,
    accept_bytes_hashes: bool = True,
) -> RawMessage:
    if len(frames) != 3:
        raise WireDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq_frame, payload = frames
    seq = decode_seq(seq_frame)
    if seq_frame == REPLAY_END_SEQ:
        raise WireDecodeError("sequence ff*8 is reserved for the replay end marker")
    batch = decode_payload(
        payload, max_payload_bytes=max_payload_bytes, accept_bytes_hashes=accept_bytes_hashes
    )
    return RawMessage(bytes(topic), seq, batch)


def is_replay_end_marker(frames: Sequence[bytes]) -> bool:
    return (len(frames) == 4 and frames[0] == b"" and frames[2] == REPLAY_END_SEQ and frames[3] == b"") or (
        len(frames) == 3 and frames[0] == b"" and frames[1] == REPLAY_END_SEQ and frames[2] == b""
    )


def decode_replay_reply(
    frames: Sequence[bytes], *, max_payload_bytes: int = MAX_RAW_PAYLOAD_BYTES
) -> RawMessage | None:
    """A DEALER's view of a replay reply: ``[b"", seq, payload]`` (≤ v0.25) or ``[b"", topic, seq, payload]``.

    Returns None for the end marker.
    """
    if len(frames) == 3 and frames[0] == b"":
        topic, seq_frame, payload = b"", frames[1], frames[2]
    elif len(frames) == 4 and frames[0] == b"":
        topic, seq_frame, payload = frames[1], frames[2], frames[3]
    else:
        raise WireDecodeError(f"malformed replay reply: {len(frames)} frames")
    if seq_frame == REPLAY_END_SEQ:
        if payload:
            raise WireDecodeError("replay end marker carries a non-empty payload")
        return None
    seq = decode_seq(seq_frame)
    if not payload:
        raise WireDecodeError(f"replay reply for seq {seq} has an empty payload")
    return RawMessage(bytes(topic), seq, decode_payload(payload, max_payload_bytes=max_payload_bytes))
