"""The server's protocol boundary: every request body checked against one schema before
anything in the server's state changes.

Each op has a fixed set of fields with fixed types, ranges and lengths (`parse` below).
A request that breaks any rule raises `BadRequest`, whose message names the field and the
rule; the server answers it with an ERROR frame and has changed nothing. What a schema
cannot know (whether a token names a batch of this connection, whether a checksum count
matches what was reserved) the state checks, also before changing anything.

Limits (also what the client may send; a client batch beyond them is a bug):
* a key is a non-empty str of at most `MAX_KEY_BYTES` UTF-8 bytes (the SSD tier's record
  holds that much) with no control characters;
* a batch holds at most `MAX_BATCH` keys;
* a size is an int in [0, `MAX_OBJECT_BYTES`]; a checksum an int in [0, 2**64) or null;
  a token an int in [1, 2**63); JSON booleans are not ints here;
* a namespace is 1 to `MAX_NAMESPACE_CHARS` of letters, digits, '.', '_' and '-' (what
  umbp's keys carry); a label a str of 1 to `MAX_LABEL_CHARS` characters with no control
  character; a retention's seconds a finite number in (0, `MAX_SECONDS`]; an engine's
  request id a str of 1 to `MAX_REQUEST_CHARS` characters with no control character.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Final

from umbp.core.request_params import MAX_RETAIN_S
from umbp.runtime.server import protocol

__all__ = [
    "MAX_BATCH",
    "MAX_KEY_BYTES",
    "BadRequest",
    "BeginGet",
    "BeginPut",
    "CommitPut",
    "Drop",
    "EndGet",
    "Forget",
    "Keys",
    "Limits",
    "NoFields",
    "Register",
    "Retain",
    "body_limit",
    "parse",
    "parse_namespace",
]

MAX_KEY_BYTES: Final = 960
MAX_BATCH: Final = 1 << 16
MAX_OBJECT_BYTES: Final = 1 << 40
_MAX_TOKEN: Final = 1 << 63
_MAX_CHECKSUM: Final = 1 << 64
MAX_NAMESPACE_CHARS: Final = 160
MAX_LABEL_CHARS: Final = 512
MAX_REQUEST_CHARS: Final = 512
MAX_SECONDS: Final = MAX_RETAIN_S  # what a request may ask is what the server takes
_NAMESPACE: Final = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_NAMESPACE_CHARS}}}")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
_NOT_CONTROL: Final = bytes(b for b in range(256) if not (b < 0x20 or b == 0x7F))
"""Deleting these from a key's UTF-8 leaves its ASCII control bytes (a C-speed check;
UTF-8 encodes nothing else with bytes below 0x80)."""

_SMALL_BODY: Final = 4 << 10
_INDEX_BODY: Final = 2 << 20
_KEYS_BODY: Final = 16 << 20

BODY_LIMITS: Final = {
    protocol.HELLO: _SMALL_BODY,
    protocol.CLEAR: _SMALL_BODY,
    protocol.STATS: _SMALL_BODY,
    protocol.LOOKUP: _KEYS_BODY,
    protocol.WHERE: _KEYS_BODY,
    protocol.BEGIN_PUT: _KEYS_BODY,
    protocol.BEGIN_GET: _KEYS_BODY,
    protocol.COMMIT_PUT: _INDEX_BODY,
    protocol.END_GET: _INDEX_BODY,
    protocol.REGISTER: _SMALL_BODY,
    protocol.NAMESPACES: _SMALL_BODY,
    protocol.DROP: _SMALL_BODY,
    protocol.RETAIN: _KEYS_BODY,
    protocol.LIMITS: _SMALL_BODY,
    protocol.FORGET: _SMALL_BODY,
}
"""Largest body each op can need: a batch of keys (~110 bytes each for umbp's keys; 16 MiB
holds 100,000 of them), a list of checksums or positions, or an empty object. A header
announcing more is refused before any body byte is read or any memory allocated."""


class BadRequest(ValueError):
    """A request that breaks the schema; the message says which field and how."""


def body_limit(op: int) -> int:
    """Largest body `op` can need; raises `ProtocolError` for an op this server lacks."""
    limit = BODY_LIMITS.get(op)
    if limit is None:
        raise protocol.ProtocolError(f"unknown op {op}")
    return limit


@dataclass(frozen=True, slots=True)
class NoFields:
    """HELLO, CLEAR, STATS: an empty object (or an empty body)."""


@dataclass(frozen=True, slots=True)
class Keys:
    """LOOKUP, WHERE."""

    keys: tuple[str, ...]
    request: str | None = None
    """LOOKUP: the engine's request the prefetches it starts belong to."""


