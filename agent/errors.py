"""The agent package's error root."""

from __future__ import annotations

from marduk.errors import MardukError


class AgentError(MardukError):
    """Root of the errors the agent library raises (only from connect/close, never later)."""
