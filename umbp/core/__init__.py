"""umbp.core: the pure functional core, and the API a serving stack builds on.

Only the standard library, ``pyrsistent`` and ``returns``: no vLLM, torch or
numpy, no I/O, clocks, threads or logging. Every decision about keys, hit
windows, plans, events and configuration is a deterministic function of values;
the stack's shell feeds it snapshots of its engine, performs the one I/O between
two calls (asking the store) and carries out the answers.

The names below are the public API (docs/design.md, "The core's public API", says
what each is for); everything else is reachable in its module
(``umbp.core.stores.request_store``...) for tests and benchmarks, and may change.

* identity and keys: who an object is, on which rank, under which namespace;
* geometry and plans: the cache's shape, and the grouped values a scheduler
  hands its workers (per cache group: block size, block ids, hashes);
* lookup (:mod:`umbp.core.lookup`): an admission, in two calls around the store's
  answer;
* requests: one request's state and the rules of allocation, preemption, reset;
* stores (:mod:`umbp.core.stores`): a scheduler step's stores, in two calls around
  the residency lookup; store events and their acknowledgements;
* loads (:mod:`umbp.core.loads`): what a worker's reads mean, and how the engine
  is told of failures;
* KV events: which BlockStored / BlockRemoved to publish;
* configuration, and page-addressed stacks (SGLang's HiCache).
"""

from __future__ import annotations

from umbp.core.config import ConfigError, ConnectorConfig, parse_connector_config
from umbp.core.geometry import NULL_BLOCK_ID, BlockTable, CacheGeometry, block_table_of
from umbp.core.identity import (
    CacheGroupShape,
    KeySpace,
    NamespaceInputs,
    ObjectId,
    RankCoord,
    RankTopology,
    bound_keyspace,
    resolve_namespace,
)
from umbp.core.kv_events import (
    EventTracker,
    KvEvent,
    apply_residency,
    new_event_tracker,
    residency_batch,
    stored_objects,
    track_stored,
)
from umbp.core.loads.failures import SyncLoads, after_failed_load, stores_over_sync_loads
from umbp.core.loads.outcomes import (
    LoadReport,
    LoadStatus,
    RequestLoadOutcome,
    failure_reporting,
    plan_load_outcome,
    report_load,
)
from umbp.core.lookup import (
    AdmissionAnswer,
    AdmissionStep,
    LookupAction,
    LookupRules,
    RunningLookup,
    admission_answer,
    admission_step,
)
from umbp.core.lookup.query import LookupMemo, LookupQuery
from umbp.core.lookup.windows import LoadSpec
from umbp.core.page_identity import (
    PageShape,
    leading_hit_count,
    page_keys,
    page_namespace,
    pages_to_write,
)
from umbp.core.plans import GroupBlocks, LoadPlan, StoredBlockFacts, StorePlan
from umbp.core.requests import (
    RequestLifecycle,
    RequestView,
    after_allocation,
    after_cache_reset,
    after_preemption,
    take_step_loads,
)
from umbp.core.stack_config import parse_stack_store_config
from umbp.core.stores import (
    ScheduledStep,
    StoreDraft,
    StorePass,
    StoreRules,
    StoreStepReads,
    finish_store_step,
    plan_store_step,
)
from umbp.core.stores.acks import (
    StoreEvent,
    StoreEventResult,
    acknowledge_reports,
    pinned_block_ids,
    reserved_identities,
)

__all__ = [
    "NULL_BLOCK_ID",
    "AdmissionAnswer",
    "AdmissionStep",
    "BlockTable",
    "CacheGeometry",
    "CacheGroupShape",
    "ConfigError",
    "ConnectorConfig",
    "EventTracker",
    "GroupBlocks",
    "KeySpace",
    "KvEvent",
    "LoadPlan",
    "LoadReport",
    "LoadSpec",
    "LoadStatus",
    "LookupAction",
    "LookupMemo",
    "LookupQuery",
    "LookupRules",
    "NamespaceInputs",
    "ObjectId",
    "PageShape",
    "RankCoord",
    "RankTopology",
    "RequestLifecycle",
    "RequestLoadOutcome",
    "RequestView",
    "RunningLookup",
    "ScheduledStep",
    "StoreDraft",
    "StoreEvent",
    "StoreEventResult",
    "StorePass",
    "StorePlan",
    "StoreRules",
    "StoreStepReads",
    "StoredBlockFacts",
    "SyncLoads",
    "acknowledge_reports",
    "admission_answer",
    "admission_step",
    "after_allocation",
    "after_cache_reset",
    "after_failed_load",
    "after_preemption",
    "apply_residency",
    "block_table_of",
    "bound_keyspace",
    "failure_reporting",
    "finish_store_step",
    "leading_hit_count",
    "new_event_tracker",
    "page_keys",
    "page_namespace",
    "pages_to_write",
    "parse_connector_config",
    "parse_stack_store_config",
    "pinned_block_ids",
    "plan_load_outcome",
    "plan_store_step",
    "report_load",
    "reserved_identities",
    "residency_batch",
    "resolve_namespace",
    "stored_objects",
    "stores_over_sync_loads",
    "take_step_loads",
    "track_stored",
]
