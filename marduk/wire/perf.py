"""Performance telemetry on the wire (decisions.md 19): the window summary a trainer sends, the
straggler detail the controller's events carry, and a job's performance as status shows it.

A summary is one message per window (a few seconds) per rank, never per step: for each named
section (``step`` is the time between two ``client.step()`` calls), how many samples the window
had and their p50, p90, max and min in seconds. Published, not requested (``<prefix>.<job>.perf``):
a lost summary costs one window of evidence, never a training step. Every bound here is what
keeps a worker that lies or floods from costing the controller more than one small decode.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from marduk.wire.fields import (
    MAX_EPOCH,
    PROTOCOL_VERSION,
    DeviceId,
    JobName,
    ShortText,
    Token,
    Version,
)

MAX_SECTIONS: Final = 16
"""Sections per summary; a trainer that names more sends the 16 with the most samples."""
MAX_SECONDS: Final = 86_400.0
"""No section lasts longer than a day: a larger value is a lie or a bug, refused."""
MAX_SAMPLES: Final = 10_000_000
MAX_PERF_BYTES: Final = 8 * 1024
"""A summary of 16 sections is about 2 KiB: anything much larger is refused before decoding."""

Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
Samples = Annotated[int, msgspec.Meta(ge=0, le=MAX_SAMPLES)]
SectionName = Annotated[str, msgspec.Meta(pattern=r"\A[A-Za-z0-9_.:-]{1,64}\Z")]
Score = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=1 << 24)]


class SectionStats(msgspec.Struct, kw_only=True, array_like=False):
    """One section's samples in one window (seconds)."""

    name: SectionName
    count: Samples
    p50: Seconds
    p90: Seconds
    max: Seconds
    min: Seconds = 0.0


class PerfSummary(msgspec.Struct, kw_only=True, tag="perf", tag_field="type"):
    """One rank's window: ``marduk.<job>.perf``, published by the library (or relayed verbatim
    by its supervisor) about every ``window_s`` seconds."""

    v: Version = PROTOCOL_VERSION
    job: JobName
    replica: Token
    worker: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    rank: Rank
    incarnation: Annotated[int, msgspec.Meta(ge=0, le=MAX_EPOCH)] = 0
    # The window's length as the sender measured it, and its sequence number from 0 at the
    # process's start (a gap says summaries were lost).
    window_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)]
    seq: Annotated[int, msgspec.Meta(ge=0, le=MAX_EPOCH)] = 0
    sections: Annotated[list[SectionStats], msgspec.Meta(max_length=MAX_SECTIONS)]
    # Samples the recorder dropped this window (its buffer was full): said, not hidden.
    dropped: Samples = 0
    # Which of its worker's devices this rank runs on, as far as it knows (its MARDUK_DEVICES
    # share, torchrun's LOCAL_RANK of LOCAL_WORLD_SIZE): the controller names only devices its
    # map gives the worker (docs/protocol.md, *Performance summaries*).
    devices: Annotated[list[DeviceId], msgspec.Meta(max_length=64)] = []
    local_rank: Annotated[int, msgspec.Meta(ge=0, le=4096)] | None = None
    local_world_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None


class StragglerInfo(msgspec.Struct, kw_only=True):
    """What ``straggler_detected`` and ``straggler_cleared`` say of the rank (NVRx's scores:
    relative = the best rank's p50 / this rank's; individual = this rank's best p50 / its
    current; both 0 to 1, 1 is as fast as it gets)."""

    rank: int
    section: ShortText
    relative: float
    individual: float
    ratio: float  # this rank's p50 / the job's reference (the median of the other ranks)
    p50: float
    reference: float
    windows: int  # consecutive windows it has been slow (detected) or back to normal (cleared)
    devices: list[str] = []
    incarnation: int = 0


class SlowRank(msgspec.Struct, kw_only=True):
    replica: str
    worker: int
    rank: int
    section: str
    relative: float
    individual: float
    ratio: float
    devices: list[str] = []
    since: float = 0.0


class JobPerf(msgspec.Struct, kw_only=True):
    """A job's performance now (``marduk monitor status``): from the latest window of each rank."""

    job: str
    ranks: int
    steps_per_s: float  # the job's step rate: the median rank's (a synchronous job's pace)
    step_p50: float
    step_p90: float
    slowest: list[SlowRank] = []  # the ranks with the lowest relative score, stragglers first
    stragglers: list[SlowRank] = []


class PerfQuery(msgspec.Struct, kw_only=True, tag="perf_query", tag_field="type"):
    v: Version = PROTOCOL_VERSION
    job: JobName | None = None


class SlowDevice(msgspec.Struct, kw_only=True):
    """A device's slowness record (it outlives the job: persisted, read back at takeover)."""

    device: str
    detections: int
    jobs: list[str] = []  # the distinct "job/replica#incarnation" it was slow in, latest last
    last_at: float = 0.0
    worst_relative: float = 1.0


class PerfReply(msgspec.Struct, kw_only=True, tag="perf_reply", tag_field="type"):
    v: Version = PROTOCOL_VERSION
    jobs: list[JobPerf] = []
    devices: list[SlowDevice] = []  # slow in more than one job or incarnation, worst first
    stats: dict[str, int] = {}
