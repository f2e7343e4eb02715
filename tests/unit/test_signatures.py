"""Log signatures: each known failure is classified from realistic output."""

from __future__ import annotations

import pytest

from agent.supervise.signatures import diagnose, last_exception

SEED_003_HALT = (
    "jax.errors.JaxRuntimeError: INTERNAL: Core halted unexpectedly: INTERNAL: Accelerator "
    "device halted prematurely"
)


@pytest.mark.parametrize(
    ("line", "failure_class", "action"),
    [
        (SEED_003_HALT, "tpu_runtime_halt", "restart"),
        (
            "jax.errors.JaxRuntimeError: FAILED_PRECONDITION: The program continuator has halted "
            "unexpectedly.",
            "tpu_runtime_halt",
            "restart",
        ),
        (
            "An unexpected peer shows up in the launch group with a different launch id than the "
            "current group leader.",
            "tpu_launch_group",
            "restart_job",
        ),
        (
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
            "gpu_xid",
            "check_device",
        ),
        (
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB on HBM",
            "device_oom",
            "fix_code",
        ),
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB",
            "device_oom",
            "fix_code",
        ),
        ("node-3:123:456 [0] NCCL WARN Call to ibv_poll_cq failed", "nccl_error", "restart_job"),
        (
            "RuntimeError: CUDA error: an illegal memory access was encountered",
            "cuda_error",
            "restart",
        ),
        (
            "jaxlib.xla_extension.XlaRuntimeError: INTERNAL: Failed to execute XLA Runtime "
            "executable",
            "xla_runtime_error",
            "restart",
        ),
        ("MemoryError", "host_oom", "fix_code"),
    ],
)
def test_known_signatures(line: str, failure_class: str, action: str) -> None:
    d = diagnose(["step 10 loss 1.2", line, "exiting"])
    assert d is not None
    assert (d.failure_class, d.action) == (failure_class, action)
    assert d.lines == (line,)


def test_python_traceback_gives_the_last_exception_line() -> None:
    lines = [
        "step 3 loss 0.5",
        "Traceback (most recent call last):",
        '  File "train.py", line 10, in <module>',
        "    main()",
        "ValueError: batch size 7 does not divide 8 devices",
    ]
    d = diagnose(lines)
    assert d is not None and d.failure_class == "python_exception"
    assert d.summary == "ValueError: batch size 7 does not divide 8 devices"
    assert last_exception(lines[:2]) is None


def test_specific_signature_beats_the_traceback_and_nothing_gives_none() -> None:
    d = diagnose(["Traceback (most recent call last):", "  ...", SEED_003_HALT])
    assert d is not None and d.failure_class == "tpu_runtime_halt"
    assert diagnose(["step 1 loss 2.0", "step 2 loss 1.9"]) is None
