"""Object identity: the namespace fingerprint, rank topology and object keys.

A stored object is one KV block of one cache group on one rank. Its key must
change whenever anything that shapes its bytes changes (model, dtype, cache
layout, block sizes, parallel layout, format) and must be identical across
processes, restarts and data-parallel replicas, so that any engine serving the
same bytes finds it. Key format::

    umbp:<format>:<namespace>:tp<r>:pcp<r>:dcp<r>:pp<r>:g<group>:<block-hash hex>

A group whose bytes a run of TP ranks holds alike (MLA's latent cache,
:mod:`umbp.core.replicas`) is one object per run in a store every rank reads: each
rank of the run keys it with the run's first rank's coordinates
(:meth:`KeySpace.key_rank`), so the run's keys are one key.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, TypeAlias

from returns.result import Failure, Result, Success

__all__ = [
    "FORMAT_VERSION",
    "KEY_HEAD",
    "KEY_PREFIX",
    "RESERVED_NAMESPACE_PREFIXES",
    "CacheGroupShape",
    "KeySpace",
    "NamespaceInputs",
    "ObjectId",
    "RankCoord",
    "RankTopology",
    "ReplicatedGroups",
    "bound_keyspace",
    "check_namespace_override",
    "key_prefix",
    "namespace_fingerprint",
    "namespace_key_prefix",
    "namespace_of_key",
    "rank_coord",
    "replica_writer",
    "resolve_namespace",
]

ObjectId: TypeAlias = tuple[int, bytes]
"""One stored object, on any rank: ``(group_id, block_hash)``; each rank's key of
it is :meth:`KeySpace.key`. KV events name objects by it too."""

FORMAT_VERSION: Final = 1
KEY_PREFIX: Final = "umbp"
KEY_HEAD: Final = f"{KEY_PREFIX}:{FORMAT_VERSION}:"
"""What every key umbp writes starts with: a string that does not is no namespace's."""
_NAMESPACE_OVERRIDE = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Namespaces of other serving stacks (core.page_identity) start with these; an explicit
# namespace may not, so no stack's keys can ever name another stack's bytes.
RESERVED_NAMESPACE_PREFIXES: Final = ("sglang.",)


@dataclass(frozen=True, slots=True)
class CacheGroupShape:
    """Every field of one cache group's spec, as (name, canonical text) pairs."""

    kind: str
    fields: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class NamespaceInputs:
    """Everything that shapes the stored bytes. The DP rank is deliberately absent:
    data-parallel replicas hold identical KV and must share objects.

    ``weights`` names the weights actually loaded (a content digest of local weight
    files, a hub model's resolved commit: computed by the shell, which does the I/O),
    so that new weights at the same path or revision name never meet the old ones'
    KV. ``model_settings`` are the engine's settings that change what the same
    weights compute (online quantization, config overrides), as (name, canonical
    text) pairs."""

    model_id: str
    revision: str | None
    kv_dtype: str
    groups: tuple[CacheGroupShape, ...]
    block_size: int
    hash_block_size: int
    tp_size: int
    pcp_size: int
    dcp_size: int
    pp_size: int
    weights: str = ""
    model_settings: tuple[tuple[str, str], ...] = ()
    format_version: int = FORMAT_VERSION


def namespace_fingerprint(inputs: NamespaceInputs) -> str:
    """16 hex digits of a SHA-256 over a canonical, unambiguous encoding."""
    parts = [
        f"format={inputs.format_version}",
        f"model={inputs.model_id!r}",
        f"revision={inputs.revision!r}",
        f"kv_dtype={inputs.kv_dtype!r}",
        f"block_size={inputs.block_size}",
        f"hash_block_size={inputs.hash_block_size}",
        f"tp={inputs.tp_size}",
        f"pcp={inputs.pcp_size}",
        f"dcp={inputs.dcp_size}",
        f"pp={inputs.pp_size}",
        f"weights={inputs.weights!r}",
    ]
    parts.extend(f"setting {name!r}={value!r}" for name, value in sorted(inputs.model_settings))
    for index, group in enumerate(inputs.groups):
        fields = ",".join(f"{name!r}={value!r}" for name, value in sorted(group.fields))
        parts.append(f"group{index}={group.kind!r}[{fields}]")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def namespace_key_prefix(namespace: str) -> str:
    """What every key of `namespace` starts with (``umbp:<format>:<namespace>:``), and
    nothing else's: the one spelling of a namespace's keys that every back-end's listing
    and removal use (:func:`namespace_of_key` is its inverse)."""
    return f"{KEY_HEAD}{namespace}:"


