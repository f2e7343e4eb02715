"""Snapshots of the train state into the node-local store ``marduk agent run`` keeps.

    import agent
    from agent.snapshots import torch_min

    client = agent.connect(on_command=agent.jax.exit_on_restart)
    got = client.restore(agree=torch_min)        # the newest step every rank holds, or None
    start = got.step if got else 0
    if got:
        model.load_state_dict(got.state["model"])
    for step in range(start + 1, n):
        train_step()
        client.snapshot(step, {"model": model.state_dict()})  # waits for the host copy only

The machinery is agent/library/snapshots.py (the format: agent/library/snapshot_format.py, the
store: agent/library/local_store.py); this module names what a trainer uses.
"""

from agent.library.local_store import StoreFull
from agent.library.snapshots import Restored, Snapshots, jax_min, torch_min

__all__ = ["Restored", "Snapshots", "StoreFull", "jax_min", "torch_min"]
