"""What an operator can see and do per namespace on Mooncake Store, through what its
API allows (docs/operations.md says where it stops).

* `umbp ls --mooncake-http HOST:PORT`: the master's HTTP endpoint (its `-metrics_port`)
  lists every key (`GET /get_all_keys`); umbp's keys name their namespace, so objects
  are counted per namespace. Bytes, hits and last use per namespace are not there: the
  master reports them for the whole cluster only (its `/metrics`).
* `umbp clear --mooncake-master HOST:PORT`: `remove_by_regex` over a namespace's key
  prefix (`remove_all` for every namespace), not forced, so objects under a lease (read
  in the last seconds) are left, as `umbp serve` leaves objects in use.
* Retention, quotas, labels: Mooncake soft-pins an object only when it is put (with a
  TTL the writer must know then) and keeps tenant quotas per client, not per key prefix:
  nothing umbp could ask of it afterwards.
"""

from __future__ import annotations

import re
import urllib.request

from umbp.core.identity import namespace_key_prefix, namespace_of_key

__all__ = ["mooncake_namespaces", "namespace_key_pattern"]


def namespace_key_pattern(namespace: str) -> str:
    """The regular expression of every key of `namespace` (Mooncake's `remove_by_regex`)."""
    return f"^{re.escape(namespace_key_prefix(namespace))}"


def mooncake_namespaces(http_address: str, timeout_s: float) -> dict[str, int]:
    """Objects per namespace ("" for keys not umbp's) as the master at `http_address`
    (HOST:PORT of its HTTP endpoint) lists them. Raises OSError when it cannot be read."""
    with urllib.request.urlopen(f"http://{http_address}/get_all_keys",
                                timeout=timeout_s) as answer:
        text = answer.read().decode()
    counts: dict[str, int] = {}
    for key in filter(None, text.splitlines()):
        namespace = namespace_of_key(key) or ""
        counts[namespace] = counts.get(namespace, 0) + 1
    return counts
