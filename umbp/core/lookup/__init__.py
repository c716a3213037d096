"""The lookup rules of the scheduler role, in the order an admission applies them.

An admission is two calls around the pool's answer: :func:`admission_step`, then
the store's answer to its query, then :func:`admission_answer`. In order:

1. **Still the same question.** A lookup running on the lookup threads answers only
   for the very request object (an id can be reused) in the state it was asked for
   (local tokens, length, hashes); a stale one is dropped first
   (``admission.lookup_still_current``).
2. **Whether to look up at all** (``guards.lookup_skip_reason``, the reference's
   order): lookups enabled; the request has block hashes; it is at least one
   lookup alignment long; vLLM's local hit ends on a block boundary; some group is
   prefix-cacheable; a token besides the last is left to load. Any skip answers 0
   and forgets an earlier window.
3. **Wait, read or ask.** A running lookup is waited for, an answered one read;
   otherwise the pool is asked, on the lookup threads with ``lookup_async``.
4. **What to ask** (``query``): every object past the local tokens, probed every
   lookup unit (a group's block, or every hash with partial hits), up to the last
   token worth probing (``guards.lookup_limit``: never the last token, except that
   EAGLE's coordinator sees the block ending at the prompt's end; never past the
   hashes), on every rank. A store that answers by hash is asked prefixes and raw
   hashes; any other gets key strings, built once per request (``key_memo``).
5. **The hit window** (``windows``): an object hits only when every rank holds it;
   whole blocks count while they hit contiguously (hashes are chained), a partial
   tail is found from the first missing block's end; EAGLE drops one block; the
   window never reaches the last prompt token. Several groups, or one that is not
   plain full attention, are decided by vLLM's own coordinator from the hit sets.
6. **How it loads.** A window naming no pool object past the local blocks loads
   synchronously; otherwise as configured (``effective_load_async``). vLLM then
   allocates, and :mod:`umbp.core.loads` plans the load.
"""

from umbp.core.lookup.admission import (
    AdmissionAnswer,
    AdmissionStep,
    LookupAction,
    LookupRules,
    RunningLookup,
    admission_answer,
    admission_step,
)

__all__ = [
    "AdmissionAnswer",
    "AdmissionStep",
    "LookupAction",
    "LookupRules",
    "RunningLookup",
    "admission_answer",
    "admission_step",
]
