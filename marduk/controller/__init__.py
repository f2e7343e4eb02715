"""The controller: a thin async shell around the pure policy.

Every inbound message goes the same way (each in its own task, started in arrival order): size
check and strict decode (a bad one is counted, logged rate-limited and answered with an error,
never raised: ``edge``), a synchronous call into ``Policy`` (the decision: ``handlers``), then a
commit (``commit``, with the steps in ``outbox``): check that we still lead, persist the
write-ahead records (epoch ceilings, rarely any), check again, publish the commands, persist the
other records, publish the events. Commits go out in decision order, many together, and no key
is written out of that order, so the store never goes backwards; a reply or an acknowledgement
waits for its own records.

Several controllers may run against one NATS (docs/decisions.md #9): each campaigns for the lease
(``leadership``); the leader serves (request subjects, the durable health consumer, the
periodic ``tick``), the others are hot standbys that mirror the state buckets and take over when
the lease lapses (``takeover``). The controller's role is one value moved by events
(``marduk.core.role``). ``shell`` wires the parts together and owns the lifecycle; each part is
handed a ``Context`` (``context``) and the callables it uses, never the ``Controller``. See
docs/architecture.md, *The controller*.
"""

from marduk.controller.settings import ControllerSettings, StartupError
from marduk.controller.shell import Controller, run_controller

__all__ = ["Controller", "ControllerSettings", "StartupError", "run_controller"]
