"""vLLM's ZMQ KV event wire format: frames, the batch envelope and every event encoding seen in the wild.

:func:`decode` is the one entry point, for live frames and replay replies alike. The wire schema is declared
once, as the ``Raw*`` msgspec structs below; two decoders read it:

- the typed decoder (private): msgspec decodes the payload straight into the ``Raw*`` values, checking every
  field in C (u32 token ids, unsigned integer hashes, optional strings) without a dict per event. It takes
  the tagged maps of vLLM >= PR #42892 (0.26.0, 0.32.0, ...) and the tagged positional arrays before it; the
  positional structs are derived from the same declaration. Anything it does not accept goes to
- the checked decoder: one untyped ``msgpack.unpackb`` and tolerant readers that name the failing field.
  It defines behaviour: it accepts every form the typed decoder accepts, and more (``bytes`` and signed
  hashes, SGLang's bigram tokens, a map without ``parent_block_hash``, mixed forms in one batch, Dynamo's
  older positional tails), or raises :class:`WireDecodeError` naming the field.

One difference is deliberate: msgspec skips map keys it does not know, with their values, without decoding
them, so invalid UTF-8 inside an unknown key does not fail the batch (``msgpack.unpackb`` decodes every
string and refuses it). ``tests/unit/test_fastpath.py`` checks that both decoders otherwise agree.

Unknown map keys and trailing array elements are ignored; an unknown tag, a missing required field or a
wrong type is a :class:`WireDecodeError` naming the field.

Hash normalization to u64 (docs/spec/vllm-wire.md §7.1):

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
  pairs, which are flattened into a :class:`RawEagleBlockStored`.
"""

from __future__ import annotations

import functools
import operator
import struct
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeAlias, overload

import msgpack
import msgspec

from kvagent.model.errors import WireDecodeError
from kvagent.model.events import MAX_RAW_PAYLOAD_BYTES, U32_MAX, U64_MAX
from kvagent.model.hashing import pack_tokens
from kvagent.wire.vllm_events import END_SEQ

__all__ = [
    "RawAllBlocksCleared",
    "RawBatch",
    "RawBlockRemoved",
    "RawBlockStored",
    "RawEagleBlockStored",
    "RawEvent",
    "RawIgnored",
    "RawMessage",
    "WireDecodeError",
    "decode",
    "decode_payload",
    "decode_seq",
]

I64_MIN = -(1 << 63)

# The typed decoder accepts only the canonical forms; anything else is read by the checked decoder.
_U64 = Annotated[int, msgspec.Meta(ge=0)]  # negative hashes are folded by the checked decoder
_U32 = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]

# --- the schema ------------------------------------------------------------------------------------------


# A map without parent_block_hash is legal but never sent (docs/spec/vllm-wire.md 1: the key is present even when nil);
# the typed decoder refuses it and the checked decoder reads it as nil.
class RawBlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", frozen=True, gc=False):
    """BlockStored, its fields in vLLM's declaration order (the positional form's slots 1..13 come first)."""

    block_hashes: tuple[_U64, ...]
    parent_block_hash: _U64 | None
    token_ids: tuple[_U32, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    # Map form only (the positional form ends at ownership).
    session_id: str | None = None
    cache_salt: str | None = None

    # Not a wire field (a map key of that name must not set it): see RawEagleBlockStored.
    is_eagle: ClassVar[bool] = False


class RawEagleBlockStored(RawBlockStored, frozen=True, gc=False):
    """A store whose tokens came as SGLang's EAGLE bigrams ([u32, u32] pairs), flattened: one extra token."""

    is_eagle: ClassVar[bool] = True


class RawBlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", frozen=True, gc=False):
    block_hashes: tuple[_U64, ...]
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class RawAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", frozen=True, gc=False):
    medium: str | None = None
    ownership: str | None = None
    locality: str | None = None


class RawIgnored(msgspec.Struct, frozen=True, gc=False):
    """A known tag the agent does not act on (``TierBlocksCleared``, Dynamo's internal ``Ignored``)."""

    tag: str


RawEvent: TypeAlias = RawBlockStored | RawBlockRemoved | RawAllBlocksCleared | RawIgnored


class RawBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The ``[ts, events, data_parallel_rank]`` envelope; extra trailing elements are ignored (as Dynamo)."""

    ts: float
    events: tuple[RawEvent, ...]
    data_parallel_rank: _U32 | None = None


class RawMessage(msgspec.Struct, frozen=True, gc=False):
    topic: bytes
    seq: int
    batch: RawBatch


_IGNORED_TAGS = ("TierBlocksCleared", "Ignored")
_POSITIONAL_STORED_SLOTS = 13  # block_hashes .. ownership


# --- the typed decoder (derived from the schema) ---------------------------------------------------------


def _names(raw: type[msgspec.Struct]) -> tuple[str, ...]:
    return tuple(field.name for field in msgspec.structs.fields(raw))


def _derived(raw: type[msgspec.Struct], names: Sequence[str], **config: Any) -> Any:
    """A struct with ``raw``'s fields ``names`` (same types, defaults and order) under another wire config."""
    fields = {field.name: field for field in msgspec.structs.fields(raw)}
    spec = [
        (name, fields[name].type) if fields[name].required else (name, fields[name].type, fields[name].default)
        for name in names
    ]
    return msgspec.defstruct(f"_Wire{raw.__name__}", spec, frozen=True, gc=False, **config)


def _envelope(events: Sequence[Any]) -> Any:
    """RawBatch's envelope, its events read as a list of one of ``events`` (converted to Raw values after)."""
    fields = {field.name: field for field in msgspec.structs.fields(RawBatch)}
    rank = fields["data_parallel_rank"]
    event: Any = functools.reduce(operator.or_, events)
    spec: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        ("ts", fields["ts"].type),
        ("events", list[event]),
        ("data_parallel_rank", rank.type, rank.default),
    ]
    return msgspec.defstruct("_WireBatch", spec, frozen=True, gc=False, array_like=True)


