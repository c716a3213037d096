"""Properties of object identity: namespaces, topologies and keys (umbp.core.identity)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from returns.result import Failure, Success

from tests.property.key_format import KeyParts, parse_key
from umbp.core.identity import (
    FORMAT_VERSION,
    CacheGroupShape,
    KeySpace,
    NamespaceInputs,
    RankCoord,
    RankTopology,
    bound_keyspace,
    check_namespace_override,
    namespace_fingerprint,
    namespace_key_prefix,
    namespace_of_key,
    resolve_namespace,
)

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------ strategies

namespaces = st.from_regex(r"[A-Za-z0-9._-]{1,128}", fullmatch=True)
ranks = st.builds(
    RankCoord,
    tp=st.integers(0, 512),
    pcp=st.integers(0, 64),
    dcp=st.integers(0, 512),
    pp=st.integers(0, 64),
)
group_ids = st.integers(0, 10_000)
block_hashes = st.binary(min_size=1, max_size=40)
key_components = st.tuples(namespaces, ranks, group_ids, block_hashes)

# Spec field names are dataclass field names of vLLM's KV cache specs: identifiers.
spec_field_names = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True)
spec_field_values = st.text(max_size=24)
group_kinds = st.sampled_from(
    ["FullAttentionSpec", "SlidingWindowSpec", "MambaSpec", "MLAAttentionSpec"]
) | st.text(min_size=1, max_size=20)
group_shapes = st.builds(
    CacheGroupShape,
    kind=group_kinds,
    fields=st.dictionaries(spec_field_names, spec_field_values, max_size=6).map(
        lambda spec: tuple(spec.items())
    ),
)

SCALAR_INPUTS: dict[str, st.SearchStrategy[Any]] = {
    "model_id": st.text(min_size=1, max_size=40),
    "revision": st.none() | st.text(max_size=20),
    "kv_dtype": st.sampled_from(["auto/bfloat16", "fp8_e4m3/bfloat16", "auto/float16"])
    | st.text(min_size=1, max_size=16),
    "block_size": st.integers(1, 1 << 16),
    "hash_block_size": st.integers(1, 1 << 16),
    "tp_size": st.integers(1, 256),
    "pcp_size": st.integers(1, 64),
    "dcp_size": st.integers(1, 256),
    "pp_size": st.integers(1, 64),
    "weights": st.sampled_from(["files:" + "0" * 32, "files:" + "1" * 32, "hub:m@" + "a" * 40])
    | st.text(max_size=40),
    # Settings as the shell gives them: distinct names; the fingerprint sorts them.
    "model_settings": st.dictionaries(spec_field_names, spec_field_values, max_size=4).map(
        lambda settings: tuple(sorted(settings.items()))
    ),
    "format_version": st.integers(1, 1000),
}
namespace_inputs = st.builds(
    NamespaceInputs,
    groups=st.lists(group_shapes, min_size=1, max_size=4).map(tuple),
    **SCALAR_INPUTS,
)


# ------------------------------------------------------------------ keys


def object_key(namespace: str, rank: RankCoord, group_id: int, block_hash: bytes) -> str:
    """One rank's key as umbp builds it (the worker's ``KeySpace.key``)."""
    return KeySpace(namespace, RankTopology()).key(rank, group_id, block_hash)


@given(key_components)
def test_parse_key_inverts_object_key_so_keys_are_injective(
    components: tuple[str, RankCoord, int, bytes],
) -> None:
    namespace, rank, group_id, block_hash = components
    key = object_key(namespace, rank, group_id, block_hash)
    assert parse_key(key) == Success(
        KeyParts(FORMAT_VERSION, namespace, rank, group_id, block_hash)
    )


@given(key_components, key_components)
def test_keys_are_equal_exactly_when_namespace_rank_group_and_hash_are_equal(
    first: tuple[str, RankCoord, int, bytes], second: tuple[str, RankCoord, int, bytes]
) -> None:
    assert (object_key(*first) == object_key(*second)) == (first == second)


@given(key_components, st.sampled_from(range(4)), st.data())
def test_changing_any_one_key_component_changes_the_key(
    components: tuple[str, RankCoord, int, bytes], position: int, data: st.DataObject
) -> None:
    strategy = (namespaces, ranks, group_ids, block_hashes)[position]
    changed = list(components)
    changed[position] = data.draw(strategy.filter(lambda value: value != components[position]))
    assert object_key(*components) != object_key(*changed)  # type: ignore[arg-type]


@given(key_components)
def test_namespace_of_key_names_the_namespace_of_every_key(
    components: tuple[str, RankCoord, int, bytes],
) -> None:
    assert namespace_of_key(object_key(*components)) == components[0]


@given(namespaces, st.text(max_size=40) | key_components.map(lambda c: object_key(*c)),
       st.integers(0, 3))
def test_a_key_starts_with_a_namespaces_prefix_exactly_when_it_is_of_that_namespace(
    namespace: str, text: str, format_version: int
) -> None:
    """The listing (`namespace_of_key`) and the removal (keys starting with
    `namespace_key_prefix`) of every back-end agree, for keys of any format version."""
    for key in (text, text.replace(f"umbp:{FORMAT_VERSION}:", f"umbp:{format_version}:", 1),
                namespace_key_prefix(namespace) + text):
        assert (namespace_of_key(key) == namespace) == key.startswith(
            namespace_key_prefix(namespace))


@given(st.text(max_size=80))
def test_namespace_of_key_is_none_for_text_that_is_not_a_key(text: str) -> None:
    assume(isinstance(parse_key(text), Failure))
    assert namespace_of_key(text) is None or text.startswith("umbp:")


@given(st.text(max_size=80))
def test_parse_key_rejects_text_that_is_not_a_key(text: str) -> None:
    assume(not text.startswith("umbp:"))
    assert isinstance(parse_key(text), Failure)


@given(namespaces, ranks, group_ids, block_hashes)
def test_a_key_space_gives_the_same_key_every_time(
    namespace: str, rank: RankCoord, group_id: int, block_hash: bytes
) -> None:
    space = KeySpace(namespace, RankTopology())
    # Memoised prefixes must not change later answers.
    assert space.key(rank, group_id, block_hash) == space.key(rank, group_id, block_hash)
    assert space.key(rank, group_id, block_hash) == object_key(
        namespace, rank, group_id, block_hash
    )


# ------------------------------------------------------------------ topology

@st.composite
def topologies(draw: st.DrawFn) -> RankTopology:
    tp = draw(st.integers(1, 8))
    dcp = draw(st.sampled_from([d for d in range(1, tp + 1) if tp % d == 0]))
    return RankTopology(tp, draw(st.integers(1, 4)), dcp, draw(st.integers(1, 4)))


@given(topologies(), namespaces, group_ids, block_hashes)
def test_rank_keys_gives_rank_count_distinct_keys_one_per_rank_in_coords_order(
    topology: RankTopology, namespace: str, group_id: int, block_hash: bytes
) -> None:
    keys = KeySpace(namespace, topology).rank_keys(group_id, block_hash)
    assert len(keys) == topology.rank_count == len(set(keys))
    assert [parse_key(key).unwrap().rank for key in keys] == list(topology.coords())
    assert all(coord.dcp == coord.tp % topology.dcp_size for coord in topology.coords())


# ------------------------------------------------------------------ binding workers


@given(topologies(), st.data())
def test_workers_bind_exactly_when_every_rank_reported_one_namespace(
    topology: RankTopology, data: st.DataObject
) -> None:
    """Any subset of the ranks reports, under any of a few namespaces: a key space
    comes back exactly when every rank reported and all agree, and it is the
    one namespace over the whole topology; otherwise the error names the problem."""
    coords = topology.coords()
    reported = data.draw(
        st.dictionaries(st.sampled_from(coords), st.sampled_from(["ns-a", "ns-b"]))
    )
    result = bound_keyspace(topology, reported)
    agreed = set(reported.values())
    missing = [rank for rank in coords if rank not in reported]
    if len(agreed) > 1:
        assert result == Failure(
            f"umbp workers disagree on the namespace: {sorted(agreed)}"
        )
    elif missing:
        assert result == Failure(f"umbp: no worker reported for ranks {missing}")
    else:
        assert result == Success(KeySpace(agreed.pop(), topology))


def test_binding_errors_name_the_namespaces_or_the_missing_ranks() -> None:
    topology = RankTopology(2, 1, 1, 1)
    rank0, rank1 = topology.coords()
    assert bound_keyspace(topology, {rank0: "b", rank1: "a"}) == Failure(
        "umbp workers disagree on the namespace: ['a', 'b']"
    )
    # A disagreement is reported even while ranks are missing: it is the worse problem.
    three = RankTopology(3, 1, 1, 1)
    assert bound_keyspace(three, dict(zip(three.coords(), "ab"))) == Failure(
        "umbp workers disagree on the namespace: ['a', 'b']"
    )
    assert bound_keyspace(topology, {rank1: "a"}) == Failure(
        f"umbp: no worker reported for ranks {[rank0]}"
    )
    # No report at all is missing ranks, not a disagreement among nobody.
    assert bound_keyspace(topology, {}) == Failure(
        f"umbp: no worker reported for ranks {[rank0, rank1]}"
    )
    # A report from outside the topology is an error naming the rank.
    stray = RankCoord(tp=7)
    assert bound_keyspace(topology, {rank0: "a", rank1: "a", stray: "a"}) == Failure(
        f"umbp: workers reported for ranks outside the topology {topology}: {[stray]}"
    )


# ------------------------------------------------------------------ namespace


def test_every_namespace_input_field_is_covered_by_these_properties() -> None:
    assert {f.name for f in fields(NamespaceInputs)} == set(SCALAR_INPUTS) | {"groups"}


def test_data_parallel_rank_is_not_a_namespace_input() -> None:
    names = {f.name for f in fields(NamespaceInputs)}
    assert not [name for name in names if re.search(r"(^|_)dp(_|$)|data_parallel", name)]


@pytest.mark.parametrize("field_name", sorted(SCALAR_INPUTS))
@given(inputs=namespace_inputs, data=st.data())
def test_namespace_changes_when_any_scalar_input_changes(
    field_name: str, inputs: NamespaceInputs, data: st.DataObject
) -> None:
    old = getattr(inputs, field_name)
    new = data.draw(SCALAR_INPUTS[field_name].filter(lambda value: value != old))
    assert namespace_fingerprint(replace(inputs, **{field_name: new})) != namespace_fingerprint(
        inputs
    )


def _with_group(inputs: NamespaceInputs, index: int, group: CacheGroupShape) -> NamespaceInputs:
    groups = list(inputs.groups)
    groups[index] = group
    return replace(inputs, groups=tuple(groups))


@given(namespace_inputs, st.data())
def test_namespace_changes_when_any_spec_field_of_any_group_changes(
    inputs: NamespaceInputs, data: st.DataObject
) -> None:
    candidates = [(g, f) for g, group in enumerate(inputs.groups) for f in range(len(group.fields))]
    assume(candidates)
    group_index, field_index = data.draw(st.sampled_from(candidates))
    group = inputs.groups[group_index]
    name, value = group.fields[field_index]
    new_value = data.draw(spec_field_values.filter(lambda text: text != value))
    spec = list(group.fields)
    spec[field_index] = (name, new_value)
    changed = _with_group(inputs, group_index, replace(group, fields=tuple(spec)))
    assert namespace_fingerprint(changed) != namespace_fingerprint(inputs)


@given(namespace_inputs, st.data())
def test_namespace_changes_when_a_group_gains_or_loses_a_spec_field(
    inputs: NamespaceInputs, data: st.DataObject
) -> None:
    group_index = data.draw(st.integers(0, len(inputs.groups) - 1))
    group = inputs.groups[group_index]
    names = {name for name, _ in group.fields}
    if group.fields and data.draw(st.booleans()):
        drop = data.draw(st.integers(0, len(group.fields) - 1))
        spec = group.fields[:drop] + group.fields[drop + 1 :]
    else:
        name = data.draw(spec_field_names.filter(lambda name: name not in names))
        spec = group.fields + ((name, data.draw(spec_field_values)),)
    changed = _with_group(inputs, group_index, replace(group, fields=spec))
    assert namespace_fingerprint(changed) != namespace_fingerprint(inputs)


@given(namespace_inputs, st.data())
def test_namespace_changes_when_a_group_kind_changes(
    inputs: NamespaceInputs, data: st.DataObject
) -> None:
    group_index = data.draw(st.integers(0, len(inputs.groups) - 1))
    group = inputs.groups[group_index]
    kind = data.draw(group_kinds.filter(lambda kind: kind != group.kind))
    changed = _with_group(inputs, group_index, replace(group, kind=kind))
    assert namespace_fingerprint(changed) != namespace_fingerprint(inputs)


@given(namespace_inputs, st.data())
def test_namespace_changes_when_groups_are_added_removed_or_reordered(
    inputs: NamespaceInputs, data: st.DataObject
) -> None:
    groups = list(inputs.groups)
    action = data.draw(st.sampled_from(["add", "remove", "swap"]))
    if action == "add":
        groups.insert(data.draw(st.integers(0, len(groups))), data.draw(group_shapes))
    elif action == "remove":
        assume(len(groups) > 1)
        del groups[data.draw(st.integers(0, len(groups) - 1))]
    else:
        first, second = data.draw(st.lists(st.integers(0, len(groups) - 1), min_size=2, max_size=2))
        assume(groups[first] != groups[second])
        groups[first], groups[second] = groups[second], groups[first]
    changed = replace(inputs, groups=tuple(groups))
    assert namespace_fingerprint(changed) != namespace_fingerprint(inputs)


def _rebuilt(inputs: NamespaceInputs) -> NamespaceInputs:
    """An equal value sharing no objects with the original (so identity cannot leak in)."""
    copy = "".join
    return NamespaceInputs(
        model_id=copy(list(inputs.model_id)),
        revision=None if inputs.revision is None else copy(list(inputs.revision)),
        kv_dtype=copy(list(inputs.kv_dtype)),
        groups=tuple(
            CacheGroupShape(
                copy(list(g.kind)), tuple((copy(list(n)), copy(list(v))) for n, v in g.fields)
            )
            for g in inputs.groups
        ),
        block_size=int(str(inputs.block_size)),
        hash_block_size=int(str(inputs.hash_block_size)),
        tp_size=int(str(inputs.tp_size)),
        pcp_size=int(str(inputs.pcp_size)),
        dcp_size=int(str(inputs.dcp_size)),
        pp_size=int(str(inputs.pp_size)),
        weights=copy(list(inputs.weights)),
        model_settings=tuple((copy(list(n)), copy(list(v))) for n, v in inputs.model_settings),
        format_version=int(str(inputs.format_version)),
    )


@given(namespace_inputs)
def test_equal_inputs_give_the_same_namespace_so_nothing_else_such_as_dp_rank_enters(
    inputs: NamespaceInputs,
) -> None:
    rebuilt = _rebuilt(inputs)
    assert rebuilt == inputs
    assert namespace_fingerprint(rebuilt) == namespace_fingerprint(inputs)
    assert resolve_namespace(rebuilt, None) == resolve_namespace(inputs, None)


@given(namespace_inputs, st.randoms(use_true_random=False))
def test_namespace_does_not_depend_on_the_order_of_a_groups_spec_fields(
    inputs: NamespaceInputs, random: Any
) -> None:
    shuffled = []
    for group in inputs.groups:
        spec = list(group.fields)
        random.shuffle(spec)
        shuffled.append(replace(group, fields=tuple(spec)))
    assert namespace_fingerprint(replace(inputs, groups=tuple(shuffled))) == namespace_fingerprint(
        inputs
    )


@given(namespace_inputs, st.randoms(use_true_random=False))
def test_namespace_does_not_depend_on_the_order_of_the_model_settings(
    inputs: NamespaceInputs, random: Any
) -> None:
    settings = list(inputs.model_settings)
    random.shuffle(settings)
    shuffled = replace(inputs, model_settings=tuple(settings))
    assert namespace_fingerprint(shuffled) == namespace_fingerprint(inputs)


@given(namespace_inputs)
def test_namespace_fingerprint_is_sixteen_hex_digits_usable_in_keys(
    inputs: NamespaceInputs,
) -> None:
    namespace = namespace_fingerprint(inputs)
    assert re.fullmatch(r"[0-9a-f]{16}", namespace)
    assert check_namespace_override(namespace) == Success(namespace)


def test_namespace_is_the_same_in_another_process_with_another_hash_seed() -> None:
    inputs = NamespaceInputs(
        model_id="Qwen/Qwen3-0.6B",
        revision=None,
        kv_dtype="auto/bfloat16",
        groups=(
            CacheGroupShape("FullAttentionSpec", (("block_size", "16"), ("head_size", "128"))),
        ),
        block_size=16,
        hash_block_size=16,
        tp_size=2,
        pcp_size=1,
        dcp_size=1,
        pp_size=1,
    )
    program = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from umbp.core.identity import *;"
        "print(namespace_fingerprint(NamespaceInputs('Qwen/Qwen3-0.6B', None, 'auto/bfloat16',"
        " (CacheGroupShape('FullAttentionSpec', (('head_size', '128'), ('block_size', '16'))),),"
        " 16, 16, 2, 1, 1, 1)))"
    )
    output = subprocess.run(
        [sys.executable, "-I", "-c", program, str(REPO)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "4242"},
    ).stdout.strip()
    assert output == namespace_fingerprint(inputs)


@given(namespace_inputs, namespaces)
def test_resolve_namespace_prefers_a_valid_override(inputs: NamespaceInputs, override: str) -> None:
    assert resolve_namespace(inputs, override) == Success(override)
    assert resolve_namespace(inputs, None) == Success(namespace_fingerprint(inputs))


@given(namespace_inputs, st.text(max_size=140))
def test_resolve_namespace_rejects_overrides_that_could_break_key_parsing(
    inputs: NamespaceInputs, override: str
) -> None:
    assume(not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", override))
    assert isinstance(resolve_namespace(inputs, override), Failure)
    assert isinstance(check_namespace_override(override), Failure)
