"""The engine side of prefill/decode through Tandem, for any engine whose requests come through
the decode worker's front door (`worker/src/roles/decode/own_api.rs`): the attach and its
keepalive, the decode's loads (`DecodeLoader`: Reserve under the front door's id and hand-off
token, AwaitKv, copy, Finish; a request's blocks go back only after the room's SafeToReuse) and
the prefill's sends (`PrefillSender`: wait for the room the decode opened, copy the prompt's KV
into free pages of the worker's pool, PagesReady). An engine's adapter subclasses them with its
KV layout (`_row_bytes`, `_copy`, `_copy_out`): vLLM's `tandem_kv.vllm_pd`, SGLang's
`tandem_kv.sglang_pd`.

A worker pool page holds `page_tokens` rows per layer (engine.proto, page-first); a row is the K
of every head, then the V of every head. Config keys (the engine adapter's extra config): `model`
(required: the worker config's `model`), `socket_dir` (default `$TANDEM_ENGINE_SOCKET_DIR` or
`/run/tandem/engine`), `timeout_s` (5.0: each call), `kv_slack_s` (5.0), `release_timeout_s`
(600: the longest a decode request's blocks wait for its SafeToReuse; past it they are handed
back, logged and counted), `load_threads` (16: transfers in flight), `keepalive_s` (2.0: how
often the attach is checked and restored without requests; 0 turns it off), `engine`
(`<name>/<version>`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from . import errors
from ._pb import engine_pb2 as pb
from .client import EngineClient, engine_identity

logger = logging.getLogger(__name__)


@dataclass
class LoadSpec:
    """One request's load: the engine's id, the front door's id, the prompt's tokens, the first token
    to load (those before it are cached locally) and the request's blocks from token 0."""

    req_id: str
    tandem_id: int
    kv_deadline_ms: int
    prompt_tokens: int
    first_token: int
    block_ids: list
    token: int = 0


@dataclass
class SendSpec:
    """One prefill request's send: the engine's id, the front door's id, the prompt's tokens, the
    request's blocks from token 0 (held by the engine until the send is reported), how long the
    decode waits for the KV, and the hand-off token (`kv_transfer_params.tandem.token`: the KV
    goes only into a room Reserved with the same token)."""

    req_id: str
    tandem_id: int
    kv_deadline_ms: int
    prompt_tokens: int
    block_ids: list
    token: int = 0


@dataclass
class _Load:
    spec: LoadSpec
    room: object = None
    aborted: bool = False


