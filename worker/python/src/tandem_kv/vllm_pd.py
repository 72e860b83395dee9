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
forward pass). Extra config keys: those of `tandem_kv.pd` (`model` is required; `engine` defaults
to `vllm/<version>`). The protocol drivers (attach, loads, sends, release holds) live in
`tandem_kv.pd`; this module adds vLLM's scheduler side and its per-layer KV views.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import numpy as np

from . import pd
from .pd import LoadSpec, SendSpec, _Load  # noqa: F401  (the connector's specs; tests build them)

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


class _VllmViews:
    """vLLM's KV for the engine sides: its per-layer views, registered by `register`."""

    _layers = ()  # (name, vLLM's [kernel blocks, heads, tokens, 2 x dim] view) in model order
    _kernel_block = 0

    @staticmethod
    def default_engine() -> str:
        return _vllm_engine()

    def register(self, kv_caches) -> None:
        """Takes vLLM's per-layer KV views: `[kernel blocks, kv_heads, kernel block tokens,
        2 * head_size]` (K then V on the last axis, vLLM 0.33's `allocate_kv_cache`; any stride
        order), then attaches. `ValueError` when their count or shape is not the model's
        attention (MLA caches, without a K/V split, are not served by this connector)."""
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
        self.open_session()

    def _row_bytes(self):
        if not self._layers:
            return None
        kv = self._layers[0][1]
        return kv.shape[1] * kv.shape[3] * kv.element_size()

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

    def _copy(self, pool, pages, spec: LoadSpec) -> None:
        """Copies tokens [first_token, prompt_tokens) of the room's pages into the request's
        blocks: per layer one gather from the pool and one indexed write into vLLM's view."""
        rows = self._rows(pool)
        page, prow, kb, row = self._index(pages, spec.block_ids, spec.first_token, spec.prompt_tokens, rows.shape[2])
        for li, (_, kv) in enumerate(self._layers):
            kv[kb.to(kv.device), :, row.to(kv.device)] = self._from_rows(rows[page, li, prow], kv)

    def _copy_out(self, pool, pages, spec, tokens: int) -> None:
        """Copies tokens [0, tokens) of the request's blocks into `pages`: per layer one indexed
        read of vLLM's view and one scatter into the pool."""
        rows = self._rows(pool)
        page, prow, kb, row = self._index(pages, spec.block_ids, 0, tokens, rows.shape[2])
        for li, (_, kv) in enumerate(self._layers):
            rows[page, li, prow] = self._to_rows(kv[kb.to(kv.device), :, row.to(kv.device)], rows.shape[4])


class DecodeLoader(_VllmViews, pd.DecodeLoader):
    """The decode's worker side over vLLM's views (`pd.DecodeLoader`)."""


class PrefillSender(_VllmViews, pd.PrefillSender):
    """The prefill's worker side over vLLM's views (`pd.PrefillSender`)."""


def _torch():
    import torch

    return torch


def _vllm_engine() -> str:
    try:
        import vllm

        return f"vllm/{vllm.__version__}"
    except Exception:  # pragma: no cover
        return "vllm/unknown"