# Tags only, so every ignored event decodes to a struct that names its tag.
_MAP_IGNORED = {_derived(RawIgnored, (), tag=tag, tag_field="type"): RawIgnored(tag) for tag in _IGNORED_TAGS}
_POSITIONAL_IGNORED = {_derived(RawIgnored, (), tag=tag, array_like=True): RawIgnored(tag) for tag in _IGNORED_TAGS}
# The positional form: the tag first, then the fields in declaration order (Dynamo's 14-slot layout at most).
_POSITIONAL: dict[Any, type[RawEvent]] = {
    _derived(raw, names, tag=tag, array_like=True): raw
    for raw, tag, names in (
        (RawBlockStored, "BlockStored", _names(RawBlockStored)[:_POSITIONAL_STORED_SLOTS]),
        (RawBlockRemoved, "BlockRemoved", _names(RawBlockRemoved)),
        (RawAllBlocksCleared, "AllBlocksCleared", ("ownership",)),
    )
}
_MAP_DECODER = msgspec.msgpack.Decoder(
    _envelope([RawBlockStored, RawBlockRemoved, RawAllBlocksCleared, *_MAP_IGNORED])
)
_POSITIONAL_DECODER = msgspec.msgpack.Decoder(_envelope([*_POSITIONAL, *_POSITIONAL_IGNORED]))
_MSGSPEC_ERRORS = (msgspec.ValidationError, msgspec.DecodeError)


def _from_positional(event: msgspec.Struct) -> RawEvent:
    ignored = _POSITIONAL_IGNORED.get(type(event))
    if ignored is not None:
        return ignored
    return _POSITIONAL[type(event)](**msgspec.structs.asdict(event))


def _positional_layout_is_ambiguous(events: Sequence[RawEvent]) -> bool:
    """Whether a store's trailing fields could be an older layout that the checked decoder reads differently.

    With fewer than four trailing fields the checked decoder takes the integers in order as group_idx then
    sliding window, so ``[nil, kind, window]`` would give group_idx = window there.
    """
    return any(
        type(event) is RawBlockStored and event.group_idx is None and event.kv_cache_spec_sliding_window is not None
        for event in events
    )


def _decode_typed(payload: bytes) -> RawBatch | None:
    """The batch if all its events are well typed in one form, maps or arrays; else None (the checked path)."""
    try:
        ts, events, rank = msgspec.structs.astuple(_MAP_DECODER.decode(payload))
    except _MSGSPEC_ERRORS:
        try:
            ts, wire_events, rank = msgspec.structs.astuple(_POSITIONAL_DECODER.decode(payload))
        except _MSGSPEC_ERRORS:
            return None
        events = [_from_positional(event) for event in wire_events]
        if _positional_layout_is_ambiguous(events):
            return None
    else:
        if not _MAP_IGNORED.keys().isdisjoint(map(type, events)):
            events = [_MAP_IGNORED.get(type(event), event) for event in events]
    if type(ts) is not float:  # msgspec reads a msgpack bool as a float; the checked decoder refuses it
        return None
    return RawBatch(ts, tuple(events), rank)


