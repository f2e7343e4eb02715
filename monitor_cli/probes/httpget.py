"""A small asyncio HTTP GET for the probes that read local HTTP sources.

The sources (the GCE metadata server, dcgm-exporter) are on the host or one hop away and speak
plain HTTP/1.1; a long-poll must be cancellable at once when the daemon stops, which a thread
running ``urllib`` is not. So: one connection per request (``Connection: close``), a deadline on
the whole exchange, a size cap, and errors that are one line (``HttpError``).
"""

from __future__ import annotations

import asyncio
import io
import ssl
import urllib.parse
from dataclasses import dataclass
from email.message import Message
from http.client import parse_headers

from marduk.errors import MardukError

MAX_BODY_BYTES = 32 * 1024 * 1024  # dcgm-exporter on a big node with every field: a few MiB
_MAX_HEAD_BYTES = 64 * 1024


class HttpError(MardukError, OSError):
    """The source could not be read: unreachable, too slow, or not speaking HTTP."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: Message
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


async def http_get(
    url: str,
    *,
    headers: dict[str, str] | None = None,
    timeout: float,
    max_bytes: int = MAX_BODY_BYTES,
) -> Response:
    """GET ``url``; any status is returned, every transport failure is an ``HttpError``."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HttpError(f"{shown(url)}: expected an http:// or https:// URL")
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    if ":" in parts.hostname:  # IPv6 literal
        host_header = f"[{parts.hostname}]" + (f":{parts.port}" if parts.port else "")
    lines = [
        f"GET {target} HTTP/1.1",
        f"Host: {host_header}",
        "User-Agent: marduk-monitor",
        "Accept: */*",
        "Connection: close",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                parts.hostname,
                port,
                ssl=ssl.create_default_context() if https else None,
                limit=_MAX_HEAD_BYTES,
            )
            writer.write(request)
            await writer.drain()
            return await _read_response(reader, max_bytes)
    except TimeoutError:
        raise HttpError(f"GET {shown(url)}: no answer within {timeout:g}s") from None
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
        raise HttpError(f"GET {shown(url)}: malformed HTTP response ({_why(e)})") from None
    except OSError as e:
        if isinstance(e, HttpError):
            raise
        why = "connection refused" if isinstance(e, ConnectionRefusedError) else e.strerror or e
        raise HttpError(f"GET {shown(url)}: {why}") from None
    finally:
        if writer is not None:
            writer.close()


async def _read_response(reader: asyncio.StreamReader, max_bytes: int) -> Response:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, _, header_block = head.partition(b"\r\n")
    version, _, rest = status_line.decode("latin-1").partition(" ")
    if not version.startswith("HTTP/"):
        raise ValueError(f"status line {status_line[:60]!r}")
    status = int(rest.split(" ", 1)[0])
    headers = parse_headers(io.BytesIO(header_block))
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        body = await _read_chunked(reader, max_bytes)
    elif headers.get("Content-Length") is not None:
        length = int(headers["Content-Length"])
        if length > max_bytes:
            raise ValueError(f"body of {length} bytes exceeds {max_bytes}")
        body = await reader.readexactly(length)
    else:  # HTTP/1.0 style: the body runs to the end of the connection
        body = await reader.read(max_bytes + 1)
        while len(body) <= max_bytes and not reader.at_eof():
            more = await reader.read(max_bytes + 1 - len(body))
            if not more:
                break
            body += more
        if len(body) > max_bytes:
            raise ValueError(f"body exceeds {max_bytes} bytes")
    return Response(status, headers, body)


async def _read_chunked(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailers
            return bytes(body)
        if len(body) + size > max_bytes:
            raise ValueError(f"body exceeds {max_bytes} bytes")
        body += await reader.readexactly(size)
        await reader.readexactly(2)


def _why(e: Exception) -> str:
    if isinstance(e, asyncio.IncompleteReadError):
        return "connection closed early"
    if isinstance(e, asyncio.LimitOverrunError):
        return "headers too long"
    return str(e)


def shown(url: str) -> str:
    """The URL without user info (never print a password)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
