"""The wire contract: every message Marduk sends or receives, as msgspec Structs.

JSON on the wire, so a monitor in any language can publish with a plain NATS client. Each message
carries ``type`` (the tag) and ``v`` (the protocol version). Decoding is strict at the edge: types
and bounds are checked, the version must be one we speak, and the payload size is capped. Unknown
fields are ignored so that a newer peer may add optional fields without breaking an older one.

``docs/protocol.md`` documents every subject and message with a JSON example; keep it in step.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal, TypeVar, get_args

import msgspec

from marduk.errors import ProtocolError
from marduk.wire.subjects import RESERVED_JOBS, TOKEN_PATTERN

PROTOCOL_VERSION: Final = 1
# Well under NATS's default max_payload (1 MiB). A registration of 4,096 devices fits.
MAX_MESSAGE_BYTES: Final = 256 * 1024
MAX_DEVICES_PER_WORKER: Final = 4096

# Above this, a JSON peer that reads numbers as doubles (JavaScript, jq, many JSON libraries)
# silently rounds: two different epochs would compare equal.
MAX_EPOCH: Final = 2**53

# --- field types -------------------------------------------------------------------------------

# Patterns are anchored with \A and \Z, not ^ and $: msgspec applies them with ``re.search``, and
# ``$`` also matches before a trailing newline, so "a\n" would pass as a token.
_TOKEN_PATTERN: Final = rf"\A{TOKEN_PATTERN}\Z"
# A token that is not a reserved job name (those would collide with the controller's subjects).
_RESERVED = "|".join(re.escape(job) for job in sorted(RESERVED_JOBS))
_JOB_PATTERN: Final = rf"\A(?!(?:{_RESERVED})\Z){TOKEN_PATTERN}\Z"
_DEVICE_PATTERN: Final = r"\A[\x21-\x7e]+\Z"

Token = Annotated[str, msgspec.Meta(pattern=_TOKEN_PATTERN, description="subject token")]
JobName = Annotated[str, msgspec.Meta(pattern=_JOB_PATTERN, description="job name")]
DeviceId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=_DEVICE_PATTERN)]
ShortText = Annotated[str, msgspec.Meta(max_length=256)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Epoch = Annotated[int, msgspec.Meta(ge=0, le=MAX_EPOCH)]
# Any integer decodes; decode() answers every value but PROTOCOL_VERSION with reason "version".
Version = int

Scope = Literal["replica", "job"]
# preempting: the device's host is about to go away (maintenance, preemption): checkpoint now.
HealthState = Literal["failed", "degraded", "preempting", "healthy"]
# checkpoint: save now (the host is about to go away); not a restart: keep training.
# peer_failed: a notice that other replicas of the job restart or fail (their ``peers``); not a
# restart either, and outside the recipient's epochs. Sent only to replicas that asked for it
# (``Registration.peer_notices``): older agents never see the kind.
CommandKind = Literal["restart", "fail", "stop", "checkpoint", "peer_failed"]
FailureKind = Literal["restart", "fail"]
# A notice lists at most this many failed replicas (a larger storm gives several notices).
MAX_PEERS_PER_NOTICE: Final = 256
Role = Literal["library", "supervisor"]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
# A membership lists at most this many workers (one per node): it travels in every command of
# its job and must fit the message cap with room to spare (about 120 bytes each).
MAX_MEMBERS: Final = 1024
QueryWhat = Literal["map", "devices", "stats", "ping"]


class Message(msgspec.Struct, kw_only=True, tag_field="type", omit_defaults=False):
    """Base of every wire message: the tag ``type`` and the version ``v``."""

    v: Version = PROTOCOL_VERSION


# --- registration ------------------------------------------------------------------------------


class Rendezvous(msgspec.Struct, kw_only=True):
    """What a worker of a job whose ranks the controller assigns brings to that rendezvous
    (``marduk agent run --nnodes MIN:MAX``, scope ``job``): its shape, the node rank it was
    given (if any), where its local rank 0 would serve as the job's coordinator and free ports
    its agent picked for that."""

    nproc: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    min_nodes: Annotated[int, msgspec.Meta(ge=1, le=MAX_MEMBERS)]
    max_nodes: Annotated[int, msgspec.Meta(ge=1, le=MAX_MEMBERS)]
    # --node-rank, when the agent was given one: the controller keeps it.
    node_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_MEMBERS)] | None = None
    addr: ShortText
    # Free ports on ``addr``; the controller never names the previous epoch's port again.
    ports: Annotated[list[Port], msgspec.Meta(max_length=8)] = []
    # A hot spare (``--spare``): registered, no trainer, never in the first membership; it
    # takes the ranks of a member that goes out of service. Workers beyond MAX are spares too.
    spare: bool = False


class Member(msgspec.Struct, kw_only=True, frozen=True):
    """One worker of a membership: its node's ranks are ``first_rank`` .. + ``nproc`` - 1."""

    replica: Token
    worker: NonNegInt = 0
    node_rank: NonNegInt
    first_rank: NonNegInt
    nproc: PosInt = 1
    addr: ShortText = ""