class EngineSide:
    """What both worker sides share: the config, the attach (with its watch threads, started by
    `_on_attach`) and the worker pool's rows. Thread-safe. An engine's subclass supplies its KV:
    `_row_bytes`, `_copy` (decode) or `_copy_out` (prefill), and `default_engine`."""

    def __init__(self, extra: dict, block_size: int):
        if not isinstance(extra.get("model"), dict):
            raise ValueError("kv_connector_extra_config.model (the worker config's model) is required")
        self.model = extra["model"]
        self.block_size = int(block_size)
        self.socket_dir = extra.get("socket_dir") or os.environ.get("TANDEM_ENGINE_SOCKET_DIR") or "/run/tandem/engine"
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.kv_slack_s = float(extra.get("kv_slack_s", 5.0))
        self.engine = extra.get("engine") or self.default_engine()
        self.client = EngineClient(self.socket_dir, call_timeout=self.timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=int(extra.get("load_threads", 16)), thread_name_prefix="tandem-kv")
        self._lock = threading.Lock()
        self._attach_lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._att = None
        self._closing = threading.Event()
        self.keepalive_s = float(extra.get("keepalive_s", 2.0))
        self._keepalive = None

    # -- setup ---------------------------------------------------------------------------------

    @staticmethod
    def default_engine() -> str:
        """The engine identity's `engine` when the config names none (`<name>/<version>`)."""
        return "unknown"

    def _row_bytes(self):
        """The engine's K+V bytes of one token in one layer (checked against the worker pool's
        page row at every attach), or None while its KV is not registered."""
        return None

    def open_session(self) -> None:
        """Attaches (or leaves it to the keepalive when the worker is not there yet) and starts
        the keepalive; called once the engine's KV is registered."""
        try:
            self._session()
        except errors.TandemError as e:  # the keepalive attaches again
            logger.warning("tandem: cannot attach to the worker at %s yet: %s", self.socket_dir, e)
        if self.keepalive_s > 0 and self._keepalive is None:
            self._keepalive = threading.Thread(target=self._keepalive_loop, name="tandem-keepalive", daemon=True)
            self._keepalive.start()

    def _keepalive_loop(self) -> None:
        """Every `keepalive_s`: attach when there is no attach (a worker is Ready only with its
        engine attached, and an unready worker gets no request that would make us attach), end
        an attach the worker no longer holds (it restarted), then `_tick`."""
        while not self._closing.wait(self.keepalive_s):
            try:
                with self._lock:
                    att = self._att
                if att is None:
                    self._session()
                else:
                    held = self.client.health(timeout=self.timeout_s).attach_id
                    if held != att.id:
                        self._lost(att, f"the worker holds attach {held}, not {att.id} (it restarted)")
                        self._session()
            except errors.CallTimeout:
                pass  # a busy or stopped worker: the calls judge that
            except errors.TandemError as e:
                with self._lock:
                    att = self._att
                if att is not None and isinstance(e, errors.WorkerUnavailable):
                    self._lost(att, e)
            except Exception as e:  # never let the thread die
                logger.warning("tandem: keepalive failed: %r", e)
            try:
                self._tick()
            except Exception as e:
                logger.warning("tandem: keepalive tick failed: %r", e)

    def _tick(self) -> None:
        """Periodic work of a side (the keepalive thread)."""

    def _on_lost(self) -> None:
        """The attach ended (called with the lock held)."""

    def _on_attach(self, att) -> None:
        """Starts the watch threads of a fresh attach (called with the lock held)."""

    def _session(self):
        """The live attach (attaching first); raises `TandemError` when the worker cannot be
        reached or refuses."""
        with self._attach_lock:  # one Attach at a time: the worker admits one engine
            return self._attach()

    def _attach(self):
        with self._lock:
            if self._att is not None:
                return self._att
        health = self.client.health()
        att = self.client.attach(engine_identity(self.engine, self.model, health.page_tokens, layout="page_first"))
        pool = att.pool()
        row = pool.chunk_bytes // pool.descriptor.page_tokens
        ours = self._row_bytes()
        if ours is not None and ours != row:
            att.close()
            raise errors.PoolsError(f"a page row of the worker is {row} B; the engine's K+V row of a token and layer is {ours} B")
        with self._lock:
            if self._att is not None:  # another thread attached meanwhile
                att.close()
                return self._att
            self._att = att
            self._on_attach(att)
        logger.info("tandem: engine connector attached (id %d, %d pages of %d B)", att.id, pool.page_count, pool.page_bytes)
        return att

    def _lost(self, att, why) -> None:
        with self._lock:
            if self._att is not att:
                return
            self._att = None
            self._on_lost()
            self._cv.notify_all()
        logger.warning("tandem: attach %d lost (%s)", att.id, why)
        att.close()

    def _watch(self, att, name, stub, method, request, on_event) -> None:
        """Runs one server stream of `att` on a thread (re-subscribing hourly) and calls
        `on_event(ev)` under the lock; the attach ends when the stream fails otherwise."""

        def run():
            while not self._closing.is_set():
                with self._lock:
                    if self._att is not att:
                        return
                try:
                    for ev in self.client.stream(stub, method, request, timeout=3600.0):
                        with self._lock:
                            if self._att is not att:  # a stale stream feeds nothing into a new attach
                                return
                            on_event(ev)
                            self._cv.notify_all()
                except (errors.DeadlineExceeded, errors.CallTimeout):
                    continue
                except errors.TandemError as e:
                    self._lost(att, e)
                    return
                except Exception as e:  # a malformed event must not end the watch silently
                    logger.exception("tandem: the %s watch failed: %r", name, e)
                    self._lost(att, e)
                    return

        threading.Thread(target=run, name=f"tandem-{name}", daemon=True).start()

    def _rows(self, pool):
        """The pool as (pages, layers, page_tokens, 2, row_half) bytes: a page row's K half, then
        its V half (page-first layout, engine.proto)."""
        p_tok = pool.descriptor.page_tokens
        half = pool.chunk_bytes // p_tok // 2
        flat = np.ndarray((pool.page_count * pool.page_bytes,), dtype=np.uint8, buffer=pool.map)
        return flat.reshape(pool.page_count, pool.layers, p_tok, 2, half)

    def close(self) -> None:
        self._closing.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            att, self._att = self._att, None
            self._cv.notify_all()
        if att is not None:
            try:
                self.client.detach(att.id)
            except errors.TandemError:
                pass
            att.close()
        self.client.close()