def namespace_of_key(key: str) -> str | None:
    """The namespace whose :func:`namespace_key_prefix` `key` starts with; None for any
    other string (a store may hold keys that are not umbp's, or of another format)."""
    if not key.startswith(KEY_HEAD):
        return None
    start = len(KEY_HEAD)
    end = key.find(":", start)
    return key[start:end] if end > start else None


def resolve_namespace(inputs: NamespaceInputs, override: str | None) -> Result[str, str]:
    """The user's explicit namespace if given (validated), else the fingerprint."""
    if override is None:
        return Success(namespace_fingerprint(inputs))
    return check_namespace_override(override)


def check_namespace_override(override: str) -> Result[str, str]:
    """The rule an explicit namespace must follow (used by config validation too)."""
    if not _NAMESPACE_OVERRIDE.fullmatch(override):
        return Failure(
            f"namespace {override!r} must be 1-128 characters of letters, digits, '.', '_' or '-'"
        )
    if override.startswith(RESERVED_NAMESPACE_PREFIXES):
        return Failure(
            f"namespace {override!r} must not start with "
            f"{' or '.join(map(repr, RESERVED_NAMESPACE_PREFIXES))}: reserved for another "
            "serving stack's keys"
        )
    return Success(override)


@dataclass(frozen=True, slots=True, order=True)
class RankCoord:
    """Where one shard of a block lives. ``dcp`` is derived from ``tp``."""

    tp: int = 0
    pcp: int = 0
    dcp: int = 0
    pp: int = 0


@dataclass(frozen=True, slots=True)
class RankTopology:
    """The parallel layout whose ranks each hold their own shard of a block. Its
    sizes are vLLM's, which its ParallelConfig checks (each >= 1, dcp divides tp)."""

    tp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1

    @property
    def rank_count(self) -> int:
        return self.tp_size * self.pcp_size * self.pp_size

    def coords(self) -> tuple[RankCoord, ...]:
        """Every rank in canonical order (pp, pcp, tp major to minor)."""
        return tuple(
            rank_coord(self, tp, pcp, pp)
            for pp in range(self.pp_size)
            for pcp in range(self.pcp_size)
            for tp in range(self.tp_size)
        )


def rank_coord(topology: RankTopology, tp_rank: int, pcp_rank: int, pp_rank: int) -> RankCoord:
    """A worker's coordinates; its DCP rank is its position inside its TP group's DCP split."""
    return RankCoord(tp_rank, pcp_rank, tp_rank % topology.dcp_size, pp_rank)


def replica_writer(topology: RankTopology, rank: RankCoord, run: int) -> RankCoord:
    """The rank that writes what ``rank`` holds alike with the other TP ranks of its run
    of ``run`` consecutive TP ranks: the run's first (``run`` 1: the rank itself)."""
    if run == 1:
        return rank
    return rank_coord(topology, rank.tp - rank.tp % run, rank.pcp, rank.pp)


def key_prefix(namespace: str, rank: RankCoord, group_id: int) -> str:
    return (
        f"{namespace_key_prefix(namespace)}tp{rank.tp}:pcp{rank.pcp}"
        f":dcp{rank.dcp}:pp{rank.pp}:g{group_id}:"
    )


