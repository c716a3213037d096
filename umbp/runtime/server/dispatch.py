"""Request dispatch of `umbp serve`: one request frame, parsed by `schema`, becomes one
`StoreCore` call and its answer frame. Refused requests (the client's mistake) answer
ERROR without a traceback; a request that fails answers ERROR and never takes the server
down.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from umbp.runtime.server import protocol, schema
from umbp.runtime.server.sessions import RequestRefused, Session
from umbp.runtime.server.state import StoreCore

__all__ = ["Served", "answer", "dispatch"]

logger = logging.getLogger("umbp.serve")


class Served(Protocol):
    """What dispatch reads of the server: its core, its HELLO answer and its limits."""

    core: StoreCore
    hello: dict[str, Any]

    def limits(self) -> dict[str, Any]: ...


def answer(server: Served, op: int, body: bytes, session: Session) -> bytes | None:
    """The answer frame to one request frame (None for a one-way request). The client's
    mistakes and one failing request answer ERROR; a `ProtocolError` (not this
    protocol) is raised for the connection to drop."""
    try:
        request = schema.parse(op, body)
        return dispatch(server, op, request, session)
    except protocol.ProtocolError:
        raise
    except (schema.BadRequest, RequestRefused) as error:
        # The client's mistake, refused before anything changed: no traceback.
        logger.warning("umbp serve: request %d refused: %s", op, error)
        return None if op in protocol.ONE_WAY else protocol.encode_json(
            protocol.ERROR, f"{type(error).__name__}: {error}"
        )
    except Exception as error:  # one bad request must not kill the server
        logger.exception("umbp serve: request %d failed", op)
        if op in protocol.ONE_WAY:
            return None
        return protocol.encode_json(protocol.ERROR, f"{type(error).__name__}: {error}")


def dispatch(
    server: Served, op: int, request: schema.Request, session: Session
) -> bytes | None:
    """Run one parsed request on the server's `StoreCore` and encode its answer."""
    core = server.core
    if isinstance(request, schema.Keys):
        codes = (core.lookup(request.keys, session, request.request) if op == protocol.LOOKUP
                 else core.where(request.keys))
        return protocol.encode(protocol.OK, codes)
    if isinstance(request, schema.Forget):
        core.forget(session, request.request)
        return None
    if isinstance(request, schema.BeginPut):
        token, put_answers = core.begin_put(session, request.keys, request.sizes)
        return protocol.encode_json(protocol.OK, {"token": token, "answers": put_answers})
    if isinstance(request, schema.CommitPut):
        return protocol.encode_json(
            protocol.OK, core.commit_put(session, request.token, request.checksums)
        )
    if isinstance(request, schema.BeginGet):
        token, get_answers = core.begin_get(session, request.keys, request.sizes)
        return protocol.encode_json(protocol.OK, {"token": token, "answers": get_answers})
    if isinstance(request, schema.EndGet):
        core.end_get(session, request.token, request.corrupt)
        return None
    if isinstance(request, (schema.Register, schema.Drop, schema.Retain, schema.Limits)):
        return protocol.encode_json(protocol.OK, _namespace_answer(core, request))
    if op == protocol.NAMESPACES:
        return protocol.encode_json(protocol.OK, core.namespaces())
    if op == protocol.HELLO:
        return protocol.encode_json(protocol.OK, server.hello)
    if op == protocol.CLEAR:
        return protocol.encode_json(protocol.OK, core.clear())
    if op == protocol.STATS:
        figures = core.stats(asking=session) | {
            "pid": server.hello["pid"],
            "server": server.hello,
            "limits": server.limits(),
        }
        return protocol.encode_json(protocol.OK, figures)
    raise protocol.ProtocolError(f"unknown op {op}")


def _namespace_answer(
    core: StoreCore, request: schema.Register | schema.Drop | schema.Retain | schema.Limits
) -> Any:
    if isinstance(request, schema.Register):
        core.register(request.namespace, request.label)
        return True
    if isinstance(request, schema.Drop):
        return core.drop(request.namespace)
    if isinstance(request, schema.Retain):
        return core.retain(request.keys, request.seconds)
    return core.set_limits(request.namespace, dict(request.changes))
