"""An in-process stand-in for the worker's engine API, for the backend's data path while the real
worker's Tiers calls are not wired (they answer TIER_UNAVAILABLE at this commit).

It serves Session (Health, Attach, Detach) and Tiers (Lookup, Load, Store) on `<dir>/engine.sock`
with the semantics engine.proto documents — Store copies the pages' bytes (every layer, layer
order) before it answers; Lookup counts the leading pages present; Load copies them into the
destination pages and streams LayerLoaded events, then LoadDone or LoadFailed(pages_loaded) —
and passes its memfd pool on `<dir>/pools.sock` exactly as the worker does (SEQPACKET, one JSON
object per message, the fd by SCM_RIGHTS via `socket.send_fds`). Typed refusals carry an encoded
`Error` in `grpc-status-details-bin`. `store` (key -> bytes) outlives `stop()`, so a new instance
given the same dict plays a restarted worker with its L3 loaded back.
"""

import json
import mmap
import os
import socket
import threading
from concurrent import futures

import grpc

from tandem_kv._pb import engine_pb2 as pb
from tandem_kv._pb import engine_pb2_grpc as pb_grpc

FINGERPRINT = "f00dfacecafe0001"


class FakeWorker(pb_grpc.SessionServicer, pb_grpc.TiersServicer):
    def __init__(self, socket_dir, pages=3, page_tokens=512, layers=8, bytes_per_token_layer=64, store=None, layout=pb.POOL_LAYOUT_PAGE_FIRST):
        self.dir = socket_dir
        os.makedirs(socket_dir, exist_ok=True)
        self.pages, self.page_tokens, self.layers = pages, page_tokens, layers
        self.chunk = page_tokens * bytes_per_token_layer
        self.page_bytes = self.chunk * layers
        self.bptl = bytes_per_token_layer
        self.layout = layout
        self.map_length = -(-pages * self.page_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.fd = os.memfd_create("fake-worker-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.map_length)
        self.map = mmap.mmap(self.fd, self.map_length, flags=mmap.MAP_SHARED)
        self.store = {} if store is None else store
        self.calls = {"Lookup": 0, "Load": 0, "Store": 0}
        self.attach_id = 0
        self.next_id = 1
        self.token = 0
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_SessionServicer_to_server(self, self.server)
        pb_grpc.add_TiersServicer_to_server(self, self.server)
        self.server.add_insecure_port("unix:" + os.path.join(socket_dir, "engine.sock"))
        self.pools = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        path = os.path.join(socket_dir, "pools.sock")
        if os.path.exists(path):
            os.unlink(path)
        self.pools.bind(path)
        self.pools.listen(4)
        self.stopped = False

    def start(self):
        self.server.start()
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self):
        self.stopped = True
        self.server.stop(0).wait(5)
        self.pools.close()
        for n in ("engine.sock", "pools.sock"):
            try:
                os.unlink(os.path.join(self.dir, n))
            except FileNotFoundError:
                pass

    # -- the pools socket --------------------------------------------------------------------

    def _accept(self):
        while not self.stopped:
            try:
                conn, _ = self.pools.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            m = json.loads(conn.recv(65536) or b"{}")
            with self.lock:
                ok = m.get("op") == "claim" and m.get("attach_id") == self.attach_id != 0 and m.get("claim_token") == self.token
                if ok:
                    self.token = 0  # claimed once
            if not ok:
                conn.send(json.dumps({"op": "error", "reason": "ALREADY_CLAIMED", "message": "bad claim"}).encode())
                return
            socket.send_fds(conn, [json.dumps({"op": "pool", "kind": "target", "fd_index": 0}).encode()], [self.fd])
            conn.send(json.dumps({"op": "done", "pools": 1}).encode())
            mine = m["attach_id"]
            while conn.recv(65536):
                pass
            with self.lock:
                if self.attach_id == mine:
                    self.attach_id = 0

    # -- helpers -----------------------------------------------------------------------------

    def _refuse(self, context, code, reason, message, field=""):
        e = pb.Error(reason=reason, message=message, field=field)
        context.set_trailing_metadata(
            (("grpc-status-details-bin", e.SerializeToString()), ("tandem-error-reason", pb.ErrorReason.Name(reason)))
        )
        context.abort(code, message)

    def _check(self, attach_id, context):
        if attach_id == 0 or attach_id != self.attach_id:
            self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, pb.NOT_ATTACHED, "not attached", "attach_id")

    def _off(self, page, layer):
        if self.layout == pb.POOL_LAYOUT_LAYER_FIRST:
            return (layer * self.pages + page) * self.chunk
        return (page * self.layers + layer) * self.chunk

    def _read(self, page):
        return b"".join(self.map[self._off(page, l) : self._off(page, l) + self.chunk] for l in range(self.layers))

    def _write(self, page, data):
        for l in range(self.layers):
            self.map[self._off(page, l) : self._off(page, l) + self.chunk] = data[l * self.chunk : (l + 1) * self.chunk]

    def _pages_ok(self, pages, context):
        for p in pages:
            if p >= self.pages:
                self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, pb.PAGE_OUT_OF_RANGE, f"page {p}", "pages")

    # -- Session -----------------------------------------------------------------------------

    def Health(self, request, context):
        return pb.HealthReply(ready=True, role="prefill", attach_id=self.attach_id, page_tokens=self.page_tokens, layout=self.layout, model_fingerprint=FINGERPRINT, max_call_ms=30000)

    def Attach(self, request, context):
        i = request.identity
        if i.page_tokens != self.page_tokens or i.model.layers != self.layers:
            self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, pb.IDENTITY_MISMATCH, "geometry", "model.layers")
        with self.lock:
            if self.attach_id:
                self._refuse(context, grpc.StatusCode.ALREADY_EXISTS, pb.ALREADY_ATTACHED, "attached")
            self.attach_id, self.next_id = self.next_id, self.next_id + 1
            self.token = 0x5EED + self.attach_id
        d = pb.PoolDescriptor(
            kind=pb.POOL_KIND_TARGET, fd_index=0, map_offset=0, map_length=self.map_length, page_count=self.pages,
            page_tokens=self.page_tokens, layers=self.layers, bytes_per_token_layer=self.bptl, chunk_bytes=self.chunk,
            page_bytes=self.page_bytes, layout=self.layout, domain=pb.DOMAIN_SHARED_MEMORY,
        )
        return pb.AttachReply(attach_id=self.attach_id, claim_token=self.token, pools_socket=os.path.join(self.dir, "pools.sock"), pools=[d], model_fingerprint=FINGERPRINT, role="prefill", claim_deadline_ms=10000)

    def Detach(self, request, context):
        self._check(request.attach_id, context)
        self.attach_id = 0
        return pb.DetachReply()

    # -- Tiers -------------------------------------------------------------------------------

    def Lookup(self, request, context):
        self._check(request.attach_id, context)
        self.calls["Lookup"] += 1
        n = 0
        for h in request.prefix_hashes:
            if bytes(h) not in self.store:
                break
            n += 1
        return pb.LookupReply(hits=[pb.TierHits(tier=pb.TIER_L2, pages=n)])

    def Store(self, request, context):
        self._check(request.attach_id, context)
        self._pages_ok(request.pages, context)
        self.calls["Store"] += 1
        for h, p in zip(request.prefix_hashes, request.pages):
            self.store[bytes(h)] = self._read(p)
        return pb.StoreReply(pages=len(request.pages))

    def Load(self, request, context):
        self._check(request.attach_id, context)
        self._pages_ok(request.pages, context)
        self.calls["Load"] += 1
        n = 0
        for h, p in zip(request.prefix_hashes, request.pages):
            data = self.store.get(bytes(h))
            if data is None:
                yield pb.LoadEvent(failed=pb.LoadFailed(message="missing", pages_loaded=n))
                return
            self._write(p, data)
            n += 1
        for l in range(self.layers):
            yield pb.LoadEvent(layer=pb.LayerLoaded(pool=pb.POOL_KIND_TARGET, layer=l))
        yield pb.LoadEvent(done=pb.LoadDone(pages=n, bytes=n * self.page_bytes))
