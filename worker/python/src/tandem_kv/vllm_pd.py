"""`TandemConnector`: vLLM's KV connector for prefill/decode disaggregation through Tandem — the
decode side (the KV consumer).

Written against vLLM 0.33.0 (`KVConnectorBase_V1`, `vllm/distributed/kv_transfer/kv_connector/v1/
base.py`), loaded by module path (no registration, no vLLM patch):

    --kv-transfer-config '{"kv_connector": "TandemConnector", "kv_role": "kv_consumer",
      "kv_connector_module_path": "tandem_kv.vllm_pd",
      "kv_connector_extra_config": {"socket_dir": "/run/tandem/engine",
        "model": {"name": "llama-3-70b", "layers": 80, "attention": "gqa",
                  "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}}}'

The request path (README "Engines on Kubernetes"). The decode worker's front door admits the
client's request, picks the prefill and hands the request to this engine's HTTP API with
`kv_transfer_params: {"tandem": {"request_id", "kv_deadline_ms", ...}, "do_remote_prefill": true}`
(`worker/src/roles/decode/own_api.rs`). For such a request:

1. Scheduler side: `get_num_new_matched_tokens` answers every prompt token not cached locally as
   external and loaded asynchronously; `update_state_after_alloc` records the blocks vLLM
   allocated; `build_connector_meta` hands the load to the worker side.
2. Worker side (`start_load_kv`, non-blocking): a load thread `Reserve`s the room under the front
   door's request id (the worker opens it on the prefill peer it chose, into its pool), awaits
   the KV (`AwaitKv`, bounded by the KV deadline plus `kv_slack_s`), copies the room's pages
   into the request's blocks (each page row: the K half, then the V half — vLLM's
   `(2, num_blocks, block_size, kv_heads, head_size)` layer tensors) and `Finish`es the room.
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

Not here yet: the prefill side (a producer whose prefill's blocks become a room's source pages),
and a decode that both Reserves rooms and serves the tier calls from one pool (the worker's front
door refuses hand-offs then). Extra config keys: `model` (required: the worker config's `model`),
`socket_dir` (default `$TANDEM_ENGINE_SOCKET_DIR` or `/run/tandem/engine`), `timeout_s` (5.0: each
call), `kv_slack_s` (5.0), `release_timeout_s` (600: the longest a request's blocks wait for its
SafeToReuse; past it they are handed back, logged and counted), `load_threads` (4), `engine`
(`vllm/<version>`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
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
except Exception:  # pragma: no cover - no vLLM: the module imports, the connector cannot be built.
    KVConnectorBase_V1 = object  # type: ignore[misc,assignment]

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    KVConnectorRole = None  # type: ignore[assignment]


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


@dataclass
class TandemConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step: loads to start, and requests whose loads end now."""

    loads: list = field(default_factory=list)
    aborts: list = field(default_factory=list)


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
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide()
            self._loader = None
        else:
            self._sched = None
            self._loader = DecodeLoader(extra, self.block_size)

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
        # vLLM itself holds the blocks of a request waiting for remote KV until `finished_recving`
        # (Scheduler.finish_requests); the worker side reports it only after the room's SafeToReuse.
        self._sched.ended(request.request_id)
        return False, None

    def get_loaded_kv_cache_group_ids(self, request):
        return tuple(range(self._groups))

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self._loader.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        self._loader.start(meta.loads, meta.aborts)

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None

    def get_finished(self, finished_req_ids):
        return None, self._loader.take_finished()

    def get_block_ids_with_load_errors(self):
        return self._loader.take_load_errors()

    def shutdown(self):
        if self._loader is not None:
            self._loader.close()


class _SchedulerSide:
    """The scheduler's bookkeeping: loads not yet handed to the worker side, requests whose loads
    are in flight, and requests that ended while loading."""

    def __init__(self):
        self._pending = []
        self._loading = set()
        # Requests whose one load was started: a failed load is recomputed by vLLM (or fails the
        # request), never loaded again — the front door's room is spent.
        self._tried = set()
        self._aborts = []

    def matched(self, request, num_computed_tokens):
        t = tandem_params(request)
        if t is None or request.request_id in self._tried:
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
            )
        )
        self._loading.add(request.request_id)
        self._tried.add(request.request_id)

    def meta(self):
        m = TandemConnectorMetadata(loads=self._pending, aborts=self._aborts)
        self._pending, self._aborts = [], []
        return m

    def finished(self, req_ids):
        self._loading.difference_update(req_ids)

    def ended(self, req_id):
        self._tried.discard(req_id)
        if req_id in self._loading:
            self._aborts.append(req_id)


@dataclass
class _Load:
    spec: LoadSpec
    room: object = None
    aborted: bool = False


