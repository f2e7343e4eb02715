"""The wire contract: every message Marduk sends or receives, as msgspec Structs.

JSON on the wire, so a monitor in any language can publish with a plain NATS client. Each message
carries ``type`` (the tag) and ``v`` (the protocol version). Decoding is strict at the edge: types
and bounds are checked, the version must be one we speak, and the payload size is capped. Unknown
fields are ignored so that a newer peer may add optional fields without breaking an older one.

``docs/protocol.md`` documents every subject and message with a JSON example; keep it in step.
The field types and limits are in ``fields``, the codec in ``codec``, the membership structs in
``membership``; this module re-exports them, so the whole contract is imported from here.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, get_args

import msgspec

# Re-exported (``X as X``): callers import the whole contract from this module.
from marduk.wire.codec import decode as decode
from marduk.wire.codec import encode as encode
from marduk.wire.codec import to_builtins as to_builtins
from marduk.wire.fields import MAX_DEVICES_PER_WORKER as MAX_DEVICES_PER_WORKER
from marduk.wire.fields import MAX_EPOCH as MAX_EPOCH
from marduk.wire.fields import MAX_MEMBERS as MAX_MEMBERS
from marduk.wire.fields import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from marduk.wire.fields import MAX_PEERS_PER_NOTICE as MAX_PEERS_PER_NOTICE
from marduk.wire.fields import MAX_TEXT as MAX_TEXT
from marduk.wire.fields import PATTERN_TEXT as PATTERN_TEXT
from marduk.wire.fields import PROTOCOL_VERSION as PROTOCOL_VERSION
from marduk.wire.fields import CommandKind as CommandKind
from marduk.wire.fields import DeviceId as DeviceId
from marduk.wire.fields import Epoch as Epoch
from marduk.wire.fields import FailureKind as FailureKind
from marduk.wire.fields import HealthState as HealthState
from marduk.wire.fields import JobName as JobName
from marduk.wire.fields import NonNegInt as NonNegInt
from marduk.wire.fields import Port as Port
from marduk.wire.fields import PosInt as PosInt
from marduk.wire.fields import QueryWhat as QueryWhat
from marduk.wire.fields import Revision as Revision
from marduk.wire.fields import Role as Role
from marduk.wire.fields import Scope as Scope
from marduk.wire.fields import ShortText as ShortText
from marduk.wire.fields import Text as Text
from marduk.wire.fields import Token as Token
from marduk.wire.fields import Version as Version
from marduk.wire.fields import clip_text as clip_text
from marduk.wire.membership import JobInfo as JobInfo
from marduk.wire.membership import Member as Member
from marduk.wire.membership import Membership as Membership
from marduk.wire.membership import Rendezvous as Rendezvous
from marduk.wire.membership import WorkerRef as WorkerRef
from marduk.wire.params import JobParams as JobParams
from marduk.wire.params import RankApplied as RankApplied
from marduk.wire.perf import JobPerf as JobPerf
from marduk.wire.perf import PerfQuery as PerfQuery
from marduk.wire.perf import PerfReply as PerfReply
from marduk.wire.perf import PerfSummary as PerfSummary
from marduk.wire.perf import SectionStats as SectionStats
from marduk.wire.perf import SlowDevice as SlowDevice
from marduk.wire.perf import SlowRank as SlowRank
from marduk.wire.perf import StragglerInfo as StragglerInfo


class Message(msgspec.Struct, kw_only=True, tag_field="type", omit_defaults=False):
    """Base of every wire message: the tag ``type`` and the version ``v``."""

    v: Version = PROTOCOL_VERSION


# --- registration ------------------------------------------------------------------------------


class Registration(Message, tag="register", kw_only=True):
    """An agent (supervisor or library) announces one worker of a replica and its devices.

    Idempotent: registering again (after a reconnect, a trainer restart) replaces the entry.
    """

    job: JobName
    replica: Token
    worker: NonNegInt = 0
    host: ShortText = ""
    devices: Annotated[list[DeviceId], msgspec.Meta(max_length=MAX_DEVICES_PER_WORKER)]
    scope: Scope = "replica"
    pid: NonNegInt = 0
    # Random per process start: with ``host`` and ``pid``, tells a new process from the one before
    # it where both have the same host name and pid (a StatefulSet pod's PID 1). "": not sent.
    instance: ShortText = ""
    # Counts trainer starts under one supervisor; a library alone sends MARDUK_RESTART_COUNT or 0.
    incarnation: NonNegInt = 0
    # The restart epoch this worker has applied (acknowledged); 0: none yet.
    epoch: Epoch = 0
    # The highest epoch it has received, applied or not: the controller never reissues it.
    seen_epoch: Epoch = 0
    # The revision of ``epoch``'s command its incarnation started with, as its ack said
    # (``Ack.revision``): said again, for a leader that never got the ack. Null: not said.
    revision: Revision | None = None
    role: Role = "library"
    # Tell this replica when another replica of its job restarts or fails (``peer_failed``
    # commands): torchft groups abandon the step in flight instead of waiting for a timeout.
    peer_notices: bool = False
    # A job whose ranks the controller assigns (``Membership``); null: ranks are the agent's.
    rendezvous: Rendezvous | None = None
    # The NVLink domain of this node's devices (NVML's ClusterUUID, the same on every GPU of
    # one NVL72 rack); "": none, or not known (no NVML fabric, a library, mixed domains).
    nvlink_domain: ShortText = ""


def same_process(a: Registration, b: Registration) -> bool:
    """Whether two registrations come from one process (the same host, pid and instance)."""
    return (a.host, a.pid, a.instance) == (b.host, b.pid, b.instance)


class PeerFailure(msgspec.Struct, kw_only=True):
    """One replica a ``peer_failed`` notice is about: the command it was sent, at its epoch."""

    replica: Token
    epoch: Epoch
    kind: FailureKind = "restart"
    devices: list[DeviceId] = []


class Command(Message, tag="command", kw_only=True):
    """A command to one replica (``replica`` set) or to every replica of a job (``replica`` null).

    Agents apply each epoch once: a command whose epoch is not above the last one applied is
    stale or a duplicate and is dropped.
    """

    command_id: ShortText
    job: JobName
    replica: Token | None = None
    scope: Scope = "replica"
    kind: CommandKind
    epoch: Epoch
    reason: Text = ""
    devices: list[DeviceId] = []
    event_id: ShortText = ""
    issued_at: float = 0.0
    # ``peer_failed`` only: the other replicas that fail (``epoch`` is 0: a notice belongs to
    # no epoch of the recipient's).
    peers: Annotated[list[PeerFailure], msgspec.Meta(max_length=MAX_PEERS_PER_NOTICE)] = []
    # A job whose ranks the controller assigns: the membership in force at ``epoch`` (for a
    # restart, the one the trainers start with). Older agents ignore it.
    membership: Membership | None = None
    # Members the controller took out of the job (a device out of service or spent, or silent)
    # and that are still registered: their agents act as on ``fail`` (exit 71). Every command
    # of the job lists them until they deregister, so one that missed it converges.
    retired: Annotated[list[WorkerRef], msgspec.Meta(max_length=MAX_MEMBERS)] = []
    # How many failures were merged into this epoch's command since it was issued (each merge,
    # a repeat of a device listed included, sends it again one higher). An agent says in its
    # ack which revision its incarnation started with; a failure merged after that is not
    # covered by the restart, and the controller issues a new epoch for it. Older agents
    # ignore it.
    revision: Revision = 0


class RegisterReply(Message, tag="register_reply", kw_only=True):
    job: JobName
    replica: Token
    worker: NonNegInt
    outcome: Literal["new", "updated", "unchanged"]
    # The current epoch of this worker's restart scope, and the command that set it (if any):
    # an agent that missed a command converges by comparing this with what it applied.
    epoch: Epoch
    command: Command | None = None
    # Devices of this registration that are out of service (quarantined or drained): the
    # replica cannot run here; a supervisor exits 71 so the pod goes back to the scheduler.
    unusable_devices: list[str] = []
    # Seconds between renewals (re-registrations) the controller expects; a worker silent for
    # three of them is shown ``stale``. 0: the agent keeps its own default.
    renew_interval: float = 0.0
    # A spare of a pool (``--spare-pool``) registered under the pool's name that a job has
    # claimed: it is that job's worker now (same replica and worker), and registers under
    # ``claimed_by`` from now on. Nothing else of the reply applies to it.
    claimed_by: JobName | None = None
    # The job's desired parameters (marduk.wire.params), if any were set: a new incarnation
    # starts with the current values, not its command line's. Older agents ignore it.
    params: JobParams | None = None


class Deregistration(Message, tag="deregister", kw_only=True):
    job: JobName
    replica: Token
    worker: NonNegInt = 0
    reason: Text = ""


class DeregisterReply(Message, tag="deregister_reply", kw_only=True):
    known: bool


class Ack(Message, tag="ack", kw_only=True):
    """A worker applied (or has started applying) the command of ``epoch``."""

    job: JobName
    replica: Token
    worker: NonNegInt = 0
    epoch: Epoch
    command_id: ShortText = ""
    # The devices of the command as the worker knew them when it acted on it (null: an agent
    # older than this field). A device that joined the restart after that (merged into the
    # command in flight while this ack travelled) was not covered by it: the controller
    # restarts the scope again for it.
    devices: Annotated[list[DeviceId], msgspec.Meta(max_length=MAX_DEVICES_PER_WORKER)] | None = (
        None
    )
    # The revision of the epoch's command (``Command.revision``) this worker's incarnation
    # started with: updates that came before it started are covered by it, a failure merged
    # at a higher revision is not (null: an agent older than this field; ``devices`` decides).
    revision: Revision | None = None


class AckReply(Message, tag="ack_reply", kw_only=True):
    """The controller recorded the ack; ``epoch`` is the scope's current epoch."""

    epoch: Epoch


