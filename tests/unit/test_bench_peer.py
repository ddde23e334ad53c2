"""The side-by-side bench figure's pure parts: metrics parsing, loss accounting, figure selection, the
stores-only trace, and finding (or failing to get) Dynamo's venv."""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack
import pytest

from bench import dynamo_env
from bench.__main__ import selected
from bench.peer_procs import DYNAMO_APPLIED, metric_sum, parse_metrics
from bench.peer_report import kvagent_loss
from bench.trace import BLOCK_SIZE, BLOCKS_PER_STORE, VOCAB, build_trace

# Lines as Dynamo 1.6.1's indexer answers /metrics (captured from the real binary).
DYNAMO_METRICS = """\
# HELP dynamo_kvindexer_workers Number of registered worker instances
# TYPE dynamo_kvindexer_workers gauge
dynamo_kvindexer_workers 1
# HELP dynamo_kvrouter_kv_cache_events_applied Total number of KV cache events applied to index
# TYPE dynamo_kvrouter_kv_cache_events_applied counter
dynamo_kvrouter_kv_cache_events_applied{event_type="removed",status="block_not_found"} 8860
dynamo_kvrouter_kv_cache_events_applied{event_type="removed",status="ok"} 15093
dynamo_kvrouter_kv_cache_events_applied{event_type="stored",status="ok"} 40654
dynamo_kvrouter_kv_cache_events_applied{event_type="stored",status="parent_block_not_found"} 15393
dynamo_kvrouter_kv_cache_events_applied_total_bogus 5
"""


def test_dynamo_progress_is_every_outcome_of_the_applied_counter() -> None:
    values = parse_metrics(DYNAMO_METRICS)
    assert values["dynamo_kvindexer_workers"] == 1
    # Every raw event it processed counts, whatever the outcome; a longer name with the same prefix does not.
    assert metric_sum(values, DYNAMO_APPLIED) == 8860 + 15093 + 40654 + 15393


def _kvagent_run(lost: int, **metrics: float) -> dict[str, object]:
    return {"lost_events": lost, "details": {"metrics": metrics}}


def test_loss_counts_only_the_loss_counters() -> None:
    published = {'kvagent_events_published_total{slot="bench"}': 80001.0}  # "published" contains "shed"
    clean = _kvagent_run(0, **published, **{'kvagent_ingest_shed_bytes_total{slot="bench"}': 0.0})
    assert kvagent_loss([clean]) == (0, 0.0)
    shed = _kvagent_run(0, **{'kvagent_ingest_sheds_total{slot="bench"}': 2.0})
    missing = _kvagent_run(72, **{'kvagent_gaps_total{slot="bench"}': 1.0})
    assert kvagent_loss([clean, shed, missing]) == (72, 3.0)


@pytest.mark.parametrize(
    ("names", "peer", "expected"),
    [
        (["ingest"], "dynamo", ["peer"]),
        (["ingest"], "none", ["peer"]),
        (["ingest"], None, ["ingest"]),
        (["ingest", "peer", "dump"], "dynamo", ["peer", "dump"]),
        (["peer"], None, ["peer"]),
    ],
)
def test_peer_flag_makes_ingest_the_side_by_side_figure(
    names: list[str], peer: str | None, expected: list[str]
) -> None:
    assert selected(names, peer) == expected


def test_all_figures_with_peer_run_the_side_by_side_figure_once_and_not_the_in_process_ingest() -> None:
    chosen = selected([], "dynamo")
    assert chosen.count("peer") == 1
    assert "ingest" not in chosen
    assert "ingest" in selected([], None)


