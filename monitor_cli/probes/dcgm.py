"""GPU health from a dcgm-exporter's ``/metrics`` for hosts that already run DCGM.

A polled ``Probe``: GET the exporter (``http://localhost:9400/metrics`` by default), parse the
Prometheus text format (``prometheus_client``'s parser) and map each GPU by its ``UUID`` label
(``uuid`` in the exporter's 1.x-compatible mode), the id NVML and our agents use too.

Fields, named as in dcgm-exporter's ``etc/default-counters.csv``
(https://github.com/NVIDIA/dcgm-exporter/blob/main/etc/default-counters.csv):

==================================  =========  ====================================================
field                               default?   condition
==================================  =========  ====================================================
``DCGM_FI_DEV_XID_ERRORS``          on         value is the last XID; see ``XID_STATES``
``DCGM_FI_DEV_ROW_REMAP_FAILURE``   on         > 0: failed (no spare rows left: replace the GPU)
``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``   commented  > 0: failed (uncorrectable ECC since the last reset)
``DCGM_FI_DEV_ROW_REMAP_PENDING``   not listed > 0: degraded (a remap waits for a GPU reset)
``DCGM_FI_DEV_RETIRED_PENDING``     commented  > 0: degraded (pre-Ampere: a page waits to retire)
==================================  =========  ====================================================

Fields the exporter does not export are simply absent: enable them in its counters CSV
(``docs/operations.md``). Correctable (single-bit) errors are not a condition: they were
corrected. ``DCGM_FI_DEV_XID_ERRORS`` holds the *last* XID until another one or a GPU reset, so a
critical XID stays a condition until the GPU is reset, which is what those XIDs need anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

from marduk.wire.protocol import HealthState
from monitor_cli.probes.base import Condition
from monitor_cli.probes.httpget import HttpError, http_get, shown

log = logging.getLogger("marduk.monitor.dcgm")

DEFAULT_URL: Final = "http://localhost:9400/metrics"

# The XIDs worth a condition, from NVIDIA's XID catalog
# (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html): failed where the GPU
# needs a reset or replacement before it can be trusted, degraded where it keeps working but
# should be reset or watched. Application-caused XIDs (13, 31, 43, 45) are not device faults.
# Deliberately small: the NVML probe keeps a fuller table; the two should become one module.
XID_STATES: Final[dict[int, tuple[HealthState, str]]] = {
    48: ("failed", "double-bit ECC error"),
    64: ("failed", "ECC page retirement or row remapping failed"),
    74: ("failed", "NVLink error"),
    79: ("failed", "GPU has fallen off the bus"),
    95: ("failed", "uncontained ECC error"),
    119: ("failed", "GSP RPC timeout"),
    120: ("failed", "GSP error"),
    63: ("degraded", "ECC page retirement or row remapping recorded: reset the GPU to apply it"),
    92: ("degraded", "high single-bit ECC error rate"),
    94: ("degraded", "contained ECC error: the application that hit it was stopped"),
}

# field -> (state, condition key, what a positive value means)
_THRESHOLDS: Final[dict[str, tuple[HealthState, str, str]]] = {
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": (
        "failed",
        "ecc:uncorrectable",
        "{v:g} uncorrectable (double-bit) ECC error(s) since the last GPU reset",
    ),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": (
        "failed",
        "row-remap:failed",
        "row remapping failed: no spare memory rows left",
    ),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": (
        "degraded",
        "row-remap:pending",
        "a memory row remap is pending: reset the GPU to apply it",
    ),
    "DCGM_FI_DEV_RETIRED_PENDING": (
        "degraded",
        "retired-pages:pending",
        "{v:g} memory page(s) pending retirement: reset the GPU to retire them",
    ),
}
_XID = "DCGM_FI_DEV_XID_ERRORS"
# DCGM's "blank" sentinels (no value) are just below 2**63; the exporter shows some of them.
_BLANK = float(0x7FFFFFFFFFFFFFF0)


class DcgmError(HttpError):
    """The exporter could not be read or did not answer with metrics."""


def conditions_from_metrics(text: str, devices: Collection[str] | None = None) -> list[Condition]:
    """Every condition the exporter's text shows, for ``devices`` (None: every GPU it lists).

    Raises ValueError if ``text`` is not the Prometheus text format.
    """
    found: dict[tuple[str, str], Condition] = {}
    for family in text_string_to_metric_families(text):
        # The parser names a counter's samples "<name>_total"; the family keeps the name.
        name = family.name
        if name != _XID and name not in _THRESHOLDS:
            continue
        for sample in family.samples:
            uuid = sample.labels.get("UUID") or sample.labels.get("uuid")
            value = sample.value
            if not uuid or value != value or value <= 0 or value >= _BLANK:  # NaN, 0, blank
                continue
            if devices is not None and uuid not in devices:
                continue
            condition = _condition(name, uuid, value, sample.labels)
            if condition is not None:
                found.setdefault((uuid, condition.key), condition)
    return sorted(found.values(), key=lambda c: (c.device, c.key))


def _condition(name: str, uuid: str, value: float, labels: dict[str, str]) -> Condition | None:
    gpu = f" (GPU {labels['gpu']})" if labels.get("gpu") else ""
    if name == _XID:
        xid = int(value)
        known = XID_STATES.get(xid)
        if known is None:
            return None
        state, what = known
        return Condition(uuid, state, f"xid:{xid}", f"XID {xid}{gpu}: {what} (dcgm-exporter)")
    state, key, what = _THRESHOLDS[name]
    return Condition(uuid, state, key, f"{what.format(v=value)}{gpu} ({name})")


class DcgmExporterProbe:
    """A ``Probe``: the conditions a dcgm-exporter shows, read every ``interval_s``.

    ``devices``: only these UUIDs (the host's registered GPUs); None reports every GPU listed.
    Raises ``DcgmError`` (one line) when the exporter cannot be read.
    """

    name = "dcgm-exporter"

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        devices: Collection[str] | None = None,
        interval_s: float = 10.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = url
        self.devices = set(devices) if devices is not None else None
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def check(self) -> list[Condition]:
        try:
            response = await http_get(self.url, timeout=self.timeout_s)
        except HttpError as e:
            raise DcgmError(f"dcgm-exporter: {e}") from None
        if response.status != 200:
            raise DcgmError(f"dcgm-exporter: GET {shown(self.url)}: HTTP {response.status}")
        try:
            return conditions_from_metrics(response.text(), self.devices)
        except ValueError as e:
            raise DcgmError(
                f"dcgm-exporter: {shown(self.url)} is not Prometheus text: {e}"
            ) from None
