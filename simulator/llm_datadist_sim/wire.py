"""Framing for the simulated datadist link: a 4-byte length, a JSON header, then raw bytes
whose lengths the header lists."""
from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterable

_LEN = struct.Struct("!I")
MAGIC = "llm-datadist-sim/1"
MAX_HEADER = 1 << 20      # a header lists at most every block of a blocks cache: far below this
RECV_CHUNK = 1 << 16      # what is read at a time when the length is only the peer's claim
SEND_CHUNK = 1 << 20      # a socket timeout bounds each of these, not a whole KV cache


class LinkClosed(ConnectionError):
    pass


def send_msg(sock: socket.socket, header: dict, payloads: Iterable[bytes | bytearray | memoryview] = ()) -> None:
    """The header, then the payloads a MiB at a time: on a socket with a timeout, a peer that stops
    reading is given up on after it, while a large KV cache still takes as long as it takes."""
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    for p in payloads:
        view = memoryview(p)
        for i in range(0, len(view), SEND_CHUNK):
            sock.sendall(view[i:i + SEND_CHUNK])


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise LinkClosed("peer closed the link")
        got += k


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """n bytes, the buffer growing as they arrive (n may be a peer's claim); all of them by
    `deadline` (time.monotonic()) if given, else within the socket's own timeout per read."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the peer is too slow to send a message")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), RECV_CHUNK))
        if not chunk:
            raise LinkClosed("peer closed the link")
        buf += chunk
    return bytes(buf)


def recv_header(sock: socket.socket, timeout: float | None = None, idle: bool = False) -> dict:
    """The next message's header. `timeout`: all of it within that many seconds, counted from its
    first byte when `idle` (a link waits for its next message for as long as it likes)."""
    first = b""
    if idle:
        sock.settimeout(None)
        first = sock.recv(1)
        if not first:
            raise LinkClosed("peer closed the link")
    deadline = None if timeout is None else time.monotonic() + timeout
    (n,) = _LEN.unpack(first + recv_exact(sock, _LEN.size - len(first), deadline))
    if n > MAX_HEADER:
        raise LinkClosed(f"header of {n} bytes is not from a datadist peer")
    try:
        header = json.loads(recv_exact(sock, n, deadline))
    except RecursionError:
        raise ValueError("a header nested too deep is not from a datadist peer") from None
    if not isinstance(header, dict):
        raise ValueError("a header is a JSON object")
    return header


def discard(sock: socket.socket, n: int) -> None:
    buf = bytearray(min(n, 1 << 20))
    view = memoryview(buf)
    while n > 0:
        k = min(n, len(buf))
        recv_exact_into(sock, view[:k])
        n -= k