# --- the checked decoder: field readers --------------------------------------------------------------------


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


def _int(value: object, field: str, _accept_bytes: bool = True) -> int:
    if type(value) is not int:
        raise WireDecodeError(f"{field}: expected an integer, got {_type_name(value)}")
    return value


def _optional_int(value: object, field: str, _accept_bytes: bool = True) -> int | None:
    return None if value is None else _int(value, field)


def _optional_str(value: object, field: str, _accept_bytes: bool = True) -> str | None:
    if value is None or type(value) is str:
        return value
    raise WireDecodeError(f"{field}: expected a string, got {_type_name(value)}")


def _extra_keys(value: object, field: str, _accept_bytes: bool = True) -> tuple[object, ...] | None:
    if value is None:
        return None
    if type(value) is not list:
        raise WireDecodeError(f"{field}: expected a list or nil, got {_type_name(value)}")
    return tuple(value)


def _tokens(value: object, field: str) -> tuple[tuple[int, ...], bool]:
    """Token ids, and whether they came in SGLang's EAGLE bigram form ([u32, u32] pairs)."""
    if type(value) is not list:
        raise WireDecodeError(f"{field}: expected a list, got {_type_name(value)}")
    if not any(type(t) is bool for t in value):
        try:
            pack_tokens(value)  # validates every token (an int in u32 range) in C
        except struct.error:
            pass
        else:
            return tuple(value), False
    if value and all(type(p) is list and len(p) == 2 for p in value):
        flat = [p[0] for p in value] + [value[-1][1]]
        if all(type(t) is int and 0 <= t <= U32_MAX for t in flat):
            return tuple(flat), True
    for i, token in enumerate(value):
        if type(token) is not int or not 0 <= token <= U32_MAX:
            raise WireDecodeError(f"{field}[{i}]: expected a u32 token id, got {token!r}")
    raise WireDecodeError(f"{field}: malformed token list")  # pragma: no cover - unreachable


_Reader: TypeAlias = Callable[[object, str, bool], object]
# One reader per schema field name (token_ids has its own, it also tells the bigram form).
_READERS: dict[str, _Reader] = {
    "block_hashes": _hashes,
    "parent_block_hash": _optional_hash,
    "block_size": _int,
    "lora_id": _optional_int,
    "medium": _optional_str,
    "lora_name": _optional_str,
    "extra_keys": _extra_keys,
    "group_idx": _optional_int,
    "kv_cache_spec_kind": _optional_str,
    "kv_cache_spec_sliding_window": _optional_int,
    "locality": _optional_str,
    "ownership": _optional_str,
    "session_id": _optional_str,
    "cache_salt": _optional_str,
}
_REQUIRED_IN_MAPS = frozenset({"block_hashes", "token_ids", "block_size"})


_MISSING = object()  # a required map key that is absent


def _read(tag: str, names: Sequence[str], values: Sequence[object], accept_bytes: bool) -> dict[str, object]:
    """The fields ``names`` from their wire ``values``, read in order (the first bad one is the error)."""
    fields: dict[str, object] = {}
    for name, value in zip(names, values, strict=True):
        if value is _MISSING:
            raise WireDecodeError(f"{tag}.{name}: required field is missing")
        fields[name] = _READERS[name](value, f"{tag}.{name}", accept_bytes)
    return fields


def _map_values(event: dict[Any, Any], names: Sequence[str]) -> list[object]:
    return [event.get(name, _MISSING if name in _REQUIRED_IN_MAPS else None) for name in names]


def _stored(fields: dict[str, object], tokens: tuple[int, ...], eagle: bool) -> RawBlockStored:
    return (RawEagleBlockStored if eagle else RawBlockStored)(token_ids=tokens, **fields)  # type: ignore[arg-type]


# --- the checked decoder: events ---------------------------------------------------------------------------

_STORED_NAMES = tuple(name for name in _names(RawBlockStored) if name != "token_ids")
_REMOVED_NAMES = _names(RawBlockRemoved)
_CLEARED_NAMES = _names(RawAllBlocksCleared)


