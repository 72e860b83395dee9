"""`EngineClient`: the Python client of Tandem's engine API (`tandem.engine.v1`, DESIGN §3.1).

gRPC on the UNIX socket `<socket_dir>/engine.sock`; the pools' memfds arrive once per attach on
`<socket_dir>/pools.sock` (see `pools.py`). Every unary call carries a deadline (the client's
`call_timeout` unless given); every server stream carries one too, so nothing waits unbounded.
Refusals raise the typed exceptions of `errors.py`; a worker that is down raises
`WorkerUnavailable` at once (no wait-for-ready), a worker that does not answer `CallTimeout`.
The model is the Rust client, `worker/src/engine_api/client.rs`.
"""

from __future__ import annotations

import os
import threading

import grpc

from . import errors
from ._pb import engine_pb2 as pb
from ._pb import engine_pb2_grpc as pb_grpc
from .pools import MappedPool, claim, socket_address

ENGINE_SOCKET = "engine.sock"
POOLS_SOCKET = "pools.sock"

LAYOUTS = {"layer_first": pb.POOL_LAYOUT_LAYER_FIRST, "page_first": pb.POOL_LAYOUT_PAGE_FIRST}


def model_identity(model: dict) -> "pb.ModelIdentity":
    """A `ModelIdentity` from the worker config's `model` object.

    `model` as in worker.json: {"name", "layers", "attention": "gqa"|"mha"|"mla", "kv_heads",
    "head_dim" (gqa/mha) or "kv_lora_rank", "rope_dim" (mla), "dtype_bytes", "row_extra_bytes"?}.
    Raises `ValueError` on an unknown attention kind.
    """
    att = pb.Attention()
    kind = model.get("attention", "gqa").lower()
    if kind in ("gqa", "mha"):
        getattr(att, kind).CopyFrom(pb.Gqa(kv_heads=model["kv_heads"], head_dim=model["head_dim"]))
    elif kind == "mla":
        att.mla.CopyFrom(pb.Mla(kv_lora_rank=model["kv_lora_rank"], rope_dim=model.get("rope_dim", 0)))
    else:
        raise ValueError(f"unknown attention kind {kind!r}")
    return pb.ModelIdentity(
        name=model["name"],
        layers=model["layers"],
        attention=att,
        dtype_bytes=model["dtype_bytes"],
        row_extra_bytes=model.get("row_extra_bytes", 0),
    )


def engine_identity(
    engine: str,
    model: dict,
    page_tokens: int,
    layout="page_first",
    tp_rank: int = 0,
    tp_size: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
    model_fingerprint: str = "",
) -> "pb.EngineIdentity":
    """An `EngineIdentity` asking for the target pool (`engine` is `<name>/<version>`, e.g.
    `sglang/0.5.23`; `layout` a `LAYOUTS` name or a `PoolLayout` value)."""
    if isinstance(layout, str):
        layout = LAYOUTS[layout]
    return pb.EngineIdentity(
        engine=engine,
        model=model_identity(model),
        model_fingerprint=model_fingerprint,
        page_tokens=page_tokens,
        layout=layout,
        tp_rank=tp_rank,
        tp_size=tp_size,
        cp_rank=cp_rank,
        cp_size=cp_size,
        pools=[pb.PoolRequest(kind=pb.POOL_KIND_TARGET)],
    )


