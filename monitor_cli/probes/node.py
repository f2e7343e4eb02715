"""The Kubernetes node's own health, for every device of the host (name ``node``, polled).

Reads ``GET /api/v1/nodes/<NODE_NAME>`` from the API server, in-cluster by default: the address
from ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT``, the service account's token and CA
under ``/var/run/secrets/kubernetes.io/serviceaccount`` (the token is read at every request:
kubelet rotates it), ``NODE_NAME`` from the downward API. The service account needs ``get`` on
``nodes`` (a ClusterRole). Base URL, token and CA are injectable, e.g. ``http://127.0.0.1:8001``
behind ``kubectl proxy`` with no token.

Judged from the Node object (``status.conditions``, ``spec.taints``):

* ``Ready`` not ``True`` (``False``: the kubelet says the node is unwell; ``Unknown``: the
  control plane lost the kubelet) -> failed: its pods are about to be evicted.
* ``MemoryPressure``, ``DiskPressure``, ``PIDPressure``, ``NetworkUnavailable`` ``True`` ->
  degraded: the kubelet may start evicting pods; training slows or stalls.
* taints ``node.kubernetes.io/not-ready`` or ``node.kubernetes.io/unreachable`` -> failed (the
  node lifecycle controller's view of the same, which holds also when the conditions are stale).
* taints that announce the node's removal: ``ToBeDeletedByClusterAutoscaler`` (cluster
  autoscaler scale-down) and ``karpenter.sh/disrupted`` (Karpenter) -> preempting: checkpoint now.

A cordon (``spec.unschedulable``) is an operator's decision about new pods, not a health
condition of the running ones: not reported.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from marduk.errors import MardukError
from marduk.wire.protocol import HealthState
from monitor_cli.probes.base import Condition

log = logging.getLogger("monitor_cli.probes.node")

SERVICE_ACCOUNT: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PRESSURE: Final = ("MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable")
TAINTS: Final[dict[str, tuple[HealthState, str]]] = {
    "node.kubernetes.io/not-ready": ("failed", "the node is not ready"),
    "node.kubernetes.io/unreachable": ("failed", "the control plane cannot reach the node"),
    "ToBeDeletedByClusterAutoscaler": ("preempting", "the cluster autoscaler is removing the node"),
    "karpenter.sh/disrupted": ("preempting", "Karpenter is disrupting the node"),
}


class NodeApiError(MardukError):
    """The node could not be read from the Kubernetes API."""


class NodeApi:
    """``GET /api/v1/nodes/<name>`` (the seam: every input injectable)."""

    def __init__(
        self,
        base_url: str,
        *,
        token_path: Path | None = None,
        ca_path: Path | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token_path = token_path
        self.ca_path = ca_path
        self.timeout_s = timeout_s
        self._ssl: ssl.SSLContext | None = None
        if self.base_url.startswith("https:"):
            self._ssl = ssl.create_default_context(
                cafile=str(ca_path) if ca_path is not None else None
            )

    @classmethod
    def in_cluster(cls, timeout_s: float = 5.0) -> NodeApi:
        """The API server as a pod sees it; ``NodeApiError`` outside a cluster."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise NodeApiError(
                "not in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset): give --node-api URL"
            )
        if ":" in host:  # IPv6
            host = f"[{host}]"
        token, ca = SERVICE_ACCOUNT / "token", SERVICE_ACCOUNT / "ca.crt"
        if not token.is_file() or not ca.is_file():
            raise NodeApiError(
                f"no service account token under {SERVICE_ACCOUNT}: mount one "
                "(automountServiceAccountToken) with get on nodes"
            )
        return cls(f"https://{host}:{port}", token_path=token, ca_path=ca, timeout_s=timeout_s)

    def get_node(self, name: str) -> dict[str, Any]:
        url = f"{self.base_url}/api/v1/nodes/{urllib.parse.quote(name, safe='')}"
        headers = {"Accept": "application/json"}
        if self.token_path is not None:
            try:
                headers["Authorization"] = f"Bearer {self.token_path.read_text().strip()}"
            except OSError as e:
                raise NodeApiError(f"cannot read the token {self.token_path}: {e}") from None
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._ssl) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            hint = {
                401: ": the token was refused",
                403: ": the service account needs get on nodes (a ClusterRole)",
                404: ": no such node (is NODE_NAME the node's name?)",
            }.get(e.code, "")
            raise NodeApiError(f"GET node {name}: HTTP {e.code}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise NodeApiError(f"GET node {name} from {self.base_url}: {reason}") from None
        try:
            node = json.loads(body)
        except ValueError:
            raise NodeApiError(f"GET node {name}: the answer is not JSON") from None
        if not isinstance(node, dict):
            raise NodeApiError(f"GET node {name}: the answer is not a Node object")
        return node


def judge_node(node: dict[str, Any], devices: list[str]) -> list[Condition]:
    """A Node object -> conditions on every device of the host (pure)."""
    name = (node.get("metadata") or {}).get("name", "?")
    found: list[tuple[HealthState, str, str]] = []
    conditions = {c.get("type"): c for c in (node.get("status") or {}).get("conditions") or [] if c}
    ready = conditions.get("Ready")
    if ready is not None and ready.get("status") != "True":
        found.append(("failed", "node:ready", f"node {name} not Ready ({_why(ready)})"))
    for kind in PRESSURE:
        c = conditions.get(kind)
        if c is not None and c.get("status") == "True":
            found.append(("degraded", f"node:{kind}", f"node {name} {kind} ({_why(c)})"))
    for taint in (node.get("spec") or {}).get("taints") or []:
        key = (taint or {}).get("key", "")
        if key in TAINTS:
            state, text = TAINTS[key]
            found.append((state, f"taint:{key}", f"node {name}: {text} (taint {key})"))
    return [Condition(d, state, key, reason) for d in devices for state, key, reason in found]


def _why(condition: dict[str, Any]) -> str:
    parts = [f"status {condition.get('status', '?')}"]
    for field in ("reason", "message"):
        value = str(condition.get(field) or "").strip()
        if value:
            parts.append(value)
    return ": ".join(parts)


class NodeProbe:
    """The node's conditions and taints, for every device of the host (module docstring)."""

    def __init__(
        self,
        node_name: str,
        devices: Callable[[], list[str]],
        api: NodeApi,
        *,
        name: str = "node",
        interval_s: float = 10.0,
    ) -> None:
        if not node_name:
            raise NodeApiError("the node probe needs the node's name (NODE_NAME, --node-name)")
        self.name = name
        self.node_name = node_name
        self.devices = devices
        self.api = api
        self.interval_s = interval_s
        self._checks = 0

    async def check(self) -> list[Condition]:
        node = await asyncio.to_thread(self.api.get_node, self.node_name)
        devices = self.devices()
        self._checks += 1
        # The device probes name their devices at their first check, maybe after this one's.
        if not devices and self._checks == 2:
            log.warning(
                "node probe: no device of this host is known (give --devices or run a device "
                "probe); node conditions name no device"
            )
        return judge_node(node, devices)
