"""Framing for the simulated datadist link: a 4-byte length, a JSON header, then raw bytes
whose lengths the header lists."""
from __future__ import annotations

import json
import socket
import struct

_LEN = struct.Struct("!I")
MAGIC = "llm-datadist-sim/1"


class LinkClosed(ConnectionError):
    pass


def send_msg(sock: socket.socket, header: dict, payloads: list = ()) -> None:
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    for p in payloads:
        sock.sendall(p)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise LinkClosed("peer closed the link")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def recv_header(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > 1 << 20:
        raise LinkClosed(f"header of {n} bytes is not from a datadist peer")
    return json.loads(recv_exact(sock, n))


def discard(sock: socket.socket, n: int) -> None:
    buf = bytearray(min(n, 1 << 20))
    view = memoryview(buf)
    while n > 0:
        k = min(n, len(buf))
        recv_exact_into(sock, view[:k])
        n -= k
