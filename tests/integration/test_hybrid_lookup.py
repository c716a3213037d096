"""The coordinated hit window: vLLM's own KV cache coordinator (real vLLM 0.32
objects, no engine) decides how far a prefix hit reaches, fed with the pool's
hits through umbp's lookup pool.

Cache layouts are built from vLLM's real spec classes, the shapes an engine
builds for the tiny models of ``umbp.testing.hybrid_models``: block size 32,
sliding window 64 (two contiguous blocks needed for a hit).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp.core.geometry import CacheGeometry
from umbp.core.identity import KeySpace, RankTopology
from umbp.core.lookup.query import LookupQuery, build_lookup_query
from umbp.core.lookup.windows import LoadSpec, fold_rank_hits
from umbp.shell.hybrid_lookup import HybridLookup
from umbp.shell.vllm_compat.versions import coordinator_arguments

pytestmark = pytest.mark.integration

vllm_interface = pytest.importorskip("vllm.v1.kv_cache_interface")

BLOCK = 32
WINDOW = 64
FULL = "full"
SLIDING = "sliding"
MAMBA = "mamba"


# -- real vLLM objects --------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_config() -> Any:
    from vllm.config import VllmConfig

    return VllmConfig()


def _spec(kind: str, block_size: int = BLOCK) -> Any:
    import torch

    attention = {
        "block_size": block_size, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32,
    }
    if kind == FULL:
        return vllm_interface.FullAttentionSpec(**attention)
    if kind == SLIDING:
        return vllm_interface.SlidingWindowSpec(**attention, sliding_window=WINDOW)
    if kind == MAMBA:
        return vllm_interface.MambaSpec(
            block_size=block_size,
            shapes=((2, 128),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
        )
    raise ValueError(kind)


def _kv_cache_config(
    kinds: Iterable[str], *, transfer: Iterable[bool] | None = None, hash_block_size: int = BLOCK,
    block_sizes: Iterable[int] | None = None,
) -> Any:
    kinds = list(kinds)
    transfer = list(transfer) if transfer is not None else [True] * len(kinds)
    sizes = list(block_sizes) if block_sizes is not None else [BLOCK] * len(kinds)
    groups = [
        vllm_interface.KVCacheGroupSpec(
            layer_names=[f"model.layers.{i}.attn"],
            kv_cache_spec=_spec(kind, size),
            enable_kv_transfer=enabled,
        )
        for i, (kind, enabled, size) in enumerate(zip(kinds, transfer, sizes))
    ]
    return vllm_interface.KVCacheConfig(
        num_blocks=256,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=0,
        hash_block_size=hash_block_size,
    )


def _geometry(
    kv_cache_config: Any, *, block_size: int = BLOCK, hash_block_size: int = BLOCK,
    use_eagle: bool = False,
) -> CacheGeometry:
    group_ids = tuple(kv_cache_config.prefix_cacheable_group_ids)
    sizes = tuple(kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size for g in group_ids)
    return CacheGeometry(
        group_ids=group_ids,
        group_block_sizes=sizes,
        lookup_units=sizes,
        block_size=block_size,
        hash_block_size=hash_block_size,
        use_eagle=use_eagle,
        coordinated=True,
    )


def _hybrid(vllm_config: Any, kinds: Iterable[str], **config: Any) -> HybridLookup:
    kv_cache_config = _kv_cache_config(kinds, **config)
    return HybridLookup(vllm_config, kv_cache_config, _geometry(kv_cache_config), False)


class SlidingFull(NamedTuple):
    hybrid: HybridLookup
    sliding: int
    full: int


@pytest.fixture(
    scope="module", params=[(SLIDING, FULL), (FULL, SLIDING)], ids=["swa-first", "full-first"]
)
def sliding_full(request: pytest.FixtureRequest, vllm_config: Any) -> SlidingFull:
    """Group order as a gemma3_text engine builds it, and the other way round."""
    kinds = request.param
    return SlidingFull(_hybrid(vllm_config, kinds), kinds.index(SLIDING), kinds.index(FULL))


# -- requests and pool answers ------------------------------------------------------

KEYSPACE = KeySpace("hybridtest", RankTopology())
Predicate = Callable[[int, int], bool]
"""``(group_id, token_end) -> hit?``"""


def _hashes(count: int, salt: bytes = b"") -> list[bytes]:
    """Chained, like vLLM's: each hash fingerprints the whole prefix before it."""
    hashes: list[bytes] = []
    parent = salt
    for index in range(count):
        parent = hashlib.sha256(parent + index.to_bytes(4, "big")).digest()
        hashes.append(parent)
    return hashes


