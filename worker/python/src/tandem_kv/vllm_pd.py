"""`TandemConnector`: vLLM's KV connector for prefill/decode disaggregation through Tandem, both
sides (`kv_role` `kv_producer` on a PrefillPool's engine, `kv_consumer` on a DecodePool's).

Written against vLLM 0.33.0 (`KVConnectorBase_V1`, `vllm/distributed/kv_transfer/kv_connector/v1/
base.py`), loaded by module path (no registration, no vLLM patch):

    --kv-transfer-config '{"kv_connector": "TandemConnector", "kv_role": "kv_consumer",
      "kv_connector_module_path": "tandem_kv.vllm_pd", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"socket_dir": "/run/tandem/engine",
        "model": {"name": "llama-3-70b", "layers": 80, "attention": "gqa",
                  "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}}}'

The request path (README "Engines on Kubernetes"). The decode worker's front door admits the
client's request, picks the prefill and hands the request to both engines' HTTP APIs with
`kv_transfer_params.tandem` naming its request id (`worker/src/roles/decode/own_api.rs`): the
chosen prefill's engine gets it with `do_remote_decode` (one token), the decode's with
`do_remote_prefill`.

Decode (consumer):
1. Scheduler side: `get_num_new_matched_tokens` answers every prompt token not cached locally as
   external and loaded asynchronously; `update_state_after_alloc` records the blocks vLLM
   allocated; `build_connector_meta` hands the load to the worker side. One load per request.
2. Worker side (`start_load_kv`, non-blocking): a load thread `Reserve`s the room under the front
   door's request id and hand-off token (the worker opens it on the prefill peer it chose, into
   its pool; a Reserve without the token opens nothing, so a client that reaches vLLM's API
   directly cannot claim another request's room), awaits
   the KV (`AwaitKv`, bounded by the KV deadline plus `kv_slack_s`), copies the room's pages
   into the request's blocks (a worker page row is K of every head, then V of every head; vLLM
   0.33's per-layer views are `[kernel blocks, kv_heads, tokens, 2 x head_size]`, any stride
   order) and `Finish`es the room.
3. The request's blocks go back to the scheduler (`get_finished` → `finished_recving`) only once
   the worker's `SafeToReuse` for its room arrived: the gate's proof that no write of the room
   can land any more. A failed room (KV deadline, lost prefill) reports its blocks in
   `get_block_ids_with_load_errors` after its SafeToReuse: vLLM then recomputes them locally with
   `"kv_load_failure_policy": "recompute"` (what a Tandem decode wants), or ends the request with
   finish reason `error` under its default, `fail`.
4. Abort (the client went away, vLLM's `finish_requests`): vLLM holds the blocks of a request
   waiting for remote KV until `finished_recving`; `request_finished` passes the abort to the
   worker side, which `Abort`s the room and reports the request only after its SafeToReuse.
   In this version the prefill writes into the worker's pool and this connector copies into
   vLLM's blocks, so the rule also covers that copy; it is the rule that keeps the blocks safe
   when the pool is the engine's own memory (seed 003's failure: blocks reused while a late
   write could still land).

Prefill (producer): a request that computed its prompt (finished with its one token) keeps its
blocks (`request_finished` answers True); the worker side waits for the room the decode opened
under the front door's id (`Prefill.WatchWork`, within the KV deadline plus `kv_slack_s`; a room
whose `hand_off_token` is not the request's own is left alone and nothing is sent, so a client
that reaches this engine's API directly cannot write another request's room), copies
the blocks into free pages of the worker's pool, calls `PagesReady(last)` and reports the send
(`finished_sending`): vLLM frees the blocks, the worker moves the pages to the decode and gives
them back on `SourceFree`. An aborted prefill sends nothing (the decode's room fails at its KV
deadline).

Not here: a decode that both Reserves rooms and serves the tier calls from one pool (the worker's
front door refuses hand-offs then), layer-by-layer sends (the whole prompt moves after the
forward pass). Extra config keys: `model` (required: the worker config's `model`), `socket_dir`
(default `$TANDEM_ENGINE_SOCKET_DIR` or `/run/tandem/engine`), `timeout_s` (5.0: each call),
`kv_slack_s` (5.0), `release_timeout_s` (600: the longest a decode request's blocks wait for its
SafeToReuse; past it they are handed back, logged and counted), `load_threads` (16: transfers in
flight), `keepalive_s` (2.0: how often the attach is checked and restored without requests; 0
turns it off), `engine` (`vllm/<version>`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from . import errors
from ._pb import engine_pb2 as pb
from .client import EngineClient, engine_identity

logger = logging.getLogger(__name__)

try:  # vLLM present (the serving image): subclass its ABCs so vLLM's factory accepts the class.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.v1.request import RequestStatus
except Exception:  # pragma: no cover - no vLLM: the module imports, the connector cannot be built.
    KVConnectorBase_V1 = object  # type: ignore[misc,assignment]

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    KVConnectorRole = RequestStatus = None  # type: ignore[assignment]


def tandem_params(request):
    """The front door's `kv_transfer_params["tandem"]` of a vLLM `Request`, or None (a request
    that did not come through Tandem's front door: the connector leaves it alone)."""
    p = getattr(request, "kv_transfer_params", None)
    t = p.get("tandem") if isinstance(p, dict) else None
    if not isinstance(t, dict) or not isinstance(t.get("request_id"), int) or t["request_id"] <= 0:
        return None
    return t


