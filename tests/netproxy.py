"""A TCP proxy on loopback that a test can cut and restore: the operator reaches the API
server through it, so its watches can be broken (a network partition) while the cluster
goes on changing."""
from __future__ import annotations

import asyncio
import socket
import threading


class TcpProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.restore()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(*self.target)
        except OSError:
            w.close()
            return
        self._conns |= {w, uw}
        await asyncio.gather(self._pipe(r, uw), self._pipe(ur, w))
        self._conns -= {w, uw}

    def restore(self) -> None:
        async def start():
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self._run(start())

    def cut(self) -> None:
        """Refuse new connections and break every open one."""
        async def stop():
            if self._server:
                self._server.close()
                self._server = None
            for w in list(self._conns):
                w.transport.abort()
            self._conns.clear()
        self._run(stop())

    def close(self) -> None:
        self.cut()
        self.loop.call_soon_threadsafe(self.loop.stop)
