"""Properties of the page-stack identity (SGLang HiCache) and its hit counting.

These are the contract of umbp's SGLang backend that needs no SGLang: keys are
injective over (namespace, rank, page hash), no stack's namespace can be another's,
a leading-hit count never counts past a miss, and a load plan never names a page
outside the request or after a failed one.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from tests.property.key_format import parse_key
from umbp.core.identity import check_namespace_override, namespace_fingerprint
from umbp.core.page_identity import (
    SGLANG_STACK,
    PageRank,
    PageShape,
    leading_hit_count,
    page_key_space,
    page_keys,
    page_namespace,
    pages_to_write,
)

SHAPE = PageShape(
    stack=SGLANG_STACK, model_name="/models/tiny", kv_dtype="float32", pool_kind="MHA",
    layout="page_first_direct", page_size=16, layer_num=2, head_num=2, head_dim=32,
    v_head_dim=32, page_bytes=16384, is_mla=False, tp_size=2,
)
page_hashes = st.binary(min_size=32, max_size=32).map(bytes.hex)
shapes = st.builds(
    replace, st.just(SHAPE),
    model_name=st.sampled_from(["/models/tiny", "/models/other"]),
    kv_dtype=st.sampled_from(["float32", "bfloat16"]),
    layout=st.sampled_from(["page_first_direct", "page_first", "layer_first"]),
    page_size=st.sampled_from([16, 32]),
    layer_num=st.integers(1, 3), head_num=st.integers(1, 3),
    tp_size=st.sampled_from([1, 2]), pp_size=st.sampled_from([1, 2]),
)
ranks = st.builds(PageRank, tp=st.integers(0, 1), pp=st.integers(0, 1))


def _key(shape: PageShape, rank: PageRank, page_hash: str) -> str:
    namespace = page_namespace(shape, None).unwrap()
    keys = page_keys(page_key_space(namespace, shape), rank, shape, [page_hash])
    assert keys is not None
    return keys[0]


@given(shapes, shapes, ranks, ranks, page_hashes, page_hashes)
def test_keys_are_injective_over_shape_rank_and_page_hash(
    shape_a: PageShape, shape_b: PageShape, rank_a: PageRank, rank_b: PageRank,
    hash_a: str, hash_b: str,
) -> None:
    same_key = _key(shape_a, rank_a, hash_a) == _key(shape_b, rank_b, hash_b)
    assert same_key == (shape_a == shape_b and rank_a == rank_b and hash_a == hash_b)


@given(shapes, ranks, page_hashes)
def test_a_page_key_parses_back_to_its_namespace_and_hash(
    shape: PageShape, rank: PageRank, page_hash: str
) -> None:
    parts = parse_key(_key(shape, rank, page_hash)).unwrap()
    assert parts.namespace == page_namespace(shape, None).unwrap()
    assert parts.namespace.startswith(f"{SGLANG_STACK}.")
    assert parts.block_hash.hex() == page_hash
    assert parts.rank.tp == rank.tp and parts.rank.pp == rank.pp


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1, max_size=120))
def test_no_vllm_namespace_is_a_page_stack_namespace(override: str) -> None:
    """vLLM's namespace is a hex fingerprint or an explicit override; a page stack's
    always starts with its tag, which an override may not."""
    sglang_namespace = page_namespace(SHAPE, override)
    vllm_namespace = check_namespace_override(override)
    if vllm_namespace.value_or(None) is not None:
        assert sglang_namespace.unwrap() != vllm_namespace.unwrap()
    assert check_namespace_override(f"{SGLANG_STACK}.{override}").value_or(None) is None


def test_the_fingerprint_of_a_page_stack_is_not_hex_alone() -> None:
    namespace = page_namespace(SHAPE, None).unwrap()
    assert namespace.startswith(f"{SGLANG_STACK}.") and len(namespace) > 16


@given(st.lists(page_hashes, min_size=1, max_size=4))
def test_rank_replicated_pools_key_the_writer_shard_on_every_rank(hashes: list[str]) -> None:
    mla = replace(SHAPE, is_mla=True, pool_kind="MLA")
    space = page_key_space(page_namespace(mla, None).unwrap(), mla)
    assert page_keys(space, PageRank(tp=0), mla, hashes) == page_keys(
        space, PageRank(tp=1), mla, hashes)
    mha_space = page_key_space(page_namespace(SHAPE, None).unwrap(), SHAPE)
    assert page_keys(mha_space, PageRank(tp=0), SHAPE, hashes) != page_keys(
        mha_space, PageRank(tp=1), SHAPE, hashes)


@given(st.lists(page_hashes, max_size=3), st.sampled_from(["", "XY", "abc", "0g"]))
def test_a_page_hash_that_is_not_hex_gives_no_keys(hashes: list[str], bad: str) -> None:
    space = page_key_space(page_namespace(SHAPE, None).unwrap(), SHAPE)
    assert page_keys(space, PageRank(), SHAPE, [*hashes, bad]) is None


@given(st.lists(st.booleans(), max_size=40))
def test_leading_hit_count_never_counts_past_a_miss(answers: list[bool]) -> None:
    count = leading_hit_count(answers)
    assert all(answers[:count])
    assert count == len(answers) or not answers[count]


@given(st.lists(st.booleans(), max_size=40))
def test_a_load_writes_only_requested_pages_that_loaded_before_any_failure(
    loaded: list[bool],
) -> None:
    written = pages_to_write(loaded)
    assert set(written) <= set(range(len(loaded)))
    assert all(loaded[index] for index in written)
    first_failure = loaded.index(False) if False in loaded else len(loaded)
    assert all(index < first_failure for index in written)


def test_the_fingerprint_changes_with_every_shape_field() -> None:
    from umbp.core.page_identity import page_namespace_inputs

    base = namespace_fingerprint(page_namespace_inputs(SHAPE))
    changes: dict[str, object] = {
        "model_name": "m2", "kv_dtype": "bfloat16", "pool_kind": "MLA", "layout": "page_first",
        "page_size": 32, "layer_num": 3, "head_num": 4, "head_dim": 64, "v_head_dim": 16,
        "page_bytes": 1, "is_mla": True, "tp_size": 4, "pp_size": 2, "cp_size": 2, "dcp_size": 2,
    }
    for name, value in changes.items():
        changed = namespace_fingerprint(page_namespace_inputs(replace(SHAPE, **{name: value})))
        assert changed != base, name
