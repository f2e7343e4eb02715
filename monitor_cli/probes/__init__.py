"""Health probes for ``marduk monitor run``: small, separately testable units of one shape."""

from monitor_cli.probes.base import Condition, EventProbe, Probe

__all__ = ["Condition", "EventProbe", "Probe"]