def _every(group_id: int, token_end: int) -> bool:
    return True


def _nothing(group_id: int, token_end: int) -> bool:
    return False


def _query(
    hybrid: HybridLookup, hashes: list[bytes], num_tokens: int, local_tokens: int = 0
) -> LookupQuery:
    return build_lookup_query(
        hybrid.geometry, KEYSPACE, hashes, local_tokens, num_tokens
    )


def _folded(
    hybrid: HybridLookup, query: LookupQuery, pool_has: Predicate
) -> tuple[tuple[bool, ...], ...]:
    answers = [
        pool_has(group_id, query.local_tokens + query.units[position] * (index + 1))
        for position, group_id in enumerate(hybrid.geometry.group_ids)
        for _ in range(query.rank_count)
        for index in range(len(query.object_hashes[position]))
    ]
    folded = fold_rank_hits(query, answers)
    assert folded is not None
    return folded


def _window(
    hybrid: HybridLookup,
    num_tokens: int,
    pool_has: Predicate = _every,
    *,
    local_tokens: int = 0,
    local_has: Predicate = _every,
    salt: bytes = b"",
) -> LoadSpec | None:
    hashes = _hashes(num_tokens // hybrid.geometry.hash_block_size, salt)
    query = _query(hybrid, hashes, num_tokens, local_tokens)
    unit = dict(zip(hybrid.geometry.group_ids, hybrid.geometry.lookup_units))

    def has_local_block(group_id: int, block_hash: bytes) -> bool:
        token_end = (hashes.index(block_hash) + 1) * hybrid.geometry.hash_block_size
        assert token_end <= local_tokens and token_end % unit[group_id] == 0
        return local_has(group_id, token_end)

    spec = hybrid.window(query, _folded(hybrid, query, pool_has), hashes, has_local_block)
    assert not hybrid.holds_hits
    return spec


def _missing(group_id: int, token_ends: Iterable[int]) -> Predicate:
    absent = frozenset(token_ends)
    return lambda g, end: not (g == group_id and end in absent)


# -- (1) sliding window + full attention --------------------------------------------


def test_every_object_a_hit_reaches_the_last_full_block_before_the_final_token(
    sliding_full: SlidingFull,
) -> None:
    spec = _window(sliding_full.hybrid, 10 * BLOCK + 5)
    assert spec is not None
    assert (spec.local_tokens, spec.external_tokens) == (0, 10 * BLOCK)
    hashes = tuple(_hashes(10))
    assert spec.block_hashes_by_group[sliding_full.full] == hashes
    # The sliding group needs only the window's blocks; the rest are null.
    assert spec.block_hashes_by_group[sliding_full.sliding] == (None,) * 8 + hashes[8:]


def test_a_full_attention_block_missing_in_the_middle_stops_the_hit_before_it(
    sliding_full: SlidingFull,
) -> None:
    pool_has = _missing(sliding_full.full, [5 * BLOCK])
    spec = _window(sliding_full.hybrid, 10 * BLOCK + 5, pool_has)
    assert spec is not None
    assert spec.external_tokens == 4 * BLOCK


def test_sliding_window_blocks_missing_far_outside_the_window_do_not_shorten_the_hit(
    sliding_full: SlidingFull,
) -> None:
    # A contiguous-prefix rule would give 0 here; the coordinator needs only the
    # blocks inside the window before the hit's end.
    pool_has = _missing(sliding_full.sliding, range(BLOCK, 7 * BLOCK + 1, BLOCK))
    spec = _window(sliding_full.hybrid, 10 * BLOCK + 5, pool_has)
    assert spec is not None
    assert spec.external_tokens == 10 * BLOCK


def test_a_sliding_window_block_missing_inside_the_window_moves_the_hit_back(
    sliding_full: SlidingFull,
) -> None:
    hybrid, sliding = sliding_full.hybrid, sliding_full.sliding
    spec = _window(hybrid, 10 * BLOCK + 5, _missing(sliding, [10 * BLOCK]))
    shorter = _window(hybrid, 9 * BLOCK + 5)
    assert spec is not None and shorter is not None
    assert spec == shorter and spec.external_tokens == 9 * BLOCK
    # Two missing blocks a window apart leave a run too short for the window
    # between them: the hit falls back before both.
    spec = _window(hybrid, 10 * BLOCK + 5, _missing(sliding, [10 * BLOCK, 8 * BLOCK]))
    assert spec is not None and spec.external_tokens == 7 * BLOCK


def test_nothing_in_the_pool_loads_nothing(sliding_full: SlidingFull) -> None:
    assert _window(sliding_full.hybrid, 10 * BLOCK + 5, _nothing) is None


# -- (2) never the last prompt token, never before the local tokens ----------------


def test_a_block_aligned_prompt_leaves_its_last_block_to_compute(
    sliding_full: SlidingFull,
) -> None:
    spec = _window(sliding_full.hybrid, 10 * BLOCK)
    assert spec is not None
    assert spec.external_tokens == 9 * BLOCK


def test_the_window_starts_at_the_local_tokens(sliding_full: SlidingFull) -> None:
    spec = _window(sliding_full.hybrid, 10 * BLOCK + 5, local_tokens=3 * BLOCK)
    assert spec is not None
    assert (spec.local_tokens, spec.external_tokens) == (3 * BLOCK, 10 * BLOCK)


def test_local_blocks_count_only_where_vllm_still_holds_them(sliding_full: SlidingFull) -> None:
    hybrid, sliding = sliding_full.hybrid, sliding_full.sliding
    # Nothing in the pool past the local tokens: the hit is vLLM's own, so no
    # window, however the local blocks look.
    assert _window(hybrid, 10 * BLOCK + 5, _nothing, local_tokens=6 * BLOCK) is None
    # The pool holds the rest, but vLLM evicted its sliding-window blocks: the
    # coordinator still finds the window past them.
    spec = _window(
        hybrid, 10 * BLOCK + 5, local_tokens=6 * BLOCK, local_has=lambda g, end: g != sliding
    )
    assert spec is not None and spec.external_tokens == 10 * BLOCK
    # The pool lacks the sliding blocks after the local tokens and vLLM those
    # near their end: the only hit ends inside the local tokens, so no window.
    spec = _window(
        hybrid, 10 * BLOCK + 5,
        _missing(sliding, range(7 * BLOCK, 10 * BLOCK + 1, BLOCK)),
        local_tokens=6 * BLOCK,
        local_has=lambda g, end: g != sliding or end <= 2 * BLOCK,
    )
    assert spec is None


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_window_starts_at_the_local_tokens_and_ends_before_the_last_token(
    sliding_full: SlidingFull, data: st.DataObject
) -> None:
    hybrid = sliding_full.hybrid
    group_ids = hybrid.geometry.group_ids
    num_tokens = data.draw(st.integers(2, 14 * BLOCK), label="num_tokens")
    local_blocks = data.draw(st.integers(0, (num_tokens - 2) // BLOCK), label="local_blocks")
    local_tokens = local_blocks * BLOCK
    limit = num_tokens // BLOCK
    pool = data.draw(
        st.frozensets(st.tuples(st.sampled_from(group_ids),
                                st.integers(1, max(1, limit)))),
        label="pool_hits",
    )
    local = data.draw(
        st.frozensets(st.tuples(st.sampled_from(group_ids),
                                st.integers(1, max(1, local_blocks)))),
        label="local_hits",
    )
    spec = _window(
        hybrid, num_tokens,
        lambda g, end: (g, end // BLOCK) in pool,
        local_tokens=local_tokens,
        local_has=lambda g, end: (g, end // BLOCK) in local,
        salt=num_tokens.to_bytes(4, "big"),
    )
    if spec is not None:
        assert spec.local_tokens == local_tokens
        assert local_tokens < spec.external_tokens <= num_tokens - 1
        # Every block the hit needs is a pool hit (past the local tokens) or
        # still in vLLM (inside them): all full-attention blocks, and the
        # sliding window's blocks before the end.
        def available(group_id: int, block: int) -> bool:
            return (group_id, block) in (local if block <= local_blocks else pool)

        end = spec.external_tokens // BLOCK
        assert all(available(sliding_full.full, block) for block in range(1, end + 1))
        window = range(max(1, end - 1), end + 1)
        assert all(available(sliding_full.sliding, block) for block in window)


# -- (3) the lookup pool holds hits only during a call ------------------------------


def test_the_lookup_pool_is_empty_when_the_coordinator_raises(vllm_config: Any) -> None:
    # One sliding-window group: the coordinator reads hashes up to the query's
    # end, so hashes shorter than the query make vLLM's manager raise.
    hybrid = _hybrid(vllm_config, [SLIDING])
    hashes = _hashes(10)
    query = _query(hybrid, hashes, 10 * BLOCK + 5)
    folded = _folded(hybrid, query, _every)
    with pytest.raises(IndexError):
        hybrid.window(query, folded, hashes[:3], lambda g, h: True)
    assert not hybrid.holds_hits
    # ...and the next call sees only its own hits.
    assert _window(hybrid, 10 * BLOCK + 5, _nothing) is None
    spec = _window(hybrid, 10 * BLOCK + 5)
    assert spec is not None and spec.external_tokens == 10 * BLOCK


def test_the_lookup_pool_is_empty_when_the_local_probe_raises(sliding_full: SlidingFull) -> None:
    hybrid = sliding_full.hybrid
    hashes = _hashes(10)
    query = _query(hybrid, hashes, 10 * BLOCK + 5, local_tokens=2 * BLOCK)

    def broken(group_id: int, block_hash: bytes) -> bool:
        raise RuntimeError("device block pool gone")

    with pytest.raises(RuntimeError):
        hybrid.window(query, _folded(hybrid, query, _every), hashes, broken)
    assert not hybrid.holds_hits


def test_a_query_for_other_lookup_units_is_refused(vllm_config: Any) -> None:
    hybrid = _hybrid(vllm_config, [SLIDING, FULL])
    other = CacheGeometry(
        group_ids=(0, 1), group_block_sizes=(BLOCK, BLOCK), lookup_units=(BLOCK, BLOCK // 2),
        block_size=BLOCK, hash_block_size=BLOCK // 2, coordinated=True,
    )
    hashes = _hashes(20)
    query = build_lookup_query(other, KEYSPACE, hashes, 0, 10 * BLOCK)
    with pytest.raises(ValueError, match="lookup units"):
        hybrid.window(query, _folded(hybrid, query, _every), hashes, lambda g, h: True)
    assert not hybrid.holds_hits


# -- groups that are not prefix cacheable, Mamba, feature detection ----------------


def test_only_transferable_groups_take_part_and_local_probes_get_vllm_group_ids(
    vllm_config: Any,
) -> None:
    # Group 0 is not transferred (like a device-side replica): the lookup
    # coordinator sees groups 1 and 2 as its 0 and 1.
    kv_cache_config = _kv_cache_config([FULL, SLIDING, FULL], transfer=[False, True, True])
    hybrid = HybridLookup(vllm_config, kv_cache_config, _geometry(kv_cache_config), False)
    assert hybrid.geometry.group_ids == (1, 2)
    asked: set[int] = set()

    def local_has(group_id: int, token_end: int) -> bool:
        asked.add(group_id)
        return True

    spec = _window(hybrid, 10 * BLOCK + 5, local_tokens=2 * BLOCK, local_has=local_has)
    assert asked == {1, 2}
    assert spec is not None and spec.external_tokens == 10 * BLOCK
    spec = _window(hybrid, 10 * BLOCK + 5, _missing(2, [4 * BLOCK]))
    assert spec is not None and spec.external_tokens == 3 * BLOCK


def test_mamba_and_full_attention_hit_at_the_last_saved_state(vllm_config: Any) -> None:
    hybrid = _hybrid(vllm_config, [MAMBA, FULL])
    assert not hybrid.allows_partial_hash_hits
    # Align mode keeps states at boundaries only: the latest saved one decides.
    saved = {3 * BLOCK, 7 * BLOCK}
    spec = _window(hybrid, 10 * BLOCK + 5, lambda g, end: g != 0 or end in saved)
    assert spec is not None and spec.external_tokens == 7 * BLOCK
    assert spec.block_hashes_by_group[0] == (None,) * 6 + (_hashes(7)[6],)


def test_partial_hash_hits_probe_every_hash_boundary_when_the_coordinator_allows(
    vllm_config: Any,
) -> None:
    # Mamba "align" blocks of 64 tokens hashed every 32: vLLM can resume from a
    # state saved mid-block, so lookups probe every 32 tokens.
    kv_cache_config = _kv_cache_config(
        [MAMBA, FULL], hash_block_size=BLOCK, block_sizes=[2 * BLOCK, BLOCK]
    )
    geometry = _geometry(kv_cache_config, block_size=2 * BLOCK, hash_block_size=BLOCK)
    hybrid = HybridLookup(vllm_config, kv_cache_config, geometry, True)
    assert hybrid.allows_partial_hash_hits
    assert hybrid.geometry.lookup_units == (BLOCK, BLOCK)
    assert hybrid.geometry.partial_hash_hits
    spec = _window(hybrid, 10 * BLOCK + 5, lambda g, end: g != 0 or end == 5 * BLOCK)
    assert spec is not None and spec.external_tokens == 5 * BLOCK
    # Without the user's switch the units stay at the block size.
    plain = HybridLookup(vllm_config, kv_cache_config, geometry, False)
    assert not plain.allows_partial_hash_hits
    assert plain.geometry.lookup_units == (2 * BLOCK, BLOCK)


def test_eagle_drops_the_last_block_of_the_hit(vllm_config: Any) -> None:
    kv_cache_config = _kv_cache_config([SLIDING, FULL])
    hybrid = HybridLookup(
        vllm_config, kv_cache_config, _geometry(kv_cache_config, use_eagle=True), False
    )
    spec = _window(hybrid, 10 * BLOCK + 5)
    assert spec is not None and spec.external_tokens == 9 * BLOCK


def test_coordinator_arguments_follow_the_signature() -> None:
    required = {"kv_cache_config": 1, "hash_block_size": 2}
    optional = {"num_prefill_lookahead": 0, "num_hash_lookahead_tokens": 3}
    v032 = ["kv_cache_config", "hash_block_size", "num_prefill_lookahead"]
    assert coordinator_arguments(v032, required, optional) == {
        "kv_cache_config": 1, "hash_block_size": 2, "num_prefill_lookahead": 0,
    }
    assert coordinator_arguments([*v032, "num_hash_lookahead_tokens"], required, optional)[
        "num_hash_lookahead_tokens"
    ] == 3
    with pytest.raises(RuntimeError, match="hash_block_size"):
        coordinator_arguments(["kv_cache_config"], required, optional)
