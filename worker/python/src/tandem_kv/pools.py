"""The pools socket (engine side) and the mapped pools.

After a successful Attach the worker passes each pool's memfd ONCE over `<socket_dir>/pools.sock`
(SOCK_SEQPACKET, one JSON object per message, the fd as SCM_RIGHTS; engine.proto "The pools
socket"; the Rust side is `worker/src/engine_api/fd_pass.rs`):

    engine -> worker  {"op":"claim","attach_id":A,"claim_token":T}
    worker -> engine  {"op":"pool","kind":"target","fd_index":0} + fd   (one per pool, in order)
                      {"op":"done","pools":N}
                 or   {"op":"error","reason":...,"message":...}

The connection stays open for the life of the attach: closing it ends the attach on the worker.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import socket
from contextlib import contextmanager

from .errors import PoolsError

MAX_MESSAGE = 64 * 1024
MAX_SOCKET_PATH = 107


@contextmanager
def socket_address(path: str):
    """Yields an address for `path` that fits `sun_path` (107 bytes): the path itself, or
    `/proc/self/fd/<dirfd>/<name>` with the directory held open meanwhile (as the worker's
    `with_socket_address` does)."""
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        yield path
        return
    d, name = os.path.split(path)
    fd = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


class MappedPool:
    """One pool mapped MAP_SHARED into this process: the worker sees the same bytes at the same pages.

    `descriptor` is the `PoolDescriptor` of the AttachReply. Bytes of (page, layer) — a chunk of
    `chunk_bytes` — start at `chunk_offset(page, layer)` (layout formula of engine.proto).
    """

    def __init__(self, fd: int, descriptor):
        d = descriptor
        self.descriptor = d
        self.fd = fd
        self.kind = d.kind
        self.page_count = d.page_count
        self.layers = d.layers
        self.chunk_bytes = d.chunk_bytes
        self.page_bytes = d.page_bytes
        self.layout = d.layout
        if d.page_tokens * d.bytes_per_token_layer != d.chunk_bytes or d.layers * d.chunk_bytes != d.page_bytes:
            raise PoolsError(f"inconsistent pool descriptor: {d}")
        if d.page_count * d.page_bytes > d.map_length:
            raise PoolsError(f"{d.page_count} pages of {d.page_bytes} B exceed the {d.map_length} B mapping")
        try:
            self.map = mmap.mmap(
                fd, d.map_length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=d.map_offset
            )
        except (OSError, ValueError) as e:
            raise PoolsError(f"mmap of pool kind {d.kind}: {e}") from e
        self._anchor = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(self._anchor)

    def chunk_offset(self, page: int, layer: int) -> int:
        """Byte offset of chunk (page, layer); `IndexError` when out of range."""
        if not (0 <= page < self.page_count and 0 <= layer < self.layers):
            raise IndexError(f"page {page} layer {layer} outside {self.page_count} pages x {self.layers} layers")
        if self.layout == 1:  # POOL_LAYOUT_LAYER_FIRST
            return (layer * self.page_count + page) * self.chunk_bytes
        return (page * self.layers + layer) * self.chunk_bytes

    def write_page(self, page: int, data) -> None:
        """Writes one page's bytes (`page_bytes`, layer-major: chunk of layer 0, then layer 1, ...)."""
        mv = memoryview(data).cast("B")
        if len(mv) != self.page_bytes:
            raise ValueError(f"{len(mv)} B for a page of {self.page_bytes} B")
        c = self.chunk_bytes
        for layer in range(self.layers):
            o = self.chunk_offset(page, layer)
            self.map[o : o + c] = mv[layer * c : (layer + 1) * c]

    def read_page(self, page: int) -> bytes:
        """The page's bytes in the order `write_page` takes them."""
        c = self.chunk_bytes
        return b"".join(self.map[self.chunk_offset(page, l) : self.chunk_offset(page, l) + c] for l in range(self.layers))

    def page_spans(self, page: int):
        """(address, length) spans of the page's bytes, in `write_page` order (one span when page-first)."""
        if self.layout != 1:
            return [(self.address + self.chunk_offset(page, 0), self.page_bytes)]
        return [(self.address + self.chunk_offset(page, l), self.chunk_bytes) for l in range(self.layers)]

    def close(self) -> None:
        """Unmaps the pool and closes its fd (idempotent)."""
        if self.map is not None:
            self._anchor = None
            try:
                self.map.close()
            except BufferError:  # a view is still exported: leave the mapping to the GC
                pass
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def claim(path: str, attach_id: int, claim_token: int, timeout: float):
    """Claims the fds of an attach on the pools socket at `path`.

    Returns `(conn, [(kind, fd), ...])` in `fd_index` order; keep `conn` open for the life of the
    attach. Raises `PoolsError` (with the worker's `reason` on a refusal) on any failure; every
    socket operation is bounded by `timeout` seconds.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    fds: list = []
    try:
        s.settimeout(timeout)
        with socket_address(path) as addr:
            s.connect(addr)
        s.send(json.dumps({"op": "claim", "attach_id": attach_id, "claim_token": claim_token}).encode())
        while True:
            msg, got, flags, _ = socket.recv_fds(s, MAX_MESSAGE, 1)
            fd = got[0] if got else None
            for extra in got[1:]:
                os.close(extra)
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise PoolsError("truncated pools-socket message")
            if not msg:
                raise PoolsError("the worker closed the pools socket")
            m = json.loads(msg)
            op = m.get("op")
            if op == "pool":
                if fd is None:
                    raise PoolsError("pool message without its fd")
                if m.get("fd_index") != len(fds):
                    os.close(fd)
                    raise PoolsError(f"pool fd_index {m.get('fd_index')} out of order")
                fds.append((m.get("kind", ""), fd))
            elif op == "done":
                if fd is not None:
                    os.close(fd)
                if m.get("pools") != len(fds):
                    raise PoolsError(f"done after {len(fds)} pools, announced {m.get('pools')}")
                s.settimeout(None)
                return s, fds
            elif op == "error":
                raise PoolsError(f"claim refused: {m.get('reason')}: {m.get('message')}", m.get("reason", ""))
            else:
                raise PoolsError(f"unexpected pools-socket message {m!r}")
    except PoolsError:
        _cleanup(s, fds)
        raise
    except (OSError, ValueError) as e:
        _cleanup(s, fds)
        raise PoolsError(f"pools socket {path}: {e}") from e


def _cleanup(s, fds):
    for _, fd in fds:
        os.close(fd)
    s.close()
