"""The bones of a minimal HTTP/1.1 server on the running event loop (no thread, no framework):
one request per connection, answered and closed. The metrics endpoint and the Alertmanager
receiver each read requests their own way; listening, answering and addresses are here."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from marduk.errors import MardukError

Response = tuple[str, str, bytes]
"""An answer: status line (``"200 OK"``), content type, body."""

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None] | None]


def parse_host_port(
    text: str, *, option: str, example: str, bare_port: bool = False
) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT``, ``:PORT``: every address) -> (host, port); with
    ``bare_port``, ``PORT`` alone too. Else a MardukError naming ``option`` and an ``example``."""
    host, sep, port = text.rpartition(":")
    if not sep and bare_port:
        host, port = "", text
    try:
        number = int(port)
        if (not sep and not bare_port) or not 0 <= number <= 65535:
            raise ValueError
    except ValueError:
        raise MardukError(f"{option} {text!r}: expected HOST:PORT, e.g. {example}") from None
    return host.strip("[]") or "0.0.0.0", number


async def respond(writer: asyncio.StreamWriter, response: Response) -> None:
    """Write ``response`` whole, saying the connection closes after it."""
    status, ctype, body = response
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()


class HttpServer:
    """Listens on ``host:port`` (port 0: any; ``port`` is the one bound once started) and hands
    each connection to ``handle``. ``what`` names it in the one-line error if it cannot
    listen: "cannot {what} on HOST:PORT: reason"."""

    def __init__(self, host: str, port: int, handle: Handler, *, what: str) -> None:
        self.host = host
        self.port = port
        self.handle = handle
        self.what = what
        self._server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        """Listen; the address bound (the port chosen for port 0)."""
        try:
            self._server = await asyncio.start_server(self.handle, self.host, self.port)
        except OSError as e:
            raise MardukError(
                f"cannot {self.what} on {self.host}:{self.port}: {e.strerror or e}"
            ) from None
        bound = self._server.sockets[0].getsockname()
        self.port = bound[1]
        return bound[0], bound[1]

    def close(self) -> None:
        """Stop accepting (connections in flight go on)."""
        if self._server is not None:
            self._server.close()
            self._server = None

    async def stop(self) -> None:
        """Stop accepting and wait until the listening socket is closed."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()
