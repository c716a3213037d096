"""The object key format spelled out on its own, as docs/design.md and
``umbp.core.identity`` state it: the oracle the key properties parse
``KeySpace`` keys with (umbp itself never parses a key: it builds them)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from returns.result import Failure, Result, Success

from umbp.core.identity import RankCoord

_KEY = re.compile(
    r"umbp:(?P<fmt>\d+):(?P<ns>[A-Za-z0-9._-]+):tp(?P<tp>\d+):pcp(?P<pcp>\d+)"
    r":dcp(?P<dcp>\d+):pp(?P<pp>\d+):g(?P<group>\d+):(?P<hash>(?:[0-9a-f]{2})+)"
)


@dataclass(frozen=True, slots=True)
class KeyParts:
    format_version: int
    namespace: str
    rank: RankCoord
    group_id: int
    block_hash: bytes


def parse_key(key: str) -> Result[KeyParts, str]:
    match = _KEY.fullmatch(key)
    if match is None:
        return Failure(f"not a umbp object key: {key!r}")
    return Success(KeyParts(
        format_version=int(match["fmt"]),
        namespace=match["ns"],
        rank=RankCoord(int(match["tp"]), int(match["pcp"]), int(match["dcp"]), int(match["pp"])),
        group_id=int(match["group"]),
        block_hash=bytes.fromhex(match["hash"]),
    ))
