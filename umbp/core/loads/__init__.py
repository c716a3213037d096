"""The load rules, from vLLM's allocation to what its forward pass may read.

1. **Plan what vLLM allocated** (``allocation.plan_allocated_load``): vLLM may allocate
   fewer tokens than umbp matched (bounded replay); the plan covers what it
   allocated, as whole blocks the lookup found. A count above the match, a lowered
   window ending inside a block, a lowered multi-group hit, or a null or repeated
   destination cannot be planned: those blocks are reported failed and recomputed.
2. **Read, verify, scatter** (``outcomes``): each group's objects are read into
   staging and verified; only intact rows reach the KV cache; every planned block
   ends loaded or failed, never both, never outside the plan.
3. **Tell vLLM** (``outcomes.failure_reporting``): block ids for one cache group
   (vLLM recomputes from the first failed block), request ids otherwise (only for
   asynchronous loads, which a several-group model always uses).
4. **Never store over a failed load** (``failures``): requests computing over a
   failed synchronous load, and those reading blocks it filled, store nothing until
   the scheduler settles them; their watermarks rewind to where vLLM recomputes.
"""

from umbp.core.loads.allocation import UnplannedLoad, plan_allocated_load

__all__ = ["UnplannedLoad", "plan_allocated_load"]
