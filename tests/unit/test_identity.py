"""Identity: pinned digests, framing, canonical text, record ids (docs/identity.md)."""

from __future__ import annotations

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvagent.model.errors import IdentityError
from kvagent.model.ids import (
    CacheOwnerId,
    IdentitySource,
    attachment_record_id,
    cache_semantics_material,
    derive_cache_owner_id,
    explicit_material,
    resolve_stable_dp_slot_id,
    routing_scope_material,
    stable_dp_slot_material,
)
from tests.support.ids import OWNER, OWNER_TEXT


@pytest.mark.parametrize(
    ("name", "digest"),
    [
        ("demo", "18dc76520abaaa80a95ee869a5e94196"),
        ("gpu0", "781210ee12170343323089f1674bab28"),
        ("slot-1", "bf54bc4f1bab780653303eca18aaa4f7"),
    ],
)
def test_pinned_slot_ids(name: str, digest: str) -> None:
    slot = resolve_stable_dp_slot_id(name)
    assert str(slot) == digest
    assert slot.source is IdentitySource.EXPLICIT


def test_slot_material_bytes_are_the_documented_framing() -> None:
    material = stable_dp_slot_material("demo")
    assert material.hex() == (
        "220000006b766167656e742f737461626c652d64702d736c6f742f6578706c696369742f7631"
        "01000000"
        "04000000736c6f74"
        "0400000064656d6f"
    )
    assert blake3.blake3(material).digest()[:16] == resolve_stable_dp_slot_id("demo").digest


def test_slot_names_are_validated() -> None:
    with pytest.raises(IdentityError, match="must not be empty"):
        resolve_stable_dp_slot_id("")
    with pytest.raises(IdentityError, match="at most 1024"):
        resolve_stable_dp_slot_id("x" * 1025)
    assert resolve_stable_dp_slot_id("é" * 512)  # 1024 UTF-8 bytes is allowed


def test_seed_fixture_owner_round_trips() -> None:
    owner = CacheOwnerId.parse(OWNER_TEXT)
    assert str(owner) == OWNER_TEXT
    assert owner == OWNER  # the text form and the bytes form of the shared fixture owner agree
    assert owner.pool.dc_id.value == 3
    assert owner.slot.digest == b"\x04" * 16
    assert str(owner.pool.indexer_domain) == OWNER_TEXT.split("/")[0]


@given(
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=16, max_size=16),
    st.integers(0, 2**64 - 1),
    st.binary(min_size=16, max_size=16),
)
def test_cache_owner_text_round_trip(semantics: bytes, scope: bytes, dc: int, slot: bytes) -> None:
    text = f"{semantics.hex()}:{scope.hex()}/{dc:016x}/{slot.hex()}"
    owner = CacheOwnerId.parse(text)
    assert str(owner) == text
    assert CacheOwnerId.parse(str(owner)) == owner


@pytest.mark.parametrize(
    "text",
    [
        OWNER_TEXT.replace("01", "AB"),
        OWNER_TEXT[:-1],
        OWNER_TEXT + "0",
        OWNER_TEXT.replace(":", "/"),
        OWNER_TEXT.replace("/", ":", 1),
        OWNER_TEXT.replace(":", "").replace("/", ""),
        OWNER_TEXT.replace("/0000000000000003/", "/000000000000003/"),
        " " + OWNER_TEXT,
        "",
        "owner",
    ],
)
def test_malformed_owner_texts_are_rejected(text: str) -> None:
    with pytest.raises(IdentityError, match="cache owner id"):
        CacheOwnerId.parse(text)


def test_equality_ignores_the_source_flag() -> None:
    derived = derive_cache_owner_id("demo", kv_block_size=16)
    assert derived.pool.indexer_domain.cache_semantics.source is IdentitySource.DEFAULT_DERIVED
    parsed = CacheOwnerId.parse(str(derived))
    assert parsed == derived
    domain = parsed.pool.indexer_domain
    assert domain.cache_semantics.source is domain.routing_scope.source is parsed.slot.source
    assert parsed.slot.source is IdentitySource.EXPLICIT


def test_derivation_is_deterministic_and_sensitive() -> None:
    base = derive_cache_owner_id("demo", kv_block_size=16)
    assert str(base) == (
        "ca8ed73fce11e9fdc547145070b9d5b7:7b61e56677a8609fec55d20fb2e1d8aa/0000000000000000/18dc76520abaaa80a95ee869a5e94196"
    )
    assert derive_cache_owner_id("demo", kv_block_size=16) == base
    assert derive_cache_owner_id("demo", kv_block_size=32).pool != base.pool
    assert derive_cache_owner_id("demo", kv_block_size=16, cache_semantics={"model": "m"}).pool != base.pool
    assert derive_cache_owner_id("other", kv_block_size=16).slot != base.slot
    with pytest.raises(IdentityError):
        derive_cache_owner_id("demo", kv_block_size=0)


def test_record_ids() -> None:
    assert attachment_record_id(41, 1) == 6630049642736882
    assert attachment_record_id(41, 2) == 4743735865508233
    for generation in range(1, 200):
        record_id = attachment_record_id(2**53 - 1, generation)
        assert 0 < record_id < 2**53
    assert len({attachment_record_id(41, g) for g in range(1, 1000)}) == 999


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_record_id_properties(publisher_id: int, generation: int) -> None:
    record_id = attachment_record_id(publisher_id, generation)
    assert 0 < record_id < 2**53
    assert attachment_record_id(publisher_id, generation) == record_id


def test_default_materials_are_the_documented_bytes() -> None:
    assert cache_semantics_material(None, 16, 1).hex() == (
        "29000000" + b"dynamo/indexer-cache-semantics/default/v1".hex()
        + "01000000" + "0f000000" + b"kvagent-default".hex()
        + "10000000" + "0100"
    )  # fmt: skip
    assert routing_scope_material(None).hex() == (
        "27000000" + b"dynamo/indexer-routing-scope/default/v1".hex() + "01000000" + "0f000000"
        + b"kvagent-default".hex()
    )  # fmt: skip
    assert cache_semantics_material({"model": "m"}, 16, 1).hex() == (
        "2a000000" + b"dynamo/indexer-cache-semantics/explicit/v1".hex()
        + "01000000" + "05000000" + b"model".hex() + "01000000" + b"m".hex()
        + "10000000" + "0100"
    )  # fmt: skip


def test_explicit_maps_sort_keys_bytewise_and_enforce_limits() -> None:
    assert explicit_material({"b": "2", "a": "1"}) == explicit_material({"a": "1", "b": "2"})
    assert explicit_material({"b": "2", "a": "1"}).hex() == "02000000" + "0100000061" + "0100000031" + (
        "0100000062" + "0100000032"
    )
    with pytest.raises(IdentityError):
        explicit_material({})
    with pytest.raises(IdentityError):
        explicit_material({str(i): "v" for i in range(33)})
    with pytest.raises(IdentityError):
        explicit_material({"k" * 129: "v"})
    with pytest.raises(IdentityError):
        explicit_material({"k": ""})
