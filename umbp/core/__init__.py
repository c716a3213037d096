"""umbp.core: the pure functional core.

Only the standard library, ``pyrsistent`` and ``returns``: no vLLM, torch or
numpy, no I/O, clocks, threads or logging. Every decision the connector makes
about keys, hit windows, plans, events and configuration is a deterministic
function here; ``umbp.shell`` feeds it snapshots and carries out its answers.

Every public name of every core module is re-exported here; the modules are
importable as attributes too (``umbp.core.events``).
"""

from __future__ import annotations

from umbp.core import (
    config,
    events,
    failed_loads,
    identity,
    key_memo,
    load_outcomes,
    load_plans,
    lookup,
    lookup_geometry,
    page_identity,
    rank_keys,
    request_lifecycle,
    residency,
    stack_config,
    store_events,
    store_pass,
    store_plans,
    store_reservations,
    store_tracking,
    store_windows,
    support,
    transfer_plans,
    value_checks,
)
from umbp.core.config import *
from umbp.core.events import *
from umbp.core.failed_loads import *
from umbp.core.identity import *
from umbp.core.key_memo import *
from umbp.core.load_outcomes import *
from umbp.core.load_plans import *
from umbp.core.lookup import *
from umbp.core.lookup_geometry import *
from umbp.core.page_identity import *
from umbp.core.rank_keys import *
from umbp.core.request_lifecycle import *
from umbp.core.residency import *
from umbp.core.stack_config import *
from umbp.core.store_events import *
from umbp.core.store_pass import *
from umbp.core.store_plans import *
from umbp.core.store_reservations import *
from umbp.core.store_tracking import *
from umbp.core.store_windows import *
from umbp.core.support import *
from umbp.core.transfer_plans import *
from umbp.core.value_checks import *

__all__ = [
    "config",
    "events",
    "failed_loads",
    "identity",
    "key_memo",
    "load_outcomes",
    "load_plans",
    "lookup",
    "lookup_geometry",
    "page_identity",
    "rank_keys",
    "request_lifecycle",
    "residency",
    "stack_config",
    "store_events",
    "store_pass",
    "store_plans",
    "store_reservations",
    "store_tracking",
    "store_windows",
    "support",
    "transfer_plans",
    "value_checks",
]
__all__ += config.__all__
__all__ += events.__all__
__all__ += failed_loads.__all__
__all__ += identity.__all__
__all__ += key_memo.__all__
__all__ += load_outcomes.__all__
__all__ += load_plans.__all__
__all__ += lookup.__all__
__all__ += lookup_geometry.__all__
__all__ += page_identity.__all__
__all__ += rank_keys.__all__
__all__ += request_lifecycle.__all__
__all__ += residency.__all__
__all__ += stack_config.__all__
__all__ += store_events.__all__
__all__ += store_pass.__all__
__all__ += store_plans.__all__
__all__ += store_reservations.__all__
__all__ += store_tracking.__all__
__all__ += store_windows.__all__
__all__ += support.__all__
__all__ += transfer_plans.__all__
__all__ += value_checks.__all__
