"""NATS subjects. Every subject Marduk uses is built here, nowhere else.

Layout (prefix ``marduk`` by default)::

    marduk.health                          device health events (any monitor; job-agnostic),
                                           captured by the JetStream stream ``<PREFIX>_health``
    marduk.health.stored                   the headers of each stored health event, republished
                                           by the stream (it sends no acknowledgements)
    marduk.ctl.query                       request/reply: map, replicas, devices, stats
    marduk.ctl.forget                      request/reply: an operator removes workers
    marduk.ctl.drain                       request/reply: an operator drains/undrains devices
    marduk.ctl.hello                       a controller starts serving; agents re-register
    marduk.ctl.standby                     hot standby controllers announce themselves
    marduk.ctl.events                      controller events that belong to no job
    marduk.ctl.perf_query                  request/reply: jobs' step rates, stragglers, slow devices
    marduk.ctl.params.set                  request/reply: an admin sets a job's parameters
    marduk.ctl.params.get                  request/reply: a job's parameters, who applied them
    marduk.<job>.register                  request/reply: agent registration
    marduk.<job>.deregister                request/reply: agent deregistration
    marduk.<job>.ack                       an agent applied a command's epoch
    marduk.<job>.report                    request/reply: a supervisor's status or failure report
    marduk.<job>.request                   request/reply: a trainer's request, relayed by its agent
    marduk.<job>.perf                      a rank's performance summary per window (published)
    marduk.<job>.cmd.replica.<replica>     commands for one replica
    marduk.<job>.cmd.job                   commands for every replica of the job
    marduk.<job>.cmd.params                the job's desired parameters (every replica)
    marduk.<job>.params.applied            request/reply: a worker applied a parameters version
    marduk.<job>.events                    controller events about the job

Device health events carry no job: a device is physical and a monitor on a host does not know
which jobs use it. The controller maps the device to the replicas of every job using it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_PREFIX = "marduk"
# A monitor that wants the controller's decision about a durably published health event names a
# subject in this header; the controller publishes the HealthReply there once it has committed.
REPLY_HEADER = "Marduk-Reply-To"

# Tokens that appear in subjects: no dots, no wildcards, no whitespace. Always matched whole
# (``fullmatch``): with ``match`` and ``$``, "a\n" would pass, since ``$`` matches before a final
# newline. ``marduk.wire.protocol`` builds its wire patterns from TOKEN_PATTERN.
TOKEN_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}"
TOKEN_RE = re.compile(TOKEN_PATTERN)
PREFIX_RE = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
# Job names that would collide with the controller's own subjects.
RESERVED_JOBS = frozenset({"ctl", "health"})


def valid_token(value: str) -> bool:
    return TOKEN_RE.fullmatch(value) is not None


def check_job(job: str) -> str:
    """Return ``job`` if it can be used as a subject token, else raise ValueError."""
    if not valid_token(job):
        raise ValueError(
            f"invalid job name {job!r}: use 1-128 letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    if job in RESERVED_JOBS:
        raise ValueError(f"job name {job!r} is reserved")
    return job


def check_replica(replica: str) -> str:
    if not valid_token(replica):
        raise ValueError(
            f"invalid replica id {replica!r}: use 1-128 letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    return replica


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subjects under one prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if PREFIX_RE.fullmatch(self.prefix) is None:
            raise ValueError(f"invalid subject prefix {self.prefix!r}")

    # Job-agnostic subjects.
    @property
    def health(self) -> str:
        return f"{self.prefix}.health"

    @property
    def health_stored(self) -> str:
        return f"{self.prefix}.health.stored"

    @property
    def query(self) -> str:
        return f"{self.prefix}.ctl.query"

    @property
    def forget(self) -> str:
        return f"{self.prefix}.ctl.forget"

    @property
    def drain(self) -> str:
        return f"{self.prefix}.ctl.drain"

    @property
    def hello(self) -> str:
        return f"{self.prefix}.ctl.hello"

    @property
    def standby(self) -> str:
        return f"{self.prefix}.ctl.standby"

    @property
    def ctl_events(self) -> str:
        return f"{self.prefix}.ctl.events"

    # Per-job subjects.
    def register(self, job: str) -> str:
        return f"{self.prefix}.{job}.register"

    def deregister(self, job: str) -> str:
        return f"{self.prefix}.{job}.deregister"

    def ack(self, job: str) -> str:
        return f"{self.prefix}.{job}.ack"

    def report(self, job: str) -> str:
        return f"{self.prefix}.{job}.report"

    def request(self, job: str) -> str:
        return f"{self.prefix}.{job}.request"

    def perf(self, job: str) -> str:
        return f"{self.prefix}.{job}.perf"

    @property
    def perf_query(self) -> str:
        # Not ``ctl.perf``: ``<prefix>.*.perf``, the summaries' subscription, would match it.
        return f"{self.prefix}.ctl.perf_query"

    def replica_commands(self, job: str, replica: str) -> str:
        return f"{self.prefix}.{job}.cmd.replica.{replica}"

    def job_commands(self, job: str) -> str:
        return f"{self.prefix}.{job}.cmd.job"

    # Live parameters (marduk.wire.params): under ``cmd``, so an agent's credential that may
    # receive its job's commands receives them too, signed like commands.
    @property
    def params_set(self) -> str:
        return f"{self.prefix}.ctl.params.set"

    @property
    def params_get(self) -> str:
        return f"{self.prefix}.ctl.params.get"

    def params_commands(self, job: str) -> str:
        return f"{self.prefix}.{job}.cmd.params"

    def params_applied(self, job: str) -> str:
        return f"{self.prefix}.{job}.params.applied"

    def events(self, job: str | None) -> str:
        return self.ctl_events if job is None else f"{self.prefix}.{job}.events"

    # Wildcards the controller and observers subscribe to.
    def any_job(self, leaf: str) -> str:
        return f"{self.prefix}.*.{leaf}"

    @property
    def all_events(self) -> str:
        # ``ctl`` is reserved as a job name, so this also matches ``marduk.ctl.events``.
        return f"{self.prefix}.*.events"

    def job_of(self, subject: str) -> str | None:
        """The job segment of a per-job subject, or None."""
        parts = subject[len(self.prefix) + 1 :].split(".")
        if not subject.startswith(self.prefix + ".") or len(parts) < 2:
            return None
        return parts[0]
