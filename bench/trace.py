"""The benchmark trace: vLLM 0.32.0 map-form batches, encoded once before any timing.

Shape (issue #8): ``batches`` batches of 8 events; a store carries 4 blocks × 16 tokens; about 30% of the
events are single-hash removes of a block stored earlier.  The trace is built so that every raw event
becomes exactly one outbound RouterEvent, which lets the bench compute the final outbound cursor:

* every stored hash is fresh (no duplicate copies, so dedup never suppresses a store or a remove);
* a store never continues the chain of the event right before it (coalescing merges only continuations);
* two removes are never adjacent inside a batch (coalescing would merge them);
* a remove always targets a block that is resident (stored earlier, not yet removed).

Key order and value forms follow docs/spec/vllm-wire.md §1/§6.3 (msgpack-python ``packb`` of ordered dicts is
byte-identical to vLLM 0.32.0's msgspec encoder).
"""

from __future__ import annotations

import random

import attrs
import msgpack

EVENTS_PER_BATCH = 8
BLOCKS_PER_STORE = 4
BLOCK_SIZE = 16
REMOVE_FRACTION = 0.3
TOPIC = b"kv-events"
VOCAB = 151_936  # a Qwen-sized vocabulary, so token ids take their realistic 1–5 bytes on the wire

# Non-adjacent remove positions in an 8-event batch: two removes (2/8) or three (3/8), mixed so the mean
# remove share is 30%.
_TWO_REMOVES = ((1, 4), (2, 6), (0, 5), (3, 7), (1, 6))
_THREE_REMOVES = ((1, 3, 6), (0, 2, 5), (2, 4, 7), (1, 4, 6))


@attrs.frozen
class TraceStats:
    batches: int
    events: int
    stores: int
    removes: int
    stored_blocks: int
    removed_blocks: int
    payload_bytes: int

    @property
    def blocks(self) -> int:
        """Blocks carried by all events (stored blocks plus removed hashes)."""
        return self.stored_blocks + self.removed_blocks


def _store(
    rng: random.Random, parent: int | None, token_pool: list[int]
) -> tuple[dict[str, object], list[int]]:
    hashes = [rng.getrandbits(64) for _ in range(BLOCKS_PER_STORE)]
    # A random window of a pre-drawn token pool: realistic values at a fraction of the drawing cost.
    offset = rng.randrange(len(token_pool) - BLOCKS_PER_STORE * BLOCK_SIZE)
    tokens = token_pool[offset : offset + BLOCKS_PER_STORE * BLOCK_SIZE]
    event: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * BLOCKS_PER_STORE,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    return event, hashes


def _remove(block_hash: int) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": "GPU", "group_idx": 0}


def _make_tokens_unique(event: dict[str, object], store_number: int) -> None:
    """Give every block of the store token content no other block has (its first two tokens number it).

    Random windows of the token pool repeat: two roots (or two children of one parent) with the same tokens
    are the same prefix to a content-keyed consumer such as Dynamo's radix tree, which keeps one of them and
    refuses stores under the other's hashes. Unique content keeps the resident count of every consumer
    equal to the blocks stored.
    """
    tokens = event["token_ids"]
    assert isinstance(tokens, list)
    for block in range(BLOCKS_PER_STORE):
        high, low = divmod(store_number * BLOCKS_PER_STORE + block, VOCAB)
        tokens[block * BLOCK_SIZE] = high
        tokens[block * BLOCK_SIZE + 1] = low


class _Tree:
    """Parent links and child counts of the resident blocks: the prefix-closed trace removes leaves only."""

    def __init__(self) -> None:
        self.parent_of: dict[int, int | None] = {}
        self.children: dict[int, int] = {}

    def stored(self, parent: int | None, hashes: list[int]) -> None:
        for block_hash in hashes:
            self.parent_of[block_hash] = parent
            if parent is not None:
                self.children[parent] = self.children.get(parent, 0) + 1
            parent = block_hash

    def removed(self, block_hash: int) -> None:
        parent = self.parent_of.pop(block_hash)
        if parent is not None:
            self.children[parent] -= 1

    def is_leaf(self, block_hash: int) -> bool:
        return not self.children.get(block_hash)


def _victim(rng: random.Random, resident: list[int], tree: _Tree | None) -> int | None:
    """Index (in ``resident``) of the block to remove: any block, or with a tree a leaf (None: none found)."""
    if tree is None:
        return rng.randrange(len(resident))
    for _ in range(64):  # about a quarter of the resident blocks are leaves (4-block chains)
        index = rng.randrange(len(resident))
        if tree.is_leaf(resident[index]):
            return index
    return None


def build_trace(
    batches: int, *, seed: int = 8, dp_rank: int = 0, with_removes: bool = True, prefix_closed: bool = False
) -> tuple[list[bytes], TraceStats]:
    """``batches`` encoded payloads (frame 2 of each message) and what they contain.

    ``with_removes=False`` makes a stores-only trace whose blocks all have distinct token content (every stored
    block stays resident: the memory phase of the side-by-side figure, where both consumers must end with the
    same known number of resident blocks). ``prefix_closed=True`` keeps the removes but takes only leaves, and
    gives every block distinct tokens: a consumer with a prefix-closed, content-keyed tree (Dynamo's) then
    applies every event instead of refusing stores under removed parents. The default trace is unchanged.
    """
    rng = random.Random(seed)
    token_pool = [rng.randrange(VOCAB) for _ in range(1 << 16)]
    resident: list[int] = []
    tree = _Tree() if prefix_closed else None
    payloads: list[bytes] = []
    stores = removes = 0
    ts = 1_700_000_000.0
    for _ in range(batches):
        pattern = rng.choice(_THREE_REMOVES) if rng.random() < 0.4 else rng.choice(_TWO_REMOVES)
        events: list[dict[str, object]] = []
        previous_last: int | None = None
        for position in range(EVENTS_PER_BATCH):
            victim = (
                _victim(rng, resident, tree) if with_removes and position in pattern and resident else None
            )
            if victim is not None:
                resident[victim], resident[-1] = resident[-1], resident[victim]
                gone = resident.pop()
                events.append(_remove(gone))
                if tree is not None:
                    tree.removed(gone)
                removes += 1
                previous_last = None
                continue
            # A quarter of the stores start a request; the rest extend an older prefix (never the chain
            # the previous event just stored, which would coalesce).
            parent = None
            if resident and rng.random() >= 0.25:
                parent = resident[rng.randrange(len(resident))]
                if parent == previous_last:
                    parent = None
            event, hashes = _store(rng, parent, token_pool)
            if prefix_closed or not with_removes:
                _make_tokens_unique(event, stores)
            if tree is not None:
                tree.stored(parent, hashes)
            events.append(event)
            resident.extend(hashes)
            previous_last = hashes[-1]
            stores += 1
        ts += 0.001
        payloads.append(msgpack.packb([ts, events, dp_rank]))
    stats = TraceStats(
        batches=batches,
        events=stores + removes,
        stores=stores,
        removes=removes,
        stored_blocks=stores * BLOCKS_PER_STORE,
        removed_blocks=removes,
        payload_bytes=sum(map(len, payloads)),
    )
    return payloads, stats
