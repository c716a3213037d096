"""The shapes of the vLLM objects umbp reads, as small Protocols.

Only the attributes umbp reads are declared, so the shell is checked by
``mypy --strict`` without importing vLLM's own types. What is read from these
objects and from vLLM's configs is in :mod:`umbp.shell.vllm_compat`; what
differs between supported vLLM versions in :mod:`umbp.shell.vllm_compat.versions`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Literal, Protocol


class RequestLike(Protocol):
    """The attributes of vLLM's ``Request`` the scheduler role reads."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_in_flight_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def shared_prefix_boundary(self) -> int: ...

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None: ...


class NewRequestDataLike(Protocol):
    """``NewRequestData``: a request scheduled for the first time this step."""

    @property
    def req_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[Sequence[int]]: ...


class CachedRequestDataLike(Protocol):
    """``CachedRequestData``: requests scheduled before, in parallel lists."""

    @property
    def req_ids(self) -> Sequence[str]: ...

    @property
    def resumed_req_ids(self) -> AbstractSet[str]: ...

    @property
    def num_computed_tokens(self) -> Sequence[int]: ...


class BlockStateLike(Protocol):
    """``KVConnectorBlockState``: current tables that are not append-only, and the
    Mamba "align" boundary states handed off this step."""

    @property
    def boundary_state_offloads(self) -> Mapping[str, Sequence[tuple[int, int, int]]]: ...

    def get_block_ids(self, req_id: str) -> Sequence[Sequence[int]] | None: ...


class SchedulerOutputLike(Protocol):
    """``SchedulerOutput``: what one step scheduled."""

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequestDataLike]: ...

    @property
    def scheduled_cached_reqs(self) -> CachedRequestDataLike: ...

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...

    @property
    def finished_req_ids(self) -> AbstractSet[str]: ...

    @property
    def preempted_req_ids(self) -> AbstractSet[str] | None: ...

    @property
    def kv_connector_block_state(self) -> BlockStateLike | None: ...


class KVCacheBlocksLike(Protocol):
    """``KVCacheBlocks``: the blocks vLLM allocated to a request."""

    def get_block_ids(
        self, allow_none: Literal[False] = False, *, group_ids: Sequence[int] | None = None
    ) -> Sequence[Sequence[int]]: ...


class BlockLike(Protocol):
    @property
    def block_id(self) -> int: ...


class BlockPoolLike(Protocol):
    """vLLM's GPU ``BlockPool``: pins (``touch`` / ``free_blocks``) and its cache."""

    @property
    def blocks(self) -> Sequence[Any]: ...

    @property
    def null_block(self) -> BlockLike: ...

    def touch(self, blocks: Sequence[Any]) -> None: ...

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None: ...

    def get_cached_block(self, block_hash: Any, kv_cache_group_ids: list[int]) -> Any: ...


class ConnectorOutputLike(Protocol):
    """``KVConnectorOutput``: what the workers reported this step. vLLM's scheduler
    acts on the failed loads (cuts the requests' computed tokens) before it hands
    the output to the connector; both fields exist in 0.32 and 0.33."""

    @property
    def kv_connector_worker_meta(self) -> object | None: ...

    @property
    def invalid_block_ids(self) -> set[int]: ...

    @property
    def failed_recving(self) -> set[str]: ...
