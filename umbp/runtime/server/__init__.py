"""The node-local store server (`umbp serve`) and its client.

One server process per node holds the DRAM tier in a shared-memory file that every
client maps (KV bytes never cross its socket) and, optionally, an SSD tier below it.
`ServerStore` is the client (`SchedulerStore`, `WorkerStore`, `TierAware`);
`start_server` / `server_reachable` launch and probe servers.
"""

from umbp.runtime.server.client import ServerStore
from umbp.runtime.server.launch import ServerStartError, server_reachable, start_server

__all__ = ["ServerStartError", "ServerStore", "server_reachable", "start_server"]