class DecodeLoader:
    """The worker side: the attach, the release watch and the load threads (module docstring).
    Thread-safe; `start` never blocks on the worker."""

    def __init__(self, extra: dict, block_size: int):
        if not isinstance(extra.get("model"), dict):
            raise ValueError("kv_connector_extra_config.model (the worker config's model) is required")
        self.model = extra["model"]
        self.block_size = int(block_size)
        self.socket_dir = extra.get("socket_dir") or os.environ.get("TANDEM_ENGINE_SOCKET_DIR") or "/run/tandem/engine"
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.kv_slack_s = float(extra.get("kv_slack_s", 5.0))
        self.release_timeout_s = float(extra.get("release_timeout_s", 600.0))
        self.engine = extra.get("engine") or _vllm_engine()
        self.client = EngineClient(self.socket_dir, call_timeout=self.timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=int(extra.get("load_threads", 4)), thread_name_prefix="tandem-load")
        self._lock = threading.Lock()
        self._released_cv = threading.Condition(self._lock)
        self._att = None
        self._layers = []  # (name, uint8 view (2, num_blocks, block_size, row_half)) in model order
        self._loads = {}  # req_id -> _Load
        self._finished = set()
        self._errors = set()
        self._released = {}  # (room, generation) -> seq
        self._max_seq = 0
        self._closing = threading.Event()
        self._watch = None
        self.stats = {"loaded": 0, "failed": 0, "aborted": 0, "release_timeouts": 0, "pages_copied": 0}

    # -- setup ---------------------------------------------------------------------------------

    def register(self, kv_caches) -> None:
        """Takes vLLM's per-layer KV tensors (`(2, num_blocks, block_size, kv_heads, head_size)`);
        `ValueError` when their count or shape is not the model's."""
        names = layer_order(list(kv_caches))
        if len(names) != int(self.model["layers"]):
            raise ValueError(f"{len(names)} KV layers for a model of {self.model['layers']}")
        layers = []
        for n in names:
            t = kv_caches[n]
            if t.dim() != 5 or t.shape[0] != 2 or t.shape[2] != self.block_size:
                raise ValueError(f"layer {n}: KV shape {tuple(t.shape)} is not (2, blocks, {self.block_size}, heads, dim)")
            u8 = t.view(-1).view(dtype=_torch().uint8).view(2, t.shape[1], self.block_size, -1)
            layers.append((n, u8))
        self._layers = layers
        self._session()

    def _session(self):
        """The live attach (attaching first); raises `TandemError` when the worker cannot be
        reached or refuses."""
        with self._lock:
            if self._att is not None:
                return self._att
        health = self.client.health()
        att = self.client.attach(engine_identity(self.engine, self.model, health.page_tokens, layout="page_first"))
        pool = att.pool()
        row = pool.chunk_bytes // pool.descriptor.page_tokens
        if self._layers and 2 * self._layers[0][1].shape[3] != row:
            att.close()
            raise errors.PoolsError(f"a page row of the worker is {row} B; vLLM's K+V row is {2 * self._layers[0][1].shape[3]} B")
        with self._lock:
            if self._att is not None:  # another thread attached meanwhile
                att.close()
                return self._att
            self._att = att
            self._released.clear()
            self._max_seq = 0
            self._watch = threading.Thread(target=self._watch_releases, args=(att,), name="tandem-releases", daemon=True)
            self._watch.start()
        logger.info("tandem: vLLM decode connector attached (id %d, %d pages of %d B)", att.id, pool.page_count, pool.page_bytes)
        return att

    def _lost(self, att, why) -> None:
        with self._lock:
            if self._att is not att:
                return
            self._att = None
            self._released_cv.notify_all()
        logger.warning("tandem: attach %d lost (%s)", att.id, why)
        att.close()

    def _watch_releases(self, att) -> None:
        """Records every SafeToReuse of `att` (re-subscribing every hour); ends with the attach."""
        while not self._closing.is_set():
            with self._lock:
                if self._att is not att:
                    return
            try:
                req = pb.WatchReleasesRequest(attach_id=att.id)
                for ev in self.client.stream(self.client.decode, "WatchReleases", req, timeout=3600.0):
                    with self._lock:
                        key = (ev.room.room_id, ev.room.generation)
                        if ev.seq > self._max_seq + 1 and self._max_seq:
                            logger.warning("tandem: releases %d..%d were dropped by the worker", self._max_seq + 1, ev.seq - 1)
                        self._released[key] = ev.seq
                        self._max_seq = max(self._max_seq, ev.seq)
                        self._released_cv.notify_all()
            except (errors.DeadlineExceeded, errors.CallTimeout):
                continue
            except errors.TandemError as e:
                self._lost(att, e)
                return
            except Exception as e:  # a malformed event must not end the watch silently
                logger.exception("tandem: the release watch failed: %r", e)
                self._lost(att, e)
                return

    # -- per step ------------------------------------------------------------------------------

    def start(self, loads, aborts) -> None:
        """Starts `loads` on the load threads and passes `aborts` to theirs (a request without a
        live load is reported finished at once: nothing was reserved for it)."""
        for spec in loads:
            ld = _Load(spec)
            with self._lock:
                self._loads[spec.req_id] = ld
            self._pool.submit(self._run, ld)
        for req_id in aborts:
            with self._lock:
                ld = self._loads.get(req_id)
                if ld is None:
                    self._finished.add(req_id)
                    continue
                ld.aborted = True
                room, att = ld.room, self._att
            self.stats["aborted"] += 1
            if room is not None and att is not None:
                self._abort(att, room)

    def take_finished(self):
        with self._lock:
            out, self._finished = self._finished, set()
        return out or None

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

    def _run(self, ld: _Load) -> None:
        spec = ld.spec
        ok = False
        att = None
        try:
            att = self._session()
            r = self.client.unary(
                self.client.decode,
                "Reserve",
                pb.ReserveRequest(attach_id=att.id, request_id=spec.tandem_id, tokens=spec.prompt_tokens, kv_deadline_ms=spec.kv_deadline_ms),
            )
            with self._lock:
                ld.room = r.room
                aborted = ld.aborted
            if aborted:
                self._abort(att, r.room)
            wait = spec.kv_deadline_ms / 1000.0 + self.kv_slack_s
            got = self.client.unary(self.client.decode, "AwaitKv", pb.AwaitKvRequest(attach_id=att.id, room=r.room), timeout=wait)
            if got.WhichOneof("outcome") == "complete" and not ld.aborted:
                self._until_seq(r.after_release)
                self._copy(att.pool(), list(r.pages), spec)
                self.client.unary(self.client.decode, "Finish", pb.FinishRequest(attach_id=att.id, room=r.room))
                ok = True
            elif got.WhichOneof("outcome") == "failed":
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
                self._await_release(att, ld.room)
            with self._lock:
                self._loads.pop(spec.req_id, None)
                if ok:
                    self.stats["loaded"] += 1
                else:
                    self.stats["failed"] += 1
                    first_block = spec.first_token // self.block_size
                    self._errors.update(spec.block_ids[first_block:])
                self._finished.add(spec.req_id)

    def _until_seq(self, seq: int) -> None:
        """Waits (bounded by `timeout_s`) until SafeToReuse `seq` of this attach has arrived: the
        Reserve reply can overtake the release that freed its pages (engine.proto)."""
        end = time.monotonic() + self.timeout_s
        with self._lock:
            while self._max_seq < seq and self._att is not None:
                left = end - time.monotonic()
                if left <= 0:
                    raise errors.CallTimeout(f"SafeToReuse {seq} did not arrive within {self.timeout_s}s")
                self._released_cv.wait(left)

    def _await_release(self, att, room) -> None:
        """Waits until the room's SafeToReuse arrived, the attach ended (a worker gone can write
        nothing) or `release_timeout_s` passed (logged and counted: the blocks are handed back)."""
        key = (room.room_id, room.generation)
        end = time.monotonic() + self.release_timeout_s
        with self._lock:
            while key not in self._released and self._att is att and att is not None:
                left = end - time.monotonic()
                if left <= 0:
                    self.stats["release_timeouts"] += 1
                    logger.error("tandem: no SafeToReuse for room %d within %.0fs: its blocks are handed back", room.room_id, self.release_timeout_s)
                    return
                self._released_cv.wait(min(left, 1.0))
            self._released.pop(key, None)

    def _copy(self, pool, pages, spec: LoadSpec) -> None:
        """Copies tokens [first_token, prompt_tokens) of the room's pages into the request's
        blocks, layer by layer: each page row's K half to `kv[0]`, its V half to `kv[1]`."""
        torch = _torch()
        p_tok = pool.descriptor.page_tokens
        row = pool.chunk_bytes // p_tok
        half = row // 2
        view = np.frombuffer(pool.map, dtype=np.uint8, count=pool.page_count * pool.page_bytes)
        view = view.reshape(pool.page_count, pool.layers, p_tok, 2, half)
        t = spec.first_token
        while t < spec.prompt_tokens:
            page, prow = pages[t // p_tok], t % p_tok
            block, brow = spec.block_ids[t // self.block_size], t % self.block_size
            n = min(p_tok - prow, self.block_size - brow, spec.prompt_tokens - t)
            for li, (_, kv) in enumerate(self._layers):
                src = torch.from_numpy(view[page, li, prow : prow + n])  # (n, 2, half)
                kv[0, block, brow : brow + n].copy_(src[:, 0])
                kv[1, block, brow : brow + n].copy_(src[:, 1])
            t += n
        self.stats["pages_copied"] += len(pages)

    def close(self) -> None:
        self._closing.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            att, self._att = self._att, None
            self._released_cv.notify_all()
        if att is not None:
            try:
                self.client.detach(att.id)
            except errors.TandemError:
                pass
            att.close()
        self.client.close()


def _torch():
    import torch

    return torch


def _vllm_engine() -> str:
    try:
        import vllm

        return f"vllm/{vllm.__version__}"
    except Exception:  # pragma: no cover
        return "vllm/unknown"