def _stored_from_map(event: dict[Any, Any], accept_bytes: bool) -> RawBlockStored:
    tag = "BlockStored"
    if "token_ids" not in event:
        raise WireDecodeError(f"{tag}.token_ids: required field is missing")
    tokens, eagle = _tokens(event["token_ids"], f"{tag}.token_ids")
    return _stored(_read(tag, _STORED_NAMES, _map_values(event, _STORED_NAMES), accept_bytes), tokens, eagle)


def _fits_dynamo_trailing(trailing: list[Any]) -> bool:
    pattern = (int, str, int, str, str)
    return len(trailing) >= 4 and all(
        value is None or type(value) is kind for value, kind in zip(trailing, pattern, strict=False)
    )


def _legacy_trailing(trailing: list[Any]) -> dict[str, object]:
    """The pre-locality tail: numbers in order are group_idx then sliding window, the first string the kind."""
    numbers = [v for v in trailing if type(v) is int]
    strings = [v for v in trailing if type(v) is str]
    return {
        "group_idx": numbers[0] if numbers else None,
        "kv_cache_spec_sliding_window": numbers[1] if len(numbers) > 1 else None,
        "kv_cache_spec_kind": strings[0] if strings else None,
    }


def _slots(event: list[Any], count: int) -> list[object]:
    """Slots 1..count of a positional event (the tag is slot 0), nil where the array is shorter."""
    values: list[object] = event[1 : count + 1]
    return values + [None] * (count - len(values))


def _stored_from_array(event: list[Any], accept_bytes: bool) -> RawBlockStored:
    tag = "BlockStored"
    if len(event) < 5:
        raise WireDecodeError(f"{tag}: positional form needs at least 5 fields, got {len(event) - 1}")
    tokens, eagle = _tokens(event[3], f"{tag}.token_ids")
    # Slots 1..8 never moved; the trailing ones (9..) are Dynamo's layout or an older one.
    head = ("block_hashes", "parent_block_hash", "block_size", "lora_id", "medium", "lora_name", "extra_keys")
    fields = _read(tag, head, [event[1], event[2], *_slots(event, 8)[3:]], accept_bytes)
    trailing = event[9:]
    if _fits_dynamo_trailing(trailing):
        tail = _STORED_NAMES[len(head) : _POSITIONAL_STORED_SLOTS - 1]
        fields.update(_read(tag, tail, _slots(event, _POSITIONAL_STORED_SLOTS)[8:], accept_bytes))
    elif trailing:
        fields.update(_legacy_trailing(trailing))
    return _stored(fields, tokens, eagle)


def _removed(event: dict[Any, Any] | list[Any], accept_bytes: bool) -> RawBlockRemoved:
    tag = "BlockRemoved"
    if type(event) is dict:
        values = _map_values(event, _REMOVED_NAMES)
    elif len(event) < 2:
        raise WireDecodeError(f"{tag}.block_hashes: required field is missing")
    else:
        values = _slots(event, len(_REMOVED_NAMES))  # type: ignore[arg-type]
    return RawBlockRemoved(**_read(tag, _REMOVED_NAMES, values, accept_bytes))  # type: ignore[arg-type]


def _cleared(event: dict[Any, Any] | list[Any]) -> RawAllBlocksCleared:
    tag = "AllBlocksCleared"
    if type(event) is dict:
        return RawAllBlocksCleared(**_read(tag, _CLEARED_NAMES, _map_values(event, _CLEARED_NAMES), True))  # type: ignore[arg-type]
    return RawAllBlocksCleared(**_read(tag, ("ownership",), _slots(event, 1), True))  # type: ignore[arg-type]


def _decode_event(event: object, index: int, accept_bytes: bool) -> RawEvent:
    if type(event) is dict:
        tag = event.get("type")
        if tag == "BlockStored":
            return _stored_from_map(event, accept_bytes)
    elif type(event) is list and event:
        tag = event[0]
        if tag == "BlockStored":
            return _stored_from_array(event, accept_bytes)
    elif type(event) is list:
        raise WireDecodeError(f"events[{index}]: empty event array has no tag")
    else:
        raise WireDecodeError(f"events[{index}]: expected an array or a map, got {_type_name(event)}")
    if tag == "BlockRemoved":
        return _removed(event, accept_bytes)
    if tag == "AllBlocksCleared":
        return _cleared(event)
    if not isinstance(tag, str):
        if tag is None and type(event) is dict:
            raise WireDecodeError(f"events[{index}].type: required field is missing")
        raise WireDecodeError(f"events[{index}]: event tag must be a string, got {_type_name(tag)}")
    if tag in _IGNORED_TAGS:
        return RawIgnored(tag)
    raise WireDecodeError(f"events[{index}]: unknown event tag {tag!r}")


