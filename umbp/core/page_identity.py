"""ObjectId, hit counting and load plans for stacks that address KV by page hash.

SGLang's HiCache names each page of a prefix by a hex digest chained over the page's
token ids; nothing about the model, dtype, layout or rank is in it. umbp keys such a
page with the same :class:`KeySpace` as vLLM's blocks (one page = one object, group 0),
under a namespace that is the fingerprint of everything that shapes the page's bytes,
prefixed by a stack tag. vLLM's namespaces never carry that prefix (a fingerprint is
hex, an explicit vLLM namespace may not start with a reserved stack tag), so one stack's
bytes can never be loaded into the other's KV cache, even in one shared store.

What was vLLM-shaped in core and why this module exists beside it: ``NamespaceInputs``
wants vLLM cache-group specs and hash block sizes, and the lookup functions count hits
in tokens over block/hash-unit geometry with EAGLE and "leave the last token" rules,
all vLLM scheduler concerns. A page stack asks a simpler question (how many leading
pages of these does this rank hold?), so its shape maps onto ``NamespaceInputs`` here
and its hit count is a leading run.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from returns.result import Failure, Result, Success

from umbp.core.identity import (
    RESERVED_NAMESPACE_PREFIXES,
    CacheGroupShape,
    KeySpace,
    NamespaceInputs,
    RankCoord,
    RankTopology,
    check_namespace_override,
    namespace_fingerprint,
)

__all__ = [
    "SGLANG_STACK",
    "STACK_NAMESPACE_PREFIXES",
    "PageRank",
    "PageShape",
    "leading_hit_count",
    "page_key_space",
    "page_keys",
    "page_namespace",
    "page_namespace_inputs",
    "pages_to_write",
]

SGLANG_STACK: Final = "sglang"
# Namespaces of page stacks start with "<stack>."; identity's override rule refuses
# these prefixes for vLLM, which is what keeps the two stacks' keys disjoint.
STACK_NAMESPACE_PREFIXES: Final = RESERVED_NAMESPACE_PREFIXES
_PAGE_HASH: Final = re.compile(r"(?:[0-9a-f]{2})+")


@dataclass(frozen=True, slots=True)
class PageShape:
    """Everything that shapes the bytes of one stored page, as the stack's host pool
    and storage config report it. ``pool_kind`` is the host pool's class (MHA, MLA,
    K-only...), ``layout`` its memory layout (``page_first_direct``...): both change
    where each value sits in the page's flat bytes. ``weights`` and ``model_settings``
    name the weights loaded and the settings that change what they compute, as in
    :class:`~umbp.core.identity.NamespaceInputs`."""

    stack: str
    model_name: str
    kv_dtype: str
    pool_kind: str
    layout: str
    page_size: int
    layer_num: int
    head_num: int
    head_dim: int
    v_head_dim: int
    page_bytes: int
    is_mla: bool
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    dcp_size: int = 1
    weights: str = ""
    model_settings: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class PageRank:
    """This process's place in the parallel layout. The DP rank is absent: replicas
    hold identical pages and share them."""

    tp: int = 0
    pp: int = 0
    cp: int = 0
    dcp: int = 0


def page_namespace_inputs(shape: PageShape) -> NamespaceInputs:
    """The shape as core's namespace inputs: one cache group whose kind names the
    stack and pool, whose fields are every shape field; block = hash block = page."""
    fields = (
        ("stack", shape.stack),
        ("pool_kind", shape.pool_kind),
        ("layout", shape.layout),
        ("layer_num", str(shape.layer_num)),
        ("head_num", str(shape.head_num)),
        ("head_dim", str(shape.head_dim)),
        ("v_head_dim", str(shape.v_head_dim)),
        ("page_bytes", str(shape.page_bytes)),
        ("is_mla", str(shape.is_mla)),
    )
    return NamespaceInputs(
        model_id=shape.model_name,
        revision=None,
        kv_dtype=shape.kv_dtype,
        groups=(CacheGroupShape(kind=f"{shape.stack}:{shape.pool_kind}", fields=fields),),
        block_size=shape.page_size,
        hash_block_size=shape.page_size,
        tp_size=shape.tp_size,
        pcp_size=shape.cp_size,
        dcp_size=shape.dcp_size,
        pp_size=shape.pp_size,
        weights=shape.weights,
        model_settings=shape.model_settings,
    )


def page_namespace(shape: PageShape, override: str | None) -> Result[str, str]:
    """``<stack>.<fingerprint>``, or ``<stack>.<override>`` for an explicit namespace
    (validated by identity's rule). The stack tag is there either way."""
    if f"{shape.stack}." not in STACK_NAMESPACE_PREFIXES:
        return Failure(f"unknown page stack {shape.stack!r}")
    if override is None:
        return Success(f"{shape.stack}.{namespace_fingerprint(page_namespace_inputs(shape))}")
    return check_namespace_override(override).map(lambda name: f"{shape.stack}.{name}")


def page_key_space(namespace: str, shape: PageShape) -> KeySpace:
    return KeySpace(namespace, RankTopology(shape.tp_size, shape.cp_size, shape.dcp_size,
                                            shape.pp_size))


def page_keys(
    space: KeySpace, rank: PageRank, shape: PageShape, page_hashes: Sequence[str]
) -> tuple[str, ...] | None:
    """This rank's key of each page, or None if a page hash is not lower-case hex.

    Rank-replicated pools (MLA) hold the same bytes on every TP rank of a DCP shard
    and SGLang writes them from one rank only, so their keys carry the shard's writer
    (TP rank = DCP rank), and every replica asks for the writer's objects.
    """
    tp = rank.dcp if shape.is_mla else rank.tp
    coord = RankCoord(tp=tp, pcp=rank.cp, dcp=rank.dcp, pp=rank.pp)
    keys: list[str] = []
    for page_hash in page_hashes:
        if not isinstance(page_hash, str) or _PAGE_HASH.fullmatch(page_hash) is None:
            return None
        keys.append(space.key(coord, 0, bytes.fromhex(page_hash)))
    return tuple(keys)


def leading_hit_count(answers: Sequence[bool]) -> int:
    """Pages hit before the first miss. Page hashes are chained, and SGLang can use a
    page only after every earlier one, so a hit past a miss counts for nothing."""
    for index, answer in enumerate(answers):
        if not answer:
            return index
    return len(answers)


def pages_to_write(loaded: Sequence[bool]) -> range:
    """Which fetched pages go into the host pool: the leading run that loaded intact.
    A page after a failed one is never written (SGLang would not use it), and no page
    outside the request is (the range lies inside ``range(len(loaded))``)."""
    return range(leading_hit_count(loaded))
