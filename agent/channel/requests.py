"""What a trainer may ask of its agent (``client.request``), and what makes a request bad.

Pure (no I/O): the library checks a request before it sends it, the agent checks it again when it
comes off the channel (any process of the trainer's may write there), and the controller decodes
the wire message strictly. Each refuses with a stable code (a counter's label) and a reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

KINDS: Final = ("stop_restarting", "exclude_node", "device_bad")
MAX_REASON: Final = 1024  # characters; the wire allows more, a reason needs no more
MAX_DEVICE: Final = 256
_DEVICE = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True, slots=True)
class Refusal:
    code: str  # unknown_kind, wrong_type, oversized, no_device, ...
    why: str


@dataclass(frozen=True, slots=True)
class Answered:
    """What ``client.request`` returns: done (``accepted``) or refused (``code``), and why."""

    accepted: bool
    detail: str
    code: str = ""  # refused: the counter's label (unknown_kind, no_answer, standalone, ...)

    def __bool__(self) -> bool:
        return self.accepted


def check(kind: object, device: object, reason: object) -> Refusal | None:
    """Why the request is refused (None: it may go on)."""
    if not isinstance(kind, str):
        return Refusal("wrong_type", f"kind must be a string, not {type(kind).__name__}")
    if kind not in KINDS:
        return Refusal("unknown_kind", f"unknown kind {kind[:64]!r}: one of {', '.join(KINDS)}")
    if not isinstance(reason, str):
        return Refusal("wrong_type", f"reason must be a string, not {type(reason).__name__}")
    if len(reason) > MAX_REASON:
        return Refusal("oversized", f"reason of {len(reason)} characters: at most {MAX_REASON}")
    if device is not None and not isinstance(device, str):
        return Refusal("wrong_type", f"device must be a string, not {type(device).__name__}")
    if isinstance(device, str):
        if len(device) > MAX_DEVICE:
            return Refusal("oversized", f"device id of {len(device)} characters: at most 256")
        if not _DEVICE.fullmatch(device):
            return Refusal("wrong_type", f"device id {device[:64]!r}: printable ASCII, no spaces")
    if kind == "device_bad" and not device:
        return Refusal("no_device", "device_bad names its device (device=...)")
    if kind != "device_bad" and device:
        return Refusal("wrong_type", f"{kind} takes no device")
    return None


def default_device(kind: str, device: str | None, own: list[str]) -> str | None:
    """``device_bad`` with no device named: the rank's one device, if it has exactly one."""
    if kind == "device_bad" and device is None and len(own) == 1:
        return own[0]
    return device