def _decode_checked(payload: bytes, accept_bytes_hashes: bool) -> RawBatch:
    try:
        envelope = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types (ValueError, ExtraData, ...)
        raise WireDecodeError(f"payload is not valid msgpack: {exc}") from None
    if type(envelope) is not list:
        # Dynamo decodes the envelope only as an array; a map envelope (one unreleased vLLM branch) is
        # rejected the same way so both consumers agree on what a batch is.
        raise WireDecodeError(f"envelope: expected an array [ts, events, rank], got {_type_name(envelope)}")
    if len(envelope) < 2:
        raise WireDecodeError(f"envelope: expected [ts, events, rank], got {len(envelope)} elements")
    ts, events = envelope[0], envelope[1]
    rank = envelope[2] if len(envelope) > 2 else None
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


# --- entry points ------------------------------------------------------------------------------------------


def decode_payload(
    payload: bytes, *, max_payload_bytes: int = MAX_RAW_PAYLOAD_BYTES, accept_bytes_hashes: bool = True
) -> RawBatch:
    """One batch payload: the typed decoder when it accepts the payload, else the checked decoder."""
    if len(payload) > max_payload_bytes:
        raise WireDecodeError(f"ZMQ payload exceeds {max_payload_bytes} bytes")
    batch = _decode_typed(payload)
    if batch is None:
        batch = _decode_checked(payload, accept_bytes_hashes)
    return batch


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireDecodeError(f"sequence frame must be exactly 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def split_live_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """A live message's ``(topic, seq, payload)``, the payload not decoded; seq ff*8 is the end marker's."""
    if len(frames) != 3:
        raise WireDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq_frame, payload = frames
    seq = decode_seq(seq_frame)
    if seq_frame == END_SEQ:
        raise WireDecodeError("sequence ff*8 is reserved for the replay end marker")
    return topic, seq, payload


def split_replay_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes] | None:
    """A replay reply's ``(topic, seq, payload)`` as a DEALER sees it, or None for the end marker.

    ``[b"", seq, payload]`` (vLLM <= 0.25, SGLang) has an empty topic. Following Dynamo, a data reply with an
    empty payload and an end marker with a non-empty one are errors.
    """
    if len(frames) == 3 and frames[0] == b"":
        topic, seq_frame, payload = b"", frames[1], frames[2]
    elif len(frames) == 4 and frames[0] == b"":
        topic, seq_frame, payload = frames[1], frames[2], frames[3]
    else:
        raise WireDecodeError(f"malformed replay reply: {len(frames)} frames")
    if seq_frame == END_SEQ:
        if payload:
            raise WireDecodeError("replay end marker carries a non-empty payload")
        return None
    seq = decode_seq(seq_frame)
    if not payload:
        raise WireDecodeError(f"replay reply for seq {seq} has an empty payload")
    return topic, seq, payload


@overload
def decode(
    frames: Sequence[bytes],
    *,
    replay: Literal[False] = False,
    max_payload_bytes: int = MAX_RAW_PAYLOAD_BYTES,
    accept_bytes_hashes: bool = True,
) -> RawMessage: ...


@overload
def decode(
    frames: Sequence[bytes],
    *,
    replay: Literal[True],
    max_payload_bytes: int = MAX_RAW_PAYLOAD_BYTES,
    accept_bytes_hashes: bool = True,
) -> RawMessage | None: ...


def decode(
    frames: Sequence[bytes],
    *,
    replay: bool = False,
    max_payload_bytes: int = MAX_RAW_PAYLOAD_BYTES,
    accept_bytes_hashes: bool = True,
) -> RawMessage | None:
    """A live message ``[topic, seq, payload]``, or with ``replay`` a DEALER's view of a replay reply.

    Replay replies are ``[b"", seq, payload]`` (vLLM <= 0.25) or ``[b"", topic, seq, payload]``; the end
    marker (seq ff*8, empty payload) gives None. Live, seq ff*8 is reserved for that marker.
    """
    if not replay:
        topic, seq, payload = split_live_frames(frames)
    else:
        reply = split_replay_frames(frames)
        if reply is None:
            return None
        topic, seq, payload = reply
    batch = decode_payload(payload, max_payload_bytes=max_payload_bytes, accept_bytes_hashes=accept_bytes_hashes)
    return RawMessage(bytes(topic), seq, batch)