class Action(msgspec.Struct, kw_only=True):
    """What the controller did for one restart scope in answer to an event."""

    job: str
    replica: str | None
    kind: CommandKind
    epoch: Epoch
    # True: a restart of this scope was already in flight, so no new command was sent.
    coalesced: bool = False


# --- agent reports ------------------------------------------------------------------------------

ReportStatus = Literal[
    "running", "restarting", "crashed", "hung", "gave_up", "preempted", "exited", "checkpointed"
]


class Report(Message, tag="report", kw_only=True):
    """A supervisor's report about its trainer: status, progress, and what went wrong.

    ``crashed``, ``hung``, ``gave_up`` and ``preempted`` make the controller restart the
    worker's restart scope (as for a device failure); ``running`` at an epoch confirms it.
    """

    job: JobName
    replica: Token
    worker: NonNegInt = 0
    status: ReportStatus
    epoch: Epoch = 0  # the epoch the trainer was started for
    incarnation: NonNegInt = 0
    step: int | None = None
    step_at: float = 0.0
    exit_code: int | None = None
    signal: ShortText = ""
    failure_class: ShortText = ""
    action: ShortText = ""
    summary: Text = ""
    lines: Annotated[list[Text], msgspec.Meta(max_length=20)] = []
    # The hang and startup timeouts in force, in words, when the agent learns them
    # (``--hang-timeout auto``); empty with fixed timeouts.
    timeouts: ShortText = ""


