"""The store rules of the scheduler role, in the order a step applies them.

A step's stores are two calls around one residency lookup: :func:`plan_store_step`,
then the pool's answer to its check, then :func:`finish_store_step`. In order:

1. **Who stores.** A consumer (``kv_role="kv_consumer"``) stores nothing; a request
   stores while it is in its prompt, or always with ``save_decode_cache``
   (``tracking.stores_under_role``, ``tracking.stores_this_step``). Requests past
   their prompt are not visited at all (the caller's ``storing`` set).
2. **What became full.** Each request keeps a hash-aligned save watermark (a group
   with smaller blocks must not wait for the largest group's block) that only
   grows; the candidates are each group's blocks full, and hashed, since it
   (speculative tokens have no hash yet), up to the prompt without
   ``save_decode_cache`` (``tracking``, ``windows``). A new request's table is the
   one vLLM allocated; a request scheduled before reads vLLM's current table
   (tables are not append-only). A resumed request starts over.
3. **Where cache semantics allow.** vLLM's reachability masks keep only blocks a
   later request can reuse (sliding windows, Mamba); the watermark passed the
   masked-out blocks, so they are never retried; a malformed mask stores nothing
   that step (``request_store.apply_store_masks``). Mamba "align" groups are stored only
   from the boundary states vLLM hands off (``handoffs``); EAGLE's groups drop
   their last block through their masks.
4. **Not twice.** Blocks the request did not compute (vLLM's prefix-cache hits,
   umbp's restored window) are checked in one batched residency lookup for the
   whole step, and skipped when every rank holds them (``residency``); an
   identity an in-flight store event writes is skipped (``reservations``); an
   identity is planned once per step, by the first request that selects it; null
   blocks and blocks past the hashes never are (``request_store.store_plan``).
5. **Pinned until acknowledged.** The step's plans, with finished requests' partial
   tails (``handoffs.finished_partial_tail_plans``), become one store event whose
   source blocks stay pinned in vLLM's block pool until every worker reported it
   (``acks``).
6. **On the worker.** A request computing over a failed synchronous load stores
   nothing that step; objects a store did not write are not announced
   (``results``).
"""

from umbp.core.stores.step import (
    ScheduledStep,
    StoreDraft,
    StorePass,
    StoreRules,
    StoreStepReads,
    finish_store_step,
    plan_store_step,
)

__all__ = [
    "ScheduledStep",
    "StoreDraft",
    "StorePass",
    "StoreRules",
    "StoreStepReads",
    "finish_store_step",
    "plan_store_step",
]