class WorkerRef(msgspec.Struct, kw_only=True, frozen=True):
    """One worker of a job, by name."""

    replica: Token
    worker: NonNegInt = 0


class Membership(msgspec.Struct, kw_only=True, frozen=True):
    """Who takes part in a job of scope ``job`` from ``epoch`` on: the members in node-rank
    order, the world size and the coordinator (member 0's address and a port its agent chose)."""

    epoch: Epoch
    world_size: PosInt
    coordinator_addr: ShortText
    coordinator_port: Port
    members: Annotated[list[Member], msgspec.Meta(max_length=MAX_MEMBERS)]

    def member(self, replica: str, worker: int) -> Member | None:
        for m in self.members:
            if m.replica == replica and m.worker == worker:
                return m
        return None


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
    role: Role = "library"
    # Tell this replica when another replica of its job restarts or fails (``peer_failed``
    # commands): torchft groups abandon the step in flight instead of waiting for a timeout.
    peer_notices: bool = False
    # A job whose ranks the controller assigns (``Membership``); null: ranks are the agent's.
    rendezvous: Rendezvous | None = None


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


class ReportReply(Message, tag="report_reply", kw_only=True):
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
    "worker_stale",
    "worker_live",
    "worker_expired",
    "worker_on_unusable_device",
    "epochs_dropped",
    "membership_formed",
    "member_replaced",
    "job_shrunk",
    "job_held",
    "grow_started",
    "member_added",
    "grow_abandoned",
    # decisions
    "restart_issued",
    "fail_issued",
    "checkpoint_issued",
    "coalesced",
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


class DrainReply(Message, tag="drain_reply", kw_only=True):
    devices: list[str] = []  # the devices whose service state changed
    actions: list[Action] = []  # the `fail` commands sent (drain only)
    # By host: devices that host's workers claim but workers on other hosts claim too; not
    # drained (one claim is false), one line each.
    conflicts: list[str] = []


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
    registered_at: float
    updated_at: float
    # From the supervisor's latest report (empty for a library-only worker).
    status: str = ""
    step: int | None = None
    step_at: float = 0.0
    failure_class: str = ""  # of the last failure reported
    # A job whose ranks the controller assigns: "member" (node_rank set), "spare" (registered,
    # no trainer), "retired" (taken out of the job, told to exit 71); "" otherwise.
    part: str = ""
    node_rank: int | None = None


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


# --- encoding and strict decoding --------------------------------------------------------------