ReplicatedGroups: TypeAlias = tuple[tuple[int, int], ...]
"""``(group id, run)`` pairs, by group id: runs of ``run`` consecutive TP ranks hold
the group's bytes alike and share one object (:mod:`umbp.core.replicas`)."""


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Builds keys for one namespace and topology. Prefix strings are precomputed
    because key construction sits on the lookup hot path (thousands per step).

    ``replicated`` names the groups whose objects a run of TP ranks shares: every rank
    of a run keys them as the run's first rank does (:meth:`key_rank`), which alone
    writes them (:meth:`writes`). Every other group has an object per rank."""

    namespace: str
    topology: RankTopology
    replicated: ReplicatedGroups = ()
    _prefixes: dict[tuple[RankCoord, int], str] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        group_ids = [group_id for group_id, _ in self.replicated]
        if group_ids != sorted(set(group_ids)):
            raise ValueError(f"replicated groups must be named once each, in order: "
                             f"{self.replicated}")
        for group_id, run in self.replicated:
            if run < 2 or self.topology.tp_size % run:
                raise ValueError(
                    f"group {group_id}: a run of {run} TP ranks does not divide tp "
                    f"{self.topology.tp_size} into runs of two or more"
                )

    def replica_run(self, group_id: int) -> int:
        """How many consecutive TP ranks share each of the group's objects (1: none)."""
        for replicated, run in self.replicated:
            if replicated == group_id:
                return run
        return 1

    def key_rank(self, rank: RankCoord, group_id: int) -> RankCoord:
        """The coordinates in ``rank``'s keys of the group's objects: the writer's."""
        return replica_writer(self.topology, rank, self.replica_run(group_id))

    def writes(self, rank: RankCoord, group_id: int) -> bool:
        """Whether ``rank`` writes the group's objects (every rank of a group that is
        not replicated; the run's first rank of one that is)."""
        return self.key_rank(rank, group_id) == rank

    def key(self, rank: RankCoord, group_id: int, block_hash: bytes) -> str:
        return self._prefix(rank, group_id) + block_hash.hex()

    def rank_keys(self, group_id: int, block_hash: bytes) -> tuple[str, ...]:
        """One key per rank, in ``topology.coords()`` order (the ranks of a replica
        run have the one key of its writer)."""
        digest = block_hash.hex()
        return tuple(
            self._prefix(rank, group_id) + digest for rank in self.topology.coords()
        )

    def _prefix(self, rank: RankCoord, group_id: int) -> str:
        # A memo of pure values; mutation is invisible from outside.
        prefix = self._prefixes.get((rank, group_id))
        if prefix is None:
            prefix = key_prefix(self.namespace, self.key_rank(rank, group_id), group_id)
            self._prefixes[(rank, group_id)] = prefix
        return prefix


def bound_keyspace(
    topology: RankTopology,
    reported: Mapping[RankCoord, str],
    replicated: Mapping[RankCoord, ReplicatedGroups] | None = None,
) -> Result[KeySpace, str]:
    """The key space the scheduler looks up in, once the workers have reported.

    ``reported`` maps each reporting worker's rank to the namespace it stores
    under, ``replicated`` to the groups it keys as a replica run's (none if not
    given). Every reporter must agree on one namespace and on those groups (keys
    under two namespaces could never be found together, nor a writer's object by a
    rank that expects its own) and every rank of ``topology`` must have reported (a
    block is resident only when every rank holds its shard). A report from a rank
    outside ``topology`` is an error too: that worker stores keys no lookup asks
    for. No report at all is the missing-ranks error, not a disagreement.
    """
    namespaces = sorted(set(reported.values()))
    if len(namespaces) > 1:
        return Failure(f"umbp workers disagree on the namespace: {namespaces}")
    schemes = sorted(set((replicated or {}).values()))
    if len(schemes) > 1:
        return Failure(
            f"umbp workers disagree on which cache groups their TP ranks share: {schemes}"
        )
    ranks = set(topology.coords())
    strays = [rank for rank in reported if rank not in ranks]
    if strays:
        return Failure(f"umbp: workers reported for ranks outside the topology {topology}: {strays}")
    missing = [rank for rank in topology.coords() if rank not in reported]
    if missing:
        return Failure(f"umbp: no worker reported for ranks {missing}")
    return Success(KeySpace(namespaces[0], topology, schemes[0] if schemes else ()))