class ReportReply(Message, tag="report_reply", kw_only=True):
    actions: list[Action] = []


# --- a trainer's requests (``client.request``) ----------------------------------------------

# stop_restarting: this agent restarts the trainer no more (it ends with the trainer's exit
# code); exclude_node: the worker's devices leave service (as ``marduk monitor drain`` does),
# so the node leaves its job's membership at the next epoch; device_bad: a ``failed`` health
# event for one of the worker's devices, as a monitor would send.
WorkloadRequestKind = Literal["stop_restarting", "exclude_node", "device_bad"]
WORKLOAD_REQUEST_KINDS: Final = frozenset(get_args(WorkloadRequestKind))


class WorkloadRequest(Message, tag="workload_request", kw_only=True):
    """A trainer asks something of the control plane about itself (NVRx's workload control
    requests); its supervisor relays it on ``marduk.<job>.request`` under its registration's
    names. Only about the worker's own devices: the controller refuses any other."""

    job: JobName
    replica: Token
    worker: NonNegInt = 0
    kind: WorkloadRequestKind
    rank: NonNegInt = 0  # the local rank that asked
    device: DeviceId | None = None  # device_bad: which of the worker's devices
    reason: Text = ""
    # Chosen by the asker; a repeated device_bad with the same id is a duplicate health event.
    request_id: ShortText = ""


class WorkloadReply(Message, tag="workload_reply", kw_only=True):
    """What the controller did: ``devices`` taken out of service or reported failed, and the
    commands it sent for them (``actions``); ``detail`` in words."""

    kind: WorkloadRequestKind
    detail: Text = ""
    devices: list[str] = []
    actions: list[Action] = []


# --- device health -----------------------------------------------------------------------------


class DeviceHealth(Message, tag="health", kw_only=True):
    """A monitor's report about one physical device, keyed by its UUID."""

    device: DeviceId
    state: HealthState
    reason: Text = ""
    source: ShortText = ""
    # Chosen by the monitor; the controller ignores a repeated id. Empty: the controller assigns.
    event_id: ShortText = ""
    # Unix seconds when the monitor observed it; 0: the controller uses its receive time.
    timestamp: float = 0.0


