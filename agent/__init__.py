"""Marduk's agent library: a trainer imports it to register its devices and receive commands.

    import agent
    client = agent.connect(replica_id="r1")      # devices found through jax
    for step in range(n):
        train_step()
        if client.failed:                         # a device of this replica failed
            save_what_you_can(); client.ack(); break
    client.close()

Imports fast (no jax, no controller, no CLI); jax is imported only to discover devices.
"""

from agent.library.client import AgentError, AsyncClient, Client, Command, connect, connect_async
from agent.library.devices import local_device_uuids

__all__ = [
    "AgentError",
    "AsyncClient",
    "Client",
    "Command",
    "connect",
    "connect_async",
    "local_device_uuids",
]
