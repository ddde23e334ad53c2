"""Loaders for the real vLLM 0.32.0 byte vectors kept in the repository (tests/data/vectors; README.md there says
where each capture came from)."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack

VECTORS_DIR = Path(__file__).resolve().parents[1] / "data" / "vectors"


def load_structs() -> dict[str, tuple[str, list[bytes]]]:
    cases: dict[str, tuple[str, list[bytes]]] = {}
    with (VECTORS_DIR / "vllm-0.32.0-structs.jsonl").open() as handle:
        for line in handle:
            case = json.loads(line)
            cases[case["case"]] = (case["note"], [bytes.fromhex(f) for f in case["frames"]])
    return cases


def load_live() -> tuple[list[list[bytes]], list[list[bytes]]]:
    sub: list[list[bytes]] = []
    replay: list[list[bytes]] = []
    with (VECTORS_DIR / "vllm-0.32.0-live.jsonl").open() as handle:
        for line in handle:
            message = json.loads(line)
            frames = [bytes.fromhex(f) for f in message["frames"]]
            (sub if message["socket"] == "sub" else replay).append(frames)
    return sub, replay


def live_model(messages: list[list[bytes]]) -> set[int]:
    """The block hashes resident after ``messages``, by plain set arithmetic on the raw msgpack payloads."""
    model: set[int] = set()
    for frames in messages:
        _, events, _ = msgpack.unpackb(frames[2], strict_map_key=False)
        for event in events:
            if event["type"] == "BlockStored":
                model.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                model.difference_update(event["block_hashes"])
            else:
                model.clear()
    return model