@dataclass(frozen=True, slots=True)
class Forget:
    request: str


@dataclass(frozen=True, slots=True)
class BeginPut:
    keys: tuple[str, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CommitPut:
    token: int
    checksums: tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class BeginGet:
    keys: tuple[str, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EndGet:
    token: int
    corrupt: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Register:
    namespace: str
    label: str


@dataclass(frozen=True, slots=True)
class Drop:
    namespace: str | None


@dataclass(frozen=True, slots=True)
class Retain:
    keys: tuple[str, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class Limits:
    namespace: str
    changes: tuple[tuple[str, int | None], ...]
    """(`quota_bytes` or `retain_budget_bytes`, bytes or None), each at most once."""


Request = (NoFields | Keys | BeginPut | CommitPut | BeginGet | EndGet | Register | Drop
           | Retain | Limits | Forget)


def parse(op: int, body: bytes) -> Request:
    """The request in `body` for `op`, checked whole; raises `BadRequest`."""
    fields = _decode(body)
    if op in (protocol.HELLO, protocol.CLEAR, protocol.STATS, protocol.NAMESPACES):
        _exact_fields(fields, ())
        return NoFields()
    if op == protocol.LOOKUP and "request" in fields:
        _exact_fields(fields, ("keys", "request"))
        return Keys(_keys(fields["keys"]), _request_id(fields["request"]))
    if op in (protocol.LOOKUP, protocol.WHERE):
        _exact_fields(fields, ("keys",))
        return Keys(_keys(fields["keys"]))
    if op == protocol.FORGET:
        _exact_fields(fields, ("request",))
        return Forget(_request_id(fields["request"]))
    if op in (protocol.BEGIN_PUT, protocol.BEGIN_GET):
        _exact_fields(fields, ("keys", "sizes"))
        keys = _keys(fields["keys"])
        sizes = _sizes(fields["sizes"])
        if len(sizes) != len(keys):
            raise BadRequest(f"'sizes' has {len(sizes)} entries for {len(keys)} keys")
        return BeginPut(keys, sizes) if op == protocol.BEGIN_PUT else BeginGet(keys, sizes)
    if op == protocol.COMMIT_PUT:
        _exact_fields(fields, ("token", "checksums"))
        return CommitPut(_token(fields["token"]), _checksums(fields["checksums"]))
    if op == protocol.END_GET:
        _exact_fields(fields, ("token", "corrupt"))
        return EndGet(_token(fields["token"]), _positions(fields["corrupt"]))
    return _parse_namespace_op(op, fields)


def _parse_namespace_op(op: int, fields: dict[str, Any]) -> Request:
    if op == protocol.REGISTER:
        _exact_fields(fields, ("namespace", "label"))
        return Register(_namespace(fields["namespace"]), _label(fields["label"]))
    if op == protocol.DROP:
        _exact_fields(fields, ("namespace",))
        namespace = fields["namespace"]
        return Drop(None if namespace is None else _namespace(namespace))
    if op == protocol.RETAIN:
        _exact_fields(fields, ("keys", "seconds"))
        return Retain(_keys(fields["keys"]), _seconds(fields["seconds"]))
    if op == protocol.LIMITS:
        optional = ("quota_bytes", "retain_budget_bytes")
        unknown = sorted(set(fields) - {"namespace", *optional})
        if "namespace" not in fields or unknown or not set(fields) & set(optional):
            raise BadRequest(f"fields must be 'namespace' and one or both of {list(optional)}: "
                             f"got {sorted(fields)}")
        changes = tuple(
            (name, None if fields[name] is None
             else _int(fields[name], name, 0, MAX_OBJECT_BYTES + 1))
            for name in optional if name in fields
        )
        return Limits(_namespace(fields["namespace"]), changes)
    raise protocol.ProtocolError(f"unknown op {op}")


def parse_namespace(value: Any) -> str:
    """A namespace as this protocol takes it; `BadRequest` naming the rule otherwise."""
    return _namespace(value)


def _namespace(value: Any) -> str:
    if not isinstance(value, str) or not _NAMESPACE.fullmatch(value):
        raise BadRequest(f"namespace must be 1 to {MAX_NAMESPACE_CHARS} of letters, digits, "
                         f"'.', '_' or '-', got {value!r:.80}")
    return value


def _label(value: Any) -> str:
    return _plain_text(value, "label", MAX_LABEL_CHARS)


def _request_id(value: Any) -> str:
    return _plain_text(value, "request", MAX_REQUEST_CHARS)


def _plain_text(value: Any, name: str, limit: int) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= limit or _CONTROL.search(value):
        raise BadRequest(f"{name} must be a string of 1 to {limit} characters "
                         f"without control characters, got {value!r:.80}")
    return value


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise BadRequest(f"seconds must be a number in (0, {MAX_SECONDS:g}], got {value!r:.40}")
    return float(value)


def _decode(body: bytes) -> dict[str, Any]:
    if not body:
        return {}
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as error:  # RecursionError: absurd nesting
        raise BadRequest(f"the body is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(value).__name__}")
    return value


def _no_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not a number this protocol accepts")


def _exact_fields(fields: dict[str, Any], names: tuple[str, ...]) -> None:
    if set(fields) != set(names):
        missing = sorted(set(names) - set(fields))
        extra = sorted(set(fields) - set(names))
        raise BadRequest(
            f"fields must be exactly {list(names)}: missing {missing}, unknown {extra}"
        )


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadRequest(f"'{name}' must be a list, got {type(value).__name__}")
    if len(value) > MAX_BATCH:
        raise BadRequest(f"'{name}' has {len(value)} entries, more than {MAX_BATCH}")
    return value


def _int(value: Any, name: str, low: int, high: int) -> int:
    """An int in [low, high) (bool excluded: JSON true is not 1 here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {type(value).__name__} {value!r:.40}")
    if not low <= value < high:
        raise BadRequest(f"{name} must be in [{low}, {high}), got {value}")
    return value


def _ints(values: list[Any], name: str, low: int, high: int) -> tuple[int, ...]:
    """Every entry an int in [low, high): checked at C speed when they all are (the
    common case, a batch of thousands), entry by entry for the message when not."""
    if all(type(value) is int for value in values) and (
        not values or (low <= min(values) and max(values) < high)
    ):
        return tuple(values)
    for position, value in enumerate(values):
        _int(value, f"{name}[{position}]", low, high)
    raise AssertionError("unreachable: some entry failed")  # pragma: no cover


def _keys(value: Any) -> tuple[str, ...]:
    keys = _list(value, "keys")
    if _plainly_good_keys(keys):
        return tuple(keys)
    return _checked_keys(keys)


def _plainly_good_keys(keys: list[Any]) -> bool:
    """The common case at C speed (a batch of thousands of ~110-character keys): all
    strings, none empty, none long enough that its UTF-8 could exceed `MAX_KEY_BYTES`,
    valid Unicode, no control character. False sends the batch to `_checked_keys`, which
    decides exactly and names the offending key."""
    if not keys:
        return True
    try:
        joined = "".join(keys)  # TypeError when one is not a str
        lengths = list(map(len, keys))
        encoded = joined.encode("utf-8")  # UnicodeEncodeError for a lone surrogate
    except (TypeError, UnicodeEncodeError):
        return False
    return (
        min(lengths) > 0
        and max(lengths) * 4 <= MAX_KEY_BYTES
        and not encoded.translate(None, _NOT_CONTROL)
    )


def _checked_keys(keys: list[Any]) -> tuple[str, ...]:
    encoded: list[bytes] = []
    for position, key in enumerate(keys):
        if type(key) is not str:
            raise BadRequest(f"keys[{position}] must be a string, got {type(key).__name__}")
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"keys[{position}] is not valid Unicode (a lone surrogate)") from None
        if not raw or len(raw) > MAX_KEY_BYTES:
            raise BadRequest(
                f"keys[{position}] has {len(raw)} UTF-8 bytes; a key has 1 to {MAX_KEY_BYTES}"
            )
        encoded.append(raw)
    if b"".join(encoded).translate(None, _NOT_CONTROL):
        position = next(i for i, raw in enumerate(encoded) if raw.translate(None, _NOT_CONTROL))
        raise BadRequest(f"keys[{position}] contains a control character")
    return tuple(keys)


def _sizes(value: Any) -> tuple[int, ...]:
    return _ints(_list(value, "sizes"), "sizes", 0, MAX_OBJECT_BYTES + 1)


def _token(value: Any) -> int:
    return _int(value, "token", 1, _MAX_TOKEN)


def _checksums(value: Any) -> tuple[int | None, ...]:
    checksums = _list(value, "checksums")
    if None not in checksums:  # the usual commit: every reserved key written
        return _ints(checksums, "checksums", 0, _MAX_CHECKSUM)
    return tuple(
        None if checksum is None else _int(checksum, f"checksums[{position}]", 0, _MAX_CHECKSUM)
        for position, checksum in enumerate(checksums)
    )


def _positions(value: Any) -> tuple[int, ...]:
    positions = _ints(_list(value, "corrupt"), "corrupt", 0, MAX_BATCH)
    if len(set(positions)) != len(positions):
        raise BadRequest("'corrupt' names a position twice")
    return positions