class HealthReply(Message, tag="health_reply", kw_only=True):
    event_id: str
    device: str
    state: HealthState
    known: bool
    duplicate: bool = False
    actions: list[Action] = []


# --- observers ---------------------------------------------------------------------------------


# Every kind of ControllerEvent the controller publishes (docs/protocol.md lists each; a test
# checks both the list and the code against this). The wire field stays a plain string, so an
# observer decodes a kind a newer controller adds.
EventKind = Literal[
    # workers
    "registered",
    "reregistered",
    "deregistered",
    "forgotten",
    "duplicate_worker",
    "membership_too_large",
    "worker_stale",
    "worker_live",
    "worker_expired",
    "worker_on_unusable_device",
    "worker_unhealthy",
    "worker_healthy",
    "epochs_dropped",
    "membership_formed",
    "member_replaced",
    "job_shrunk",
    "job_held",
    "grow_started",
    "member_added",
    "grow_abandoned",
    "spare_claimed",
    "spare_skipped",
    # decisions
    "restart_issued",
    "fail_issued",
    "checkpoint_issued",
    "coalesced",
    "command_oversized",
    # devices
    "unknown_device",
    "device_failed",
    "device_degraded",
    "device_preempting",
    "device_healthy",
    "device_quarantined",
    "device_drained",
    "device_undrained",
    # supervisors' reports
    "trainer_started",
    "trainer_restarting",
    "trainer_exited",
    "trainer_checkpointed",
    "worker_crashed",
    "worker_hung",
    "worker_gave_up",
    "worker_preempted",
    # a trainer's requests (client.request)
    "trainer_request",
    # performance (marduk/core/stragglers.py)
    "straggler_detected",
    "straggler_cleared",
    "straggler_acted",
    "straggler_not_acted",
    # live parameters
    "params_set",
    "params_rejected",
]
EVENT_KINDS: Final = frozenset(get_args(EventKind))


class ControllerEvent(Message, tag="event", kw_only=True):
    """Something the controller decided or observed, for ``marduk monitor watch`` and logs."""

    kind: ShortText  # one of EVENT_KINDS (any string decodes: see EventKind)
    ts: float
    job: str | None = None
    replica: str | None = None
    worker: int | None = None
    device: str | None = None
    epoch: int | None = None
    detail: Text = ""
    event_id: ShortText = ""  # the health event that caused it, if one did
    straggler: StragglerInfo | None = None  # straggler_detected / straggler_cleared

    def __post_init__(self) -> None:
        self.detail = clip_text(self.detail)  # a detail listing workers grows with the job


class Hello(Message, tag="hello", kw_only=True):
    """Published by a controller when it starts serving (as leader): agents re-register."""

    controller_id: ShortText
    started_at: float


class Forget(Message, tag="forget", kw_only=True):
    """An operator removes a job, a replica or one worker from the map.

    Sent by ``marduk monitor forget``.
    """

    job: JobName
    replica: Token | None = None
    worker: NonNegInt | None = None


class ForgetReply(Message, tag="forget_reply", kw_only=True):
    removed: list[str] = []  # "job/replica/worker" of every worker removed


class Drain(Message, tag="drain", kw_only=True):
    """An operator takes devices out of service (``marduk monitor drain``), or puts them back
    (``undrain``: also lifts a quarantine). ``host``: every device registered from that host."""

    devices: Annotated[list[DeviceId], msgspec.Meta(max_length=MAX_DEVICES_PER_WORKER)] = []
    host: ShortText = ""
    undrain: bool = False
    reason: Text = ""


class MemberOut(msgspec.Struct, kw_only=True):
    """A member of a job whose ranks the controller assigns that a drain took out (its agent
    exits 71), and what became of its ranks: a spare took them, or none fit and the job shrank
    (``nodes`` left) or is held below MIN (``nodes`` 0)."""

    job: str
    member: WorkerRef
    node_rank: int  # its node rank until ``epoch``
    epoch: int  # the job's restart without it
    spare: WorkerRef | None = None  # the spare that takes its ranks; None: no spare fit
    spare_node_rank: int = 0  # the spare's node rank (the member's, unless the job also shrank)
    nodes: int = 0  # the job's nodes from ``epoch``; 0: held below MIN until workers are back
    world_size: int = 0