@dataclass
class LoadSpec:
    """One request's load: vLLM's id, the front door's id, the prompt's tokens, the first token
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
    """One prefill request's send: vLLM's id, the front door's id, the prompt's tokens, the
    request's blocks from token 0 (held by vLLM until the send is reported), how long the
    decode waits for the KV, and the hand-off token (`kv_transfer_params.tandem.token`: the KV
    goes only into a room Reserved with the same token)."""

    req_id: str
    tandem_id: int
    kv_deadline_ms: int
    prompt_tokens: int
    block_ids: list
    token: int = 0


@dataclass
class TandemConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step: loads to start (decode), requests whose loads end now
    (decode), and sends to start (prefill)."""

    loads: list = field(default_factory=list)
    aborts: list = field(default_factory=list)
    sends: list = field(default_factory=list)


def layer_order(names):
    """vLLM's attention layer names in model order (by the last integer in each name).
    `ValueError` for a name without one."""

    def index(n):
        m = re.findall(r"\d+", n)
        if not m:
            raise ValueError(f"no layer index in {n!r}")
        return int(m[-1])

    return sorted(names, key=index)


class TandemConnector(KVConnectorBase_V1):
    """The connector vLLM builds twice: in the scheduler (`role` SCHEDULER) and in each worker
    process (`role` WORKER); see the module docstring."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = int(vllm_config.cache_config.block_size)
        self._groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or [None])
        kv_role = vllm_config.kv_transfer_config.kv_role
        if kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(
                f"TandemConnector needs kv_role kv_producer (a PrefillPool's engine) or kv_consumer "
                f"(a DecodePool's), not {kv_role!r}"
            )
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(producer=kv_role == "kv_producer")
            self._loader = None
        else:
            self._sched = None
            side = PrefillSender if kv_role == "kv_producer" else DecodeLoader
            self._loader = side(extra, self.block_size)

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens > 0:
            self._sched.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._sched.meta()

    def update_connector_output(self, connector_output):
        self._sched.finished(connector_output.finished_recving or ())

    def request_finished(self, request, block_ids):
        # Decode: vLLM itself holds the blocks of a request waiting for remote KV until
        # `finished_recving` (Scheduler.finish_requests); the worker side reports it only after the
        # room's SafeToReuse. Prefill: a request that computed its prompt keeps its blocks until
        # the worker side reported the send (`finished_sending`).
        return self._sched.ended(request, block_ids), None

    def get_loaded_kv_cache_group_ids(self, request):
        return tuple(range(self._groups))

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self._loader.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        self._loader.start(meta)

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None

    def get_finished(self, finished_req_ids):
        return self._loader.take_finished()

    def get_block_ids_with_load_errors(self):
        return self._loader.take_load_errors() if isinstance(self._loader, DecodeLoader) else set()

    def shutdown(self):
        if self._loader is not None:
            self._loader.close()


class _SchedulerSide:
    """The scheduler's bookkeeping: loads not yet handed to the worker side, requests whose loads
    are in flight, and requests that ended while loading."""

    def __init__(self, producer: bool):
        # A producer (prefill) only sends, a consumer (decode) only loads, whatever a request's
        # transfer parameters say: a request that reaches an engine directly cannot make it hold
        # blocks for a transfer its worker side never runs.
        self.producer = producer
        self._pending = []
        self._loading = set()
        # Requests whose one load was started: a failed load is recomputed by vLLM (or fails the
        # request), never loaded again — the front door's room is spent.
        self._tried = set()
        self._aborts = []
        self._sends = []

    def matched(self, request, num_computed_tokens):
        t = tandem_params(request)
        if self.producer or t is None or not request.kv_transfer_params.get("do_remote_prefill") or request.request_id in self._tried:
            return 0, False
        n = int(request.num_prompt_tokens) - int(num_computed_tokens)
        return (n, True) if n > 0 else (0, False)

    def allocated(self, request, block_ids, num_external_tokens):
        t = tandem_params(request)
        if t is None:
            return
        prompt = int(request.num_prompt_tokens)
        self._pending.append(
            LoadSpec(
                req_id=request.request_id,
                tandem_id=int(t["request_id"]),
                kv_deadline_ms=max(1, int(t.get("kv_deadline_ms") or 30_000)),
                prompt_tokens=prompt,
                first_token=prompt - int(num_external_tokens),
                block_ids=list(block_ids),
                token=int(t.get("token") or 0),
            )
        )
        self._loading.add(request.request_id)
        self._tried.add(request.request_id)

    def meta(self):
        m = TandemConnectorMetadata(loads=self._pending, aborts=self._aborts, sends=self._sends)
        self._pending, self._aborts, self._sends = [], [], []
        return m

    def finished(self, req_ids):
        self._loading.difference_update(req_ids)

    def ended(self, request, block_ids) -> bool:
        """A request finished (any reason); whether vLLM must hold its blocks for a send."""
        req_id = request.request_id
        self._tried.discard(req_id)
        if req_id in self._loading:
            self._aborts.append(req_id)
        t = tandem_params(request)
        sends = self.producer and t is not None and bool(request.kv_transfer_params.get("do_remote_decode"))
        # Only a prompt computed to its end has KV to send (an aborted prefill has none: the
        # decode's room fails at its KV deadline).
        if not sends or request.status != RequestStatus.FINISHED_LENGTH_CAPPED and request.status != RequestStatus.FINISHED_STOPPED:
            return False
        self._sends.append(
            SendSpec(
                req_id=req_id,
                tandem_id=int(t["request_id"]),
                kv_deadline_ms=max(1, int(t.get("kv_deadline_ms") or 30_000)),
                prompt_tokens=int(request.num_prompt_tokens),
                block_ids=list(block_ids),
                token=int(t.get("token") or 0),
            )
        )
        return True


@dataclass
class _Load:
    spec: LoadSpec
    room: object = None
    aborted: bool = False


class _EngineSide:
    """What both worker sides share: the config, the attach (with its watch threads, started by
    `_on_attach`), vLLM's KV tensors and the worker pool's rows. Thread-safe."""

    def __init__(self, extra: dict, block_size: int):
        if not isinstance(extra.get("model"), dict):
            raise ValueError("kv_connector_extra_config.model (the worker config's model) is required")
        self.model = extra["model"]
        self.block_size = int(block_size)
        self.socket_dir = extra.get("socket_dir") or os.environ.get("TANDEM_ENGINE_SOCKET_DIR") or "/run/tandem/engine"
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.kv_slack_s = float(extra.get("kv_slack_s", 5.0))
        self.engine = extra.get("engine") or _vllm_engine()
        self.client = EngineClient(self.socket_dir, call_timeout=self.timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=int(extra.get("load_threads", 16)), thread_name_prefix="tandem-kv")
        self._lock = threading.Lock()
        self._attach_lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._att = None
        self._layers = []  # (name, vLLM's [kernel blocks, heads, tokens, 2 x dim] view) in model order
        self._kernel_block = int(block_size)
        self._closing = threading.Event()
        self.keepalive_s = float(extra.get("keepalive_s", 2.0))
        self._keepalive = None

    # -- setup ---------------------------------------------------------------------------------

    def register(self, kv_caches) -> None:
        """Takes vLLM's per-layer KV views: `[kernel blocks, kv_heads, kernel block tokens,
        2 * head_size]` (K then V on the last axis, vLLM 0.33's `allocate_kv_cache`; any stride
        order). `ValueError` when their count or shape is not the model's attention (MLA caches,
        without a K/V split, are not served by this connector)."""
        names = layer_order(list(kv_caches))
        if len(names) != int(self.model["layers"]):
            raise ValueError(f"{len(names)} KV layers for a model of {self.model['layers']}")
        heads, dim = int(self.model.get("kv_heads", 0)), int(self.model.get("head_dim", 0))
        layers = []
        for n in names:
            t = kv_caches[n]
            if t.dim() != 4 or t.shape[1] != heads or t.shape[3] != 2 * dim or self.block_size % t.shape[2]:
                raise ValueError(
                    f"layer {n}: KV view {tuple(t.shape)} is not [blocks, {heads} heads, tokens dividing "
                    f"{self.block_size}, 2 x {dim}]"
                )
            layers.append((n, t))
        self._layers = layers
        self._kernel_block = int(layers[0][1].shape[2])
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
        if self._layers:
            kv = self._layers[0][1]
            ours = kv.shape[1] * kv.shape[3] * kv.element_size()
            if ours != row:
                att.close()
                raise errors.PoolsError(f"a page row of the worker is {row} B; vLLM's K+V row of a token and layer is {ours} B")
        with self._lock:
            if self._att is not None:  # another thread attached meanwhile
                att.close()
                return self._att
            self._att = att
            self._on_attach(att)
        logger.info("tandem: vLLM connector attached (id %d, %d pages of %d B)", att.id, pool.page_count, pool.page_bytes)
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

    def _index(self, pages, block_ids, first: int, last: int, p_tok: int):
        """For tokens [first, last): (page, page row) as numpy arrays and (kernel block, row) as
        torch tensors (a scheduler block of `block_size` tokens is `block_size / kernel block`
        consecutive kernel blocks)."""
        torch = _torch()
        t = np.arange(first, last)
        page = np.asarray(pages, dtype=np.int64)[t // p_tok]
        prow = t % p_tok
        kb_size = self._kernel_block
        sblock = np.asarray(block_ids, dtype=np.int64)[t // self.block_size]
        kb = sblock * (self.block_size // kb_size) + (t % self.block_size) // kb_size
        return page, prow, torch.from_numpy(kb), torch.from_numpy(t % kb_size)

    def _to_rows(self, vals, half: int):
        """vLLM's `(T, heads, 2 x dim)` values as the worker's `(T, 2, half)` row bytes: K of every
        head, then V of every head."""
        n, h, c = vals.shape
        kv = vals.reshape(n, h, 2, c // 2).permute(0, 2, 1, 3).contiguous().cpu()
        return kv.view(_torch().uint8).reshape(n, 2, half).numpy()

    def _from_rows(self, src, kv):
        """The worker's `(T, 2, half)` row bytes as vLLM's `(T, heads, 2 x dim)` values of `kv`'s
        dtype, on `kv`'s device."""
        torch = _torch()
        n, h, c = src.shape[0], kv.shape[1], kv.shape[3]
        vals = torch.from_numpy(np.ascontiguousarray(src)).view(kv.dtype).reshape(n, 2, h, c // 2)
        return vals.permute(0, 2, 1, 3).reshape(n, h, c).to(kv.device)

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


class DecodeLoader(_EngineSide):
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
        """The request's blocks go back to vLLM (called with the lock held), as load errors
        unless `ok`."""
        spec = ld.spec
        self._loads.pop(spec.req_id, None)
        if ok:
            self.stats["loaded"] += 1
        else:
            self.stats["failed"] += 1
            # An aborted request is gone from the scheduler: its blocks are freed, not recomputed
            # (naming them invalid could hit the request they go to next).
            if not ld.aborted:
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
        """(None, the requests whose blocks vLLM may have back), as `get_finished` answers."""
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
        """Copies tokens [first_token, prompt_tokens) of the room's pages into the request's
        blocks: per layer one gather from the pool and one indexed write into vLLM's view."""
        rows = self._rows(pool)
        page, prow, kb, row = self._index(pages, spec.block_ids, spec.first_token, spec.prompt_tokens, rows.shape[2])
        for li, (_, kv) in enumerate(self._layers):
            kv[kb.to(kv.device), :, row.to(kv.device)] = self._from_rows(rows[page, li, prow], kv)
        with self._lock:
            self.stats["pages_copied"] += len(pages)

    def close(self) -> None:
        self._aborter.shutdown(wait=False, cancel_futures=True)
        super().close()


class PrefillSender(_EngineSide):
    """The prefill's worker side: the rooms the worker asks for (`Prefill.WatchWork`), the pool's
    free pages (`WatchSourceFree`), and the send threads. For each request that computed its
    prompt: wait (within its KV deadline plus `kv_slack_s`) for the room the decode opened under
    the front door's id, copy the request's blocks into free pages of the worker's pool (K half,
    V half of each row), `PagesReady(last)`, and report the send (`finished_sending`: vLLM frees
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
        """(the requests whose blocks vLLM may free, None), as `get_finished` answers."""
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
                if work is not None and work.hand_off_token != spec.token:
                    # Not this request's room (a request sent to this engine directly, naming
                    # another's id): the room stays for the request that carries its token.
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
                    self._copy_out(pool, pages, spec.block_ids, tokens)
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
                self._sent.add(spec.req_id)

    def _copy_out(self, pool, pages, block_ids, tokens: int) -> None:
        """Copies tokens [0, tokens) of the request's blocks into `pages`: per layer one indexed
        read of vLLM's view and one scatter into the pool."""
        rows = self._rows(pool)
        page, prow, kb, row = self._index(pages, block_ids, 0, tokens, rows.shape[2])
        for li, (_, kv) in enumerate(self._layers):
            rows[page, li, prow] = self._to_rows(kv[kb.to(kv.device), :, row.to(kv.device)], rows.shape[4])


def _torch():
    import torch

    return torch


def _vllm_engine() -> str:
    try:
        import vllm

        return f"vllm/{vllm.__version__}"
    except Exception:  # pragma: no cover
        return "vllm/unknown"
