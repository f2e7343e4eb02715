"""One error root for Marduk. Errors a user sees are one clear line (``str(err)``)."""

from __future__ import annotations


class MardukError(Exception):
    """Root of every error Marduk raises on purpose."""


class ProtocolError(MardukError, ValueError):
    """A message could not be decoded or failed validation.

    ``reason`` is a short machine-readable category (used as a counter label);
    the message says what was wrong in words.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ConnectError(MardukError, ConnectionError):
    """No NATS server could be reached at the given address."""

    def __init__(self, addr: str, detail: str = "") -> None:
        msg = f"cannot connect to NATS at {addr}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)
        self.addr = addr


class NoControllerError(MardukError, TimeoutError):
    """NATS answered, but no controller replied on the subject."""

    def __init__(self, subject: str, addr: str, detail: str = "") -> None:
        msg = f"no Marduk controller answered on {subject} at {addr}"
        if detail:
            msg += f" ({detail})"
        msg += "; is `marduk controller` running?"
        super().__init__(msg)
        self.subject = subject
        self.addr = addr


class RequestRejected(MardukError):
    """The controller answered a request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"controller rejected the request ({code}): {message}")
        self.code = code
        self.detail = message


class PermissionDeniedError(MardukError, PermissionError):
    """The NATS server refused this credential a publish or subscription."""