_encoder = msgspec.json.Encoder()
T = TypeVar("T")
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, type_: type[T], *, max_bytes: int = MAX_MESSAGE_BYTES) -> T:
    """Decode ``data`` as ``type_`` or raise ProtocolError with a reason and a clear message.

    Whatever the bytes, nothing but ProtocolError comes out: a peer cannot make the controller
    answer ``internal``.
    """
    if len(data) > max_bytes:
        raise ProtocolError("oversized", f"message of {len(data)} bytes exceeds {max_bytes}")
    if not data:
        raise ProtocolError("empty", "empty message")
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        # JSON is UTF-8. msgspec checks only the strings it keeps, and raises UnicodeDecodeError
        # (not one of its own errors) for those; it skips unknown fields unchecked. Check it all.
        str(data, "utf-8")
        msg = decoder.decode(data)
    except msgspec.ValidationError as e:
        # The version first: a newer peer's message may fail our schema anywhere.
        _check_version(_peek_version(data))
        raise ProtocolError("invalid", f"invalid {_name(type_)}: {_readable(e)}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError("malformed", f"malformed JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ProtocolError("malformed", f"malformed JSON: not UTF-8 at byte {e.start}") from None
    except RecursionError:
        # msgspec guards its recursion with the interpreter's limit (about 1,000 levels).
        _check_version(_scan_version(data))
        raise ProtocolError("malformed", "malformed JSON: nested too deeply") from None
    except Exception as e:  # the sender's bytes, never our bug: see the docstring
        raise ProtocolError("malformed", f"malformed JSON: {type(e).__name__}: {e}") from None
    _check_version(getattr(msg, "v", PROTOCOL_VERSION))
    return msg  # type: ignore[no-any-return]


class _Envelope(msgspec.Struct):
    v: object = PROTOCOL_VERSION


def _peek_version(data: bytes) -> object:
    """The ``v`` of a message that failed validation, or PROTOCOL_VERSION if there is none.

    Validation stops at the first bad field, before the rest is parsed: bytes that are not
    JSON after it are ``malformed`` here, so the answer does not depend on the fields' order.
    """
    try:
        return msgspec.json.decode(data, type=_Envelope).v
    except msgspec.ValidationError:  # not an object: no version to read
        return PROTOCOL_VERSION
    except RecursionError:
        return _scan_version(data)
    except msgspec.DecodeError as e:
        raise ProtocolError("malformed", f"malformed JSON: {e}") from None


# A JSON string (group 1: the string "v"); a top-level-looking "v" member with an integer value (up
# to 4,000 digits: Python's int() stops at 4,300).
_STRING: Final = re.compile(rb'"(v)"|"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: fast on long ones
_V_MEMBER: Final = re.compile(rb'"v"\s*:\s*(-?\d{1,4000})\s*[,}]')


def _scan_version(data: bytes) -> object:
    """The top-level ``v`` of a payload nested too deeply for the decoder, or PROTOCOL_VERSION
    if none is found. No recursion, and no Python loop per byte: junk must stay cheap."""
    if not data.lstrip().startswith(b"{"):
        return PROTOCOL_VERSION
    flat = _STRING.sub(rb'"\1"', data)  # every string emptied but "v": no bracket inside
    depth, done, version = 0, 0, PROTOCOL_VERSION
    for member in _V_MEMBER.finditer(flat):
        part = flat[done : member.start()]
        depth += part.count(b"{") + part.count(b"[") - part.count(b"}") - part.count(b"]")
        done = member.start()
        if depth == 1:
            version = int(member.group(1))  # the last one wins, as in the decoder
    return version


def _check_version(version: object) -> None:
    # bool is an int in Python, and True == 1: only a real integer is a version.
    if type(version) is not int or version == PROTOCOL_VERSION:
        return
    shown = str(version) if abs(version) < 10**20 else f"{str(version)[:20]}..."
    why = "upgrade this side" if version > PROTOCOL_VERSION else "versions start at 1"
    raise ProtocolError(
        "version",
        f"unsupported protocol version {shown}: this side speaks {PROTOCOL_VERSION} ({why})",
    )


# msgspec names a failed pattern by its regex; say what it means instead.
_PATTERN_TEXT: Final = {
    _TOKEN_PATTERN: "1-128 of A-Z a-z 0-9 _ -, starting with a letter or digit",
    _JOB_PATTERN: "1-128 of A-Z a-z 0-9 _ -, starting with a letter or digit, and not "
    + " or ".join(repr(job) for job in sorted(RESERVED_JOBS)),
    _DEVICE_PATTERN: "printable ASCII without spaces",
}


def _readable(error: msgspec.ValidationError) -> str:
    text = str(error)
    for pattern, meaning in _PATTERN_TEXT.items():
        text = text.replace(f"matching regex {pattern!r}", f"({meaning})")
    return text


def _name(type_: Any) -> str:
    return getattr(type_, "__name__", None) or str(type_)


def to_builtins(msg: msgspec.Struct) -> Any:
    return msgspec.to_builtins(msg)
