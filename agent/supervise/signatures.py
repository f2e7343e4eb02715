"""Known log signatures of trainer failures -> failure class and suggested action.

Pure: lines in, a Diagnosis out. The supervisor keeps the last lines of the trainer's output and
calls ``diagnose`` when the trainer dies or hangs; the class and the matching lines travel with
the failure report and show in ``marduk monitor watch``.

Actions:
* ``restart``: a fresh process cures it (TPU launch-group state is only reset by a new
  process);
* ``restart_job``: a collective failed; every worker of the mesh must restart together;
* ``check_device``: the hardware reported a fault; restarting may not help, count it against the
  device;
* ``fix_code``: a bug or a configuration error; restarting will fail the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Action = Literal["restart", "restart_job", "check_device", "fix_code"]


@dataclass(frozen=True, slots=True)
class Signature:
    failure_class: str
    pattern: re.Pattern[str]
    action: Action
    hint: str


def _sig(failure_class: str, pattern: str, action: Action, hint: str) -> Signature:
    return Signature(failure_class, re.compile(pattern, re.IGNORECASE), action, hint)


# Most specific first: the first signature that matches any line wins.
SIGNATURES: tuple[Signature, ...] = (
    _sig(
        "tpu_runtime_halt",
        r"Core halted unexpectedly|Accelerator device halted prematurely",
        "restart",
        "TPU core halted; a fresh process resets the runtime",
    ),
    _sig(
        "tpu_runtime_halt",
        r"program continuator has halted",
        "restart",
        "TPU program continuator halted; restart the process",
    ),
    _sig(
        "tpu_launch_group",
        r"unexpected peer shows up in the launch group",
        "restart_job",
        "hosts ran different XLA programs; restart every worker together",
    ),
    _sig(
        "gpu_xid",
        r"\bNVRM: Xid\b|\bXid \(PCI:|\bXID[ :]+\d+",
        "check_device",
        "the GPU driver reported an Xid fault; check the device",
    ),
    _sig(
        "gpu_ecc",
        r"uncorrectable ECC|ECC error|CUDA_ERROR_ECC_UNCORRECTABLE",
        "check_device",
        "uncorrectable memory error on the GPU",
    ),
    # Before cuda_error: "CUDA error: out of memory" (PyTorch, CUDA runtime) is an OOM.
    _sig(
        "device_oom",
        r"RESOURCE_EXHAUSTED.*(memory|HBM)|CUDA out of memory|CUDA error: out of memory|"
        r"CUDA_ERROR_OUT_OF_MEMORY|out of memory.*(device|HBM|GPU)|cudaErrorMemoryAllocation",
        "fix_code",
        "accelerator memory exhausted; reduce batch or model shard size",
    ),
    _sig(
        "nccl_error",
        r"\bNCCL (error|WARN)|ncclInternalError|ncclSystemError|"
        r"ncclRemoteError|Watchdog caught collective operation timeout",
        "restart_job",
        "a collective failed; restart every worker of the mesh",
    ),
    _sig(
        "cuda_error",
        r"CUDA error|CUDA_ERROR_\w+|cudaError\w+|CUBLAS_STATUS_\w+|"
        r"CUDNN_STATUS_\w+",
        "restart",
        "CUDA runtime error",
    ),
    _sig(
        "xla_runtime_error",
        r"(Xla|Jax)RuntimeError|INTERNAL: .*(XLA|TPU|GPU)",
        "restart",
        "XLA runtime error",
    ),
    _sig(
        "distributed_init",
        r"jax\.distributed|coordination service|DEADLINE_EXCEEDED.*"
        r"(barrier|coordinat)|Barrier timed out",
        "restart_job",
        "distributed initialisation or barrier failed",
    ),
    _sig(
        "host_oom",
        r"\bMemoryError\b|Cannot allocate memory|oom-kill|Out of memory: Killed",
        "fix_code",
        "host memory exhausted",
    ),
)

_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b.*)$")


@dataclass(frozen=True, slots=True)
class Diagnosis:
    failure_class: str
    action: Action
    summary: str
    lines: tuple[str, ...] = field(default_factory=tuple)


def last_exception(lines: Sequence[str]) -> str | None:
    """The exception line of the last Python traceback in ``lines``, if any."""
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if _TRACEBACK.match(lines[i].strip()):
            start = i
            break
    if start is None:
        return None
    for line in lines[start + 1 :]:
        m = _EXCEPTION_LINE.match(line.strip())
        if m:
            return m.group(1)
    return None


def diagnose(lines: Iterable[str], *, max_lines: int = 5) -> Diagnosis | None:
    """The best-known explanation for a failure, from the trainer's last output lines."""
    lines = [line.rstrip("\n") for line in lines]
    for sig in SIGNATURES:
        hits = [line for line in lines if sig.pattern.search(line)]
        if hits:
            return Diagnosis(sig.failure_class, sig.action, sig.hint, tuple(hits[-max_lines:]))
    exc = last_exception(lines)
    if exc is not None:
        return Diagnosis("python_exception", "restart", exc, (exc,))
    return None