class Attached:
    """A live attach: `reply` (AttachReply), `pools` (MappedPool, fd_index order) and the pools
    connection. `close()` ends the attach on the worker (the connection closes) and unmaps."""

    def __init__(self, reply, pools, conn):
        self.reply = reply
        self.pools = pools
        self._conn = conn

    @property
    def id(self) -> int:
        return self.reply.attach_id

    def pool(self, kind=pb.POOL_KIND_TARGET):
        """The pool of `kind` (a `PoolKind`), or None."""
        return next((p for p in self.pools if p.kind == kind), None)

    def close(self) -> None:
        """Closes the pools connection and unmaps every pool (idempotent)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        for p in self.pools:
            p.close()


class EngineClient:
    """A client of one worker's engine API.

    `socket_dir` holds `engine.sock` and `pools.sock` (as this process sees it); `call_timeout`
    (seconds) bounds every call that is not given its own `timeout`. The channel reconnects by
    itself after a worker restart (backoff 100 ms .. 1 s); an attach does not survive a restart:
    attach again (`NotAttached` says so).
    """

    def __init__(self, socket_dir: str, call_timeout: float = 5.0):
        self.socket_dir = os.fspath(socket_dir)
        self.call_timeout = call_timeout
        path = os.path.join(self.socket_dir, ENGINE_SOCKET)
        # A socket path longer than sun_path is dialled through /proc/self/fd/<dirfd>: the directory
        # stays open for the channel's life (it reconnects through the same name).
        self._dir_fd = None
        if len(os.fsencode(path)) > 107:
            self._dir_fd = os.open(self.socket_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            path = f"/proc/self/fd/{self._dir_fd}/{ENGINE_SOCKET}"
        self._channel = grpc.insecure_channel(
            "unix:" + path,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.enable_retries", 0),
                # The default authority of a unix: target is the percent-encoded path, which the
                # worker's HTTP/2 stack refuses (RST_STREAM PROTOCOL_ERROR).
                ("grpc.default_authority", "localhost"),
            ],
        )
        self.session = pb_grpc.SessionStub(self._channel)
        self.prefill = pb_grpc.PrefillStub(self._channel)
        self.decode = pb_grpc.DecodeStub(self._channel)
        self.tiers = pb_grpc.TiersStub(self._channel)
        self.spec = pb_grpc.SpecStub(self._channel)
        self._lock = threading.Lock()

    # -- plumbing -----------------------------------------------------------------------------

    def _t(self, timeout):
        return self.call_timeout if timeout is None else timeout

    def unary(self, stub, method: str, request, timeout=None):
        """Calls `stub.method(request)` with a deadline; typed exceptions on failure. Usable for any
        unary RPC of the generated stubs (new ones included)."""
        try:
            return getattr(stub, method)(request, timeout=self._t(timeout))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, method) from None

    def stream(self, stub, method: str, request, timeout=None):
        """Starts a server stream with a deadline (`timeout` seconds for the whole stream) and
        returns an iterator of its messages once the worker has accepted it (its headers came).
        Typed exceptions on failure, at the start or mid-stream; `CallTimeout`/`DeadlineExceeded`
        end a stream whose deadline passed."""
        call = getattr(stub, method)(request, timeout=self._t(timeout))
        try:
            call.initial_metadata()  # waits for the headers or the end, within the deadline
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, method) from None
        return self._iterate(call, method)

    @staticmethod
    def _iterate(call, method):
        try:
            for item in call:
                yield item
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, method) from None
        finally:
            call.cancel()

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- Session -------------------------------------------------------------------------------

    def health(self, timeout=None):
        """`HealthReply` (needs no attach)."""
        return self.unary(self.session, "Health", pb.HealthRequest(), timeout)

    def attach_only(self, identity, timeout=None):
        """Attach without claiming the fds: the `AttachReply`."""
        return self.unary(self.session, "Attach", pb.AttachRequest(identity=identity), timeout)

    def attach(self, identity, timeout=None) -> Attached:
        """Attaches, claims the fds on this client's `pools.sock` and maps every pool.

        Raises the typed refusal (e.g. `IdentityMismatch`), or `PoolsError` when claiming or
        mapping fails (the attach then ends: the pools connection is closed)."""
        reply = self.attach_only(identity, timeout)
        conn, fds = claim(os.path.join(self.socket_dir, POOLS_SOCKET), reply.attach_id, reply.claim_token, self._t(timeout))
        pools = []
        try:
            if len(fds) != len(reply.pools):
                raise errors.PoolsError(f"{len(fds)} fds for {len(reply.pools)} pools")
            for (_, fd), d in zip(fds, reply.pools):
                pools.append(MappedPool(fd, d))
        except Exception:
            for p in pools:
                p.close()
            for _, fd in fds[len(pools) :]:
                os.close(fd)
            conn.close()
            raise
        return Attached(reply, pools, conn)

    def detach(self, attach_id: int, timeout=None):
        """Ends the attach; `DetachReply` (its live rooms are aborted through the release gate)."""
        return self.unary(self.session, "Detach", pb.DetachRequest(attach_id=attach_id), timeout)

    # -- Tiers ---------------------------------------------------------------------------------

    def lookup(self, attach_id: int, prefix_hashes, timeout=None):
        """`LookupReply`: per tier, the pages of `prefix_hashes` present (engine.proto)."""
        return self.unary(self.tiers, "Lookup", pb.LookupRequest(attach_id=attach_id, prefix_hashes=list(prefix_hashes)), timeout)

    def load(self, attach_id: int, prefix_hashes, pages, pools=(), timeout=None):
        """Loads `prefix_hashes` into `pages`: the list of `LoadEvent`s, ending with `done` or
        `failed` (the stream is read to its end within `timeout`)."""
        req = pb.LoadRequest(attach_id=attach_id, prefix_hashes=list(prefix_hashes), pages=list(pages), pools=list(pools))
        return list(self.stream(self.tiers, "Load", req, timeout))

    def store(self, attach_id: int, prefix_hashes, pages, timeout=None):
        """`StoreReply`: the pages accepted for write to the tiers."""
        req = pb.StoreRequest(attach_id=attach_id, prefix_hashes=list(prefix_hashes), pages=list(pages))
        return self.unary(self.tiers, "Store", req, timeout)

    # -- Prefill -------------------------------------------------------------------------------

    def watch_work(self, attach_id: int, timeout=None):
        """Iterator of `PrefillWork` until `timeout` (then `DeadlineExceeded`/`CallTimeout`)."""
        return self.stream(self.prefill, "WatchWork", pb.WatchWorkRequest(attach_id=attach_id), timeout)

    def pages_ready(self, attach_id: int, room, pages, first_page=0, layers=None, last=True, timeout=None):
        """`PagesReadyReply` for the room's source `pages` (`room` a `RoomRef`; `layers` a
        (start, end) tuple, all layers when None)."""
        req = pb.PagesReadyRequest(attach_id=attach_id, room=room, pages=list(pages), first_page=first_page, last=last)
        if layers is not None:
            req.layers.CopyFrom(pb.LayerRange(start=layers[0], end=layers[1]))
        return self.unary(self.prefill, "PagesReady", req, timeout)

    def watch_source_free(self, attach_id: int, timeout=None):
        """Iterator of `SourceFree` until `timeout`."""
        return self.stream(self.prefill, "WatchSourceFree", pb.WatchSourceFreeRequest(attach_id=attach_id), timeout)
