"""A TCP proxy the test controls, between one NATS client and the server (a partition).

Modes: ``pass`` (forward), ``hold`` (keep the connections open but forward nothing: bytes wait
in the proxy and go on in order when it passes again: a stalled link, a paused switch; with
``down=False`` only what the client sends is held, while it still receives), ``slow`` (forward each chunk after ``delay`` seconds) and ``drop()`` (close every
connection now; with ``refuse`` set, new ones are closed as soon as they are accepted, so a
client's reconnects fail until the test lets them through).
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host, self.target_port = host, target_port
        self.port = 0
        self.mode = "pass"
        self.delay = 0.0
        self.refuse = False
        self._server: asyncio.Server | None = None
        self._open = {True: asyncio.Event(), False: asyncio.Event()}  # upstream?, downstream
        for e in self._open.values():
            e.set()
        self._conns: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections = 0

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def hold(self, *, down: bool = True) -> None:
        self.mode = "hold"
        self._open[True].clear()
        if down:
            self._open[False].clear()

    def slow(self, delay: float) -> None:
        self.pass_()
        self.mode, self.delay = "slow", delay

    def pass_(self) -> None:
        self.mode, self.delay, self.refuse = "pass", 0.0, False
        for e in self._open.values():
            e.set()

    def drop(self, *, refuse: bool = False) -> None:
        """Close every connection now (the client sees EOF); ``refuse``: and any new one."""
        self.refuse = refuse
        for w in list(self._conns):
            w.transport.abort()
        self._conns.clear()

    async def stop(self) -> None:
        self.drop(refuse=True)
        for e in self._open.values():
            e.set()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._conns |= {writer, up_w}
        for src, dst, up in ((reader, up_w, True), (up_r, writer, False)):
            task = asyncio.create_task(self._pipe(src, dst, (writer, up_w), self._open[up]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
        open_: asyncio.Event,
    ) -> None:
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                await open_.wait()  # held: the bytes wait here, in order
                if self.mode == "slow" and self.delay:
                    await asyncio.sleep(self.delay)
                    await open_.wait()
                if dst.transport.is_closing():
                    break
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in pair:
                w.transport.abort()
                self._conns.discard(w)