def test_stores_only_trace_leaves_every_stored_block_resident() -> None:
    payloads, stats = build_trace(2_000, with_removes=False)
    assert stats.removes == 0
    assert stats.stored_blocks == stats.events * BLOCKS_PER_STORE
    hashes: set[int] = set()
    contents: set[tuple[int, ...]] = set()
    for payload in payloads:
        for event in msgpack.unpackb(payload)[1]:
            assert event["type"] == "BlockStored"
            parent = event["parent_block_hash"]
            assert parent is None or parent in hashes  # every parent is resident: a prefix-closed tree
            hashes.update(event["block_hashes"])
            tokens = event["token_ids"]
            assert len(tokens) == BLOCKS_PER_STORE * BLOCK_SIZE
            assert all(0 <= token < VOCAB for token in tokens)
            contents.update(tuple(tokens[i : i + BLOCK_SIZE]) for i in range(0, len(tokens), BLOCK_SIZE))
    assert len(hashes) == stats.stored_blocks  # fresh hashes only: resident count == stored blocks
    # Distinct content per block: a content-keyed consumer (Dynamo's radix tree) keeps every one of them.
    assert len(contents) == stats.stored_blocks


def test_default_trace_still_removes() -> None:
    _, stats = build_trace(200)
    assert 0.2 < stats.removes / stats.events < 0.4


def test_a_named_python_without_dynamo_is_refused_with_the_variable_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # kvagent's own python: Dynamo is never installed next to kvagent.
    monkeypatch.setenv(dynamo_env.PYTHON_ENV, sys.executable)
    found = dynamo_env.find_dynamo(install=False)
    assert found.python is None
    assert dynamo_env.PYTHON_ENV in found.note


def test_without_any_venv_and_no_install_the_note_says_how(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(dynamo_env.PYTHON_ENV, raising=False)
    monkeypatch.setattr(dynamo_env, "BENCH_VENV", tmp_path / "bench")
    monkeypatch.setattr(dynamo_env, "INTEROP_VENV", tmp_path / "interop")
    found = dynamo_env.find_dynamo(install=False)
    assert found.python is None
    assert "--peer dynamo" in found.note


@pytest.mark.slow
def test_an_uninstallable_package_gives_a_note_not_an_exception(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(dynamo_env.PYTHON_ENV, raising=False)
    monkeypatch.setattr(dynamo_env, "BENCH_VENV", tmp_path / "bench")
    monkeypatch.setattr(dynamo_env, "INTEROP_VENV", tmp_path / "interop")
    monkeypatch.setenv(dynamo_env.PACKAGE_ENV, str(tmp_path / "no-such-wheel-1.0-py3-none-any.whl"))
    found = dynamo_env.find_dynamo(install=True)
    assert found.python is None
    assert "pip could not install" in found.note
    assert (tmp_path / "bench" / "bin" / "python").exists()  # the venv itself was made, in its own place


def test_bench_pins_the_same_dynamo_as_the_interop_session() -> None:
    noxfile = (Path(__file__).resolve().parents[2] / "noxfile.py").read_text()
    assert f'DYNAMO_RUNTIME = "{dynamo_env.DYNAMO_RUNTIME}"' in noxfile


def test_prefix_closed_trace_removes_only_leaves_and_keeps_every_parent_resident() -> None:
    payloads, stats = build_trace(2_000, prefix_closed=True)
    assert 0.2 < stats.removes / stats.events < 0.4
    parent_of: dict[int, int | None] = {}
    contents: set[tuple[int, ...]] = set()
    for payload in payloads:
        for event in msgpack.unpackb(payload)[1]:
            hashes = event["block_hashes"]
            if event["type"] == "BlockRemoved":
                (gone,) = hashes
                assert gone in parent_of
                assert gone not in parent_of.values()  # a leaf: no resident block names it as parent
                del parent_of[gone]
                continue
            parent = event["parent_block_hash"]
            assert parent is None or parent in parent_of  # never a store under a removed block
            tokens = event["token_ids"]
            contents.update(tuple(tokens[i : i + BLOCK_SIZE]) for i in range(0, len(tokens), BLOCK_SIZE))
            for block_hash in hashes:
                assert block_hash not in parent_of
                parent_of[block_hash] = parent
                parent = block_hash
    assert len(contents) == stats.stored_blocks