class DrainReply(Message, tag="drain_reply", kw_only=True):
    devices: list[str] = []  # the devices whose service state changed
    # The commands sent (drain only): `fail`; for a job whose ranks the controller assigns, a
    # `restart` without the members on those devices (``members_out``).
    actions: list[Action] = []
    # By host: devices that host's workers claim but workers on other hosts claim too; not
    # drained (one claim is false), one line each.
    conflicts: list[str] = []
    # The members the drain took out of jobs whose ranks the controller assigns, one each
    # (older controllers: empty; their ``actions`` say only the restart).
    members_out: list[MemberOut] = []


# --- queries -----------------------------------------------------------------------------------


class Query(Message, tag="query", kw_only=True):
    what: QueryWhat = "map"
    job: JobName | None = None
    # Paging (every reply fits the server's max payload): ask for the items from ``offset`` of
    # the answer ``snapshot`` (empty: a new one). Items are the workers, then the devices.
    offset: NonNegInt = 0
    snapshot: ShortText = ""


WorkerState = Literal["live", "stale"]


class WorkerInfo(msgspec.Struct, kw_only=True):
    job: str
    replica: str
    worker: int
    host: str
    # live: renewed within the worker TTL; stale: silent longer (holds no restart pending).
    state: WorkerState = "live"
    last_seen: float = 0.0
    devices: list[str]
    scope: Scope
    role: Role
    pid: int
    incarnation: int
    applied_epoch: int
    # The highest epoch the worker said it has received (its registration's seen_epoch).
    seen_epoch: int = 0
    epoch: int
    # How many of the scope's epochs were a checkpoint command, not a restart (0 from a
    # controller older than the field).
    checkpoints: int = 0
    registered_at: float
    updated_at: float
    # From the supervisor's latest report (empty for a library-only worker).
    status: str = ""
    step: int | None = None
    step_at: float = 0.0
    failure_class: str = ""  # of the last failure reported
    timeouts: str = ""  # learned hang/startup timeouts, as its supervisor's last report says
    # A job whose ranks the controller assigns: "member" (node_rank set), "joining" (a free
    # worker that will grow the job: ``JobInfo.joining``), "spare" (registered, no trainer),
    # "retired" (taken out of the job, told to exit 71), "unhealthy" (its node failed its
    # checks before a start: ``unhealthy`` says why; no rank, no spare); "" otherwise.
    part: str = ""
    unhealthy: str = ""
    node_rank: int | None = None
    spare: bool = False  # started with --spare (a member with it holds a lost member's ranks)


class DeviceInfo(msgspec.Struct, kw_only=True):
    device: str
    state: HealthState
    reason: str = ""
    since: float = 0.0
    failures: int = 0
    replicas: list[str] = []  # "job/replica"
    # Out of service: its replicas got `fail`, and a worker registering with it is told so.
    quarantined: bool = False  # flapping (the policy's decision)
    drained: bool = False  # an operator's decision
    out_reason: str = ""
    # The NVLink domain of the node that registered it (NVML's ClusterUUID); "": not known.
    nvlink_domain: str = ""


ControllerRole = Literal["leader", "standby"]


class ControllerInfo(msgspec.Struct, kw_only=True):
    controller_id: str
    version: str
    pid: int
    started_at: float
    prefix: str
    host: str = ""
    role: ControllerRole = "leader"
    # Leadership term: +1 each time a controller takes the lease.
    term: int = 0


class Standby(Message, tag="standby", kw_only=True):
    """A hot standby controller announces itself (about once a second) to the leader."""

    controller: ControllerInfo


class QueryReply(Message, tag="query_reply", kw_only=True):
    controller: ControllerInfo  # the leader that answered
    standbys: list[ControllerInfo] = []
    workers: list[WorkerInfo] = []
    devices: list[DeviceInfo] = []
    # Jobs with ranks from the controller (``job``: that one), and the counters: they describe
    # the whole answer, so only the page at offset 0 carries them (empty on later pages).
    jobs: list[JobInfo] = []
    stats: dict[str, int] = {}
    # Paging: this page holds items [offset, next_offset) of the snapshot's answer; ask again
    # with next_offset (and the snapshot id) until it is null.
    snapshot: str = ""
    offset: int = 0
    next_offset: int | None = None
    total_workers: int = 0
    total_devices: int = 0


class ErrorReply(Message, tag="error", kw_only=True):
    """The answer to a request the controller could not serve."""

    code: ShortText
    message: Text
    # For a health event: the event_id it answers (when the payload let it be read), so a
    # monitor takes only the answer to its own event.
    event_id: ShortText = ""
