"""Engines that must not share a process, each in its own long-lived process.

vLLM keeps one KV connector per process (a global a second engine would inherit),
so side-by-side benchmarks run each engine in a child process built once and
drive them in turn over pipes: a message is a tuple whose first item names the
request; ``("stop",)`` ends the child's loop."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any


class EngineProcesses:
    def __init__(self, names: Sequence[str], serve: Callable[..., None],
                 args: tuple[Any, ...]) -> None:
        """Start ``serve(name, *args, connection)`` per name, one after another
        (start-up is CPU-bound); each child answers "ready" once its engine is up."""
        context = multiprocessing.get_context("spawn")
        self._connections: dict[str, Connection] = {}
        self._processes: list[Any] = []
        for name in names:
            parent, child = context.Pipe()
            process = context.Process(target=serve, args=(name, *args, child), daemon=True)
            process.start()
            if parent.recv() != "ready":
                raise RuntimeError(f"engine {name} did not start")
            self._connections[name] = parent
            self._processes.append(process)

    def call(self, name: str, *message: Any) -> Any:
        self._connections[name].send(message)
        return self._connections[name].recv()

    def close(self) -> None:
        for connection in self._connections.values():
            connection.send(("stop",))
        for process in self._processes:
            process.join(timeout=60)