class DecodeLoader(EngineSide):
    """The decode's worker side: the load threads and the release watch (module docstring).
    Thread-safe; `start` never blocks on the worker. A load thread is busy from Reserve to
    Finish (or the room's failure) only: the wait for the room's SafeToReuse is a record the
    release watch completes (`_held`), the keepalive tick times it out, and an attach loss ends
    it (a worker that is gone can write nothing)."""

    def __init__(self, extra: dict, block_size: int):
        super().__init__(extra, block_size)
        self.release_timeout_s = float(extra.get("release_timeout_s", 600.0))
        self._loads = {}  # req_id -> _Load
        self._finished = set()
        self._errors = set()
        self._held = {}  # (room, generation) -> (_Load, ok, hand-back deadline)
        self._early = OrderedDict()  # releases of rooms not (yet) held: a Reserve reply can trail them
        self._max_seq = 0
        self._aborter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-abort")
        self.stats = {"loaded": 0, "failed": 0, "aborted": 0, "release_timeouts": 0, "pages_copied": 0}

    def _on_attach(self, att) -> None:
        self._early.clear()
        self._max_seq = 0
        self._watch(att, "releases", self.client.decode, "WatchReleases", pb.WatchReleasesRequest(attach_id=att.id), self._on_release)

    def _on_lost(self) -> None:
        for ld, ok, _ in list(self._held.values()):
            self._done(ld, ok)
        self._held.clear()

    def _on_release(self, ev) -> None:
        key = (ev.room.room_id, ev.room.generation)
        if self._max_seq and ev.seq > self._max_seq + 1:
            logger.warning("tandem: releases %d..%d were dropped by the worker", self._max_seq + 1, ev.seq - 1)
        self._max_seq = max(self._max_seq, ev.seq)
        held = self._held.pop(key, None)
        if held is not None:
            self._done(held[0], held[1])
            return
        self._early[key] = ev.seq
        while len(self._early) > 4096:
            self._early.popitem(last=False)

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [k for k, (_, _, at) in self._held.items() if at <= now]
            for k in late:
                ld, ok, _ = self._held.pop(k)
                self.stats["release_timeouts"] += 1
                logger.error("tandem: no SafeToReuse for room %d within %.0fs: request %s's blocks are handed back", k[0], self.release_timeout_s, ld.spec.req_id)
                self._done(ld, ok)

    def _done(self, ld: _Load, ok: bool) -> None:
        """The request's blocks go back to the engine (called with the lock held), as load errors
        unless `ok`."""
        spec = ld.spec
        self._loads.pop(spec.req_id, None)
        if ok:
            self.stats["loaded"] += 1
        else:
            self.stats["failed"] += 1
            # An aborted request is gone from the scheduler: its blocks are freed, not recomputed
            # (naming them invalid could hit the request they go to next).
        self._report(ld, ok)

    def _report(self, ld: _Load, ok: bool) -> None:
        """Tells the engine that `ld`'s blocks are its own again (called with the lock held once,
        after the room's SafeToReuse): here, vLLM's `get_finished` / load-error sets."""
        spec = ld.spec
        # An aborted request is gone from the scheduler: its blocks are freed, not recomputed
        # (naming them invalid could hit the request they go to next).
        if not ok and not ld.aborted:
            self._errors.update(spec.block_ids[spec.first_token // self.block_size :])
        self._finished.add(spec.req_id)

    def _hold(self, att, ld: _Load, ok: bool) -> None:
        """The room of `ld` is Finished or Aborted: its blocks go back once its SafeToReuse is
        here (maybe already), the attach is gone, or `release_timeout_s` passed."""
        key = (ld.room.room_id, ld.room.generation)
        with self._lock:
            if self._early.pop(key, None) is not None or self._att is not att:
                self._done(ld, ok)
            else:
                self._held[key] = (ld, ok, time.monotonic() + self.release_timeout_s)

    # -- per step ------------------------------------------------------------------------------

    def start(self, meta) -> None:
        """Starts the step's loads on the load threads and hands its aborts to the abort thread.
        An abort without a live load was already reported (a load always reaches this side in
        the step's metadata before its abort): it is ignored, so that no request is reported
        twice."""
        for spec in meta.loads:
            ld = _Load(spec)
            with self._lock:
                self._loads[spec.req_id] = ld
            self._pool.submit(self._run, ld)
        for req_id in meta.aborts:
            with self._lock:
                ld = self._loads.get(req_id)
                if ld is None or ld.aborted:
                    continue
                ld.aborted = True
                room, att = ld.room, self._att
                self.stats["aborted"] += 1
            if room is not None and att is not None:
                self._aborter.submit(self._abort, att, room)

    def take_finished(self):
        """(None, the requests whose blocks the engine may have back), as vLLM's `get_finished`
        answers."""
        with self._lock:
            out, self._finished = self._finished, set()
        return None, out or None

    def take_load_errors(self):
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    # -- one load ------------------------------------------------------------------------------

    def _abort(self, att, room) -> None:
        try:
            self.client.unary(self.client.decode, "Abort", pb.AbortRequest(attach_id=att.id, room=room, reason=pb.FAILURE_REASON_CLIENT_ABORT))
        except errors.TandemError as e:
            logger.info("tandem: Abort of room %d: %s", room.room_id, e)

    def _reserve(self, att, spec: LoadSpec, end: float):
        """Reserve, retried on NO_FREE_PAGES (after the next release, within the KV deadline)."""
        req = pb.ReserveRequest(
            attach_id=att.id,
            request_id=spec.tandem_id,
            tokens=spec.prompt_tokens,
            kv_deadline_ms=spec.kv_deadline_ms,
            hand_off_token=spec.token,
        )
        while True:
            try:
                return self.client.unary(self.client.decode, "Reserve", req)
            except errors.NoFreePages:
                with self._lock:
                    seq = self._max_seq
                    left = end - time.monotonic()
                    if left <= 0 or self._att is not att:
                        raise
                    self._cv.wait_for(lambda: self._max_seq > seq or self._att is not att, min(left, 1.0))

    def _await_kv(self, att, room, end: float):
        """AwaitKv until the room completes or fails, or the connector's deadline `end` passes
        (each call bounded below the worker's per-call maximum, 30 s by default)."""
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            try:
                return self.client.unary(self.client.decode, "AwaitKv", pb.AwaitKvRequest(attach_id=att.id, room=room), timeout=min(left, 25.0))
            except (errors.DeadlineExceeded, errors.CallTimeout):
                continue

    def _run(self, ld: _Load) -> None:
        spec = ld.spec
        ok = False
        att = None
        try:
            if ld.aborted:
                return
            att = self._session()
            end = time.monotonic() + spec.kv_deadline_ms / 1000.0 + self.kv_slack_s
            r = self._reserve(att, spec, end)
            with self._lock:
                ld.room = r.room
                aborted = ld.aborted
            if aborted:
                self._abort(att, r.room)
            got = self._await_kv(att, r.room, end)
            outcome = None if got is None else got.WhichOneof("outcome")
            if outcome == "complete" and not ld.aborted:
                self._until_seq(r.after_release)
                self._copy(att.pool(), list(r.pages), spec)
                with self._lock:
                    self.stats["pages_copied"] += len(r.pages)
                self.client.unary(self.client.decode, "Finish", pb.FinishRequest(attach_id=att.id, room=r.room))
                ok = True
            elif outcome == "failed":
                logger.info("tandem: request %s: room %d failed: %s", spec.req_id, r.room.room_id, got.failed.message)
            else:
                self._abort(att, r.room)
        except errors.TandemError as e:
            logger.warning("tandem: request %s (tandem %d): load failed: %s", spec.req_id, spec.tandem_id, e)
            if ld.room is not None and att is not None:
                self._abort(att, ld.room)
            if isinstance(e, (errors.NotAttached, errors.WorkerUnavailable)) and att is not None:
                self._lost(att, e)
        except Exception as e:  # never let a load thread die with the request's blocks held
            logger.exception("tandem: request %s: load failed: %r", spec.req_id, e)
            if ld.room is not None and att is not None:
                self._abort(att, ld.room)
        finally:
            if ld.room is not None:
                self._hold(att, ld, ok)
            else:
                with self._lock:
                    self._done(ld, False)

    def _until_seq(self, seq: int) -> None:
        """Waits (bounded by `timeout_s`) until SafeToReuse `seq` of this attach has arrived: the
        Reserve reply can overtake the release that freed its pages (engine.proto)."""
        end = time.monotonic() + self.timeout_s
        with self._lock:
            while self._max_seq < seq and self._att is not None:
                left = end - time.monotonic()
                if left <= 0:
                    raise errors.CallTimeout(f"SafeToReuse {seq} did not arrive within {self.timeout_s}s")
                self._cv.wait(left)

    def _copy(self, pool, pages, spec: LoadSpec) -> None:
        """Copies tokens [spec.first_token, spec.prompt_tokens) of the room's `pages` (the pool's
        page rows) into the request's blocks (the engine's subclass)."""
        raise NotImplementedError

    def close(self) -> None:
        self._aborter.shutdown(wait=False, cancel_futures=True)
        super().close()


class PrefillSender(EngineSide):
    """The prefill's worker side: the rooms the worker asks for (`Prefill.WatchWork`), the pool's
    free pages (`WatchSourceFree`), and the send threads. For each request that computed its
    prompt: wait (within its KV deadline plus `kv_slack_s`) for the room the decode opened under
    the front door's id, copy the request's blocks into free pages of the worker's pool (K half,
    V half of each row), `PagesReady(last)`, and report the send (vLLM's `finished_sending`: the engine frees
    the blocks). The worker moves the pages to the decode and returns them on SourceFree."""

    def __init__(self, extra: dict, block_size: int):
        super().__init__(extra, block_size)
        self._work = {}  # front door id -> (PrefillWork, when to forget it)
        self._free = []
        self._sent = set()
        self.stats = {"sent": 0, "no_room": 0, "refused": 0, "failed": 0, "wrong_token": 0}

    def _on_attach(self, att) -> None:
        self._work.clear()
        self._free = list(range(att.pool().page_count))
        self._watch(att, "work", self.client.prefill, "WatchWork", pb.WatchWorkRequest(attach_id=att.id), self._on_work)
        self._watch(att, "source-free", self.client.prefill, "WatchSourceFree", pb.WatchSourceFreeRequest(attach_id=att.id), self._on_free)

    def _on_work(self, w) -> None:
        self._work[w.request_id] = (w, time.monotonic() + w.deadline_ms / 1000.0 + self.kv_slack_s)

    def _tick(self) -> None:
        """Forgets rooms no send took within their deadline (the decode's room has failed)."""
        now = time.monotonic()
        with self._lock:
            for k in [k for k, (_, until) in self._work.items() if until <= now]:
                del self._work[k]

    def _on_free(self, ev) -> None:
        self._free.extend(ev.pages)

    def start(self, meta) -> None:
        for spec in meta.sends:
            self._pool.submit(self._send, spec)

    def take_finished(self):
        """(the requests whose blocks the engine may free, None), as vLLM's `get_finished`
        answers."""
        with self._lock:
            out, self._sent = self._sent, set()
        return out or None, None

    def _send(self, spec: SendSpec) -> None:
        outcome = "failed"
        try:
            att = self._session()
            end = time.monotonic() + spec.kv_deadline_ms / 1000.0 + self.kv_slack_s
            pool = att.pool()
            p_tok = pool.descriptor.page_tokens
            with self._lock:
                while spec.tandem_id not in self._work and self._att is att:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                work = self._work.get(spec.tandem_id, (None, 0))[0]
                if work is not None and work.hand_off_token not in (0, spec.token):
                    # Not this request's room (a request sent to this engine directly, naming
                    # another's id): the room stays for the request that carries its token. A
                    # room without a token comes from a decode worker older than the token's
                    # travel to the prefill (a rolling upgrade): matched by id, as it was.
                    outcome = "wrong_token"
                    return
                self._work.pop(spec.tandem_id, None)
                tokens = 0 if work is None else min(int(work.tokens), spec.prompt_tokens)
                need = -(-tokens // p_tok)
                while work is not None and len(self._free) < need and self._att is att:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                if work is None or len(self._free) < need:
                    outcome = "no_room"
                    pages = None
                else:
                    pages, self._free = self._free[:need], self._free[need:]
            if pages is not None:
                try:
                    self._copy_out(pool, pages, spec, tokens)
                except BaseException:
                    with self._lock:  # the worker never saw them: they are free again
                        self._free.extend(pages)
                    raise
                # A PagesReady that fails may still have reached the worker (a timeout): its pages
                # then come back on SourceFree, or with the next attach — never put back here.
                reply = self.client.pages_ready(att.id, work.room, pages, first_page=0, last=True)
                outcome = "sent" if reply.accepted else "refused"
        except errors.TandemError as e:
            logger.warning("tandem: request %s (tandem %d): send failed: %s", spec.req_id, spec.tandem_id, e)
        except Exception as e:  # never let a send thread die with the request's blocks held
            logger.exception("tandem: request %s: send failed: %r", spec.req_id, e)
        finally:
            if outcome == "wrong_token":
                logger.warning("tandem: request %s names room of tandem request %d with another hand-off token: nothing sent", spec.req_id, spec.tandem_id)
            elif outcome != "sent":
                logger.info("tandem: request %s (tandem %d): %s", spec.req_id, spec.tandem_id, outcome)
            with self._lock:
                self.stats[outcome] += 1
                self._report_sent(spec, outcome)

    def _report_sent(self, spec: SendSpec, outcome: str) -> None:
        """Tells the engine that `spec`'s blocks are its own again (called with the lock held,
        once per send; `outcome` is a `stats` key): here, vLLM's `get_finished` set."""
        self._sent.add(spec.req_id)

    def _copy_out(self, pool, pages, spec: SendSpec, tokens: int) -> None:
        """Copies tokens [0, tokens) of `spec`'s blocks into the pool's `pages` (the engine's
        subclass)."""
        raise NotImplementedError
