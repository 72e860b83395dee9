"""SGLang's `tandem` PD transfer backend: prefill/decode disaggregation through Tandem for SGLang
0.5.23 (`--disaggregation-mode prefill|decode --disaggregation-transfer-backend tandem`).

SGLang has no out-of-tree transfer backend option, but it loads *general plugins* in every
process it starts (`sglang.srt.plugins`, entry points; `load_plugins()` runs before the server
arguments are parsed and again in each scheduler process). Installing `tandem-kv` registers
`register` as one (`pyproject.toml`): it adds `tandem` to the backend choices
(`add_disagg_transfer_backend_choices`), adds the member `TANDEM` to SGLang's `TransferBackend`
enum, and wraps `get_kv_class` (an AROUND hook, `HookRegistry`) to answer this module's classes
for it. Nothing else of SGLang is patched; the other backends are untouched.

Config: the environment variable `TANDEM_SGLANG_PD` holds a JSON object with the keys of
`tandem_kv.pd` (`model`, the worker config's model, is required; `socket_dir` defaults to
`$TANDEM_ENGINE_SOCKET_DIR` or `/run/tandem/engine`). The operator renders it.

The request path (README "SGLang prefill/decode through Tandem"). The decode worker's front door
admits the client's request, picks the prefill and sends the request to both engines with
SGLang's PD routing fields (`worker/src/roles/decode/own_api.rs`): `bootstrap_room` = the front
door's request id, `bootstrap_host` = `tandem-<hand-off token, 16 hex digits>-<KV deadline ms>`
(`parse_bootstrap_host`). SGLang hands both, as they are, to the sender (prefill) and the receiver
(decode) it builds for the request. No bootstrap server runs: the worker's rooms are the
rendezvous.

- Decode (`TandemKVReceiver`): once SGLang has allocated the request's pages (`send_metadata`),
  a load thread Reserves the room under the front door's id and token, awaits the KV, copies the
  room's rows into SGLang's K and V buffers (and the trailer into the request's metadata slots,
  below) and Finishes. `poll()` answers `Success` after the copy and `Failed` only after the
  room's SafeToReuse — SGLang frees the pages of a failed or aborted request at once, so no
  write of the room may land after that (seed 003's failure: pages reused while a late write
  could still land). An abort (`abort()`) Aborts the room; the request fails after its release.
- Prefill (`TandemKVSender`): `poll()` answers `Bootstrapping` until the decode's room has
  reached this worker (`Prefill.WatchWork`) with the request's own token, then
  `WaitingForInput`; SGLang computes the prompt and calls `send` (in chunks); after the last
  chunk a send thread copies the request's pages into free pages of the worker's pool and calls
  `PagesReady`; `poll()` answers `Success` once the pages were handed to the worker (SGLang then
  frees its own pages).
- The metadata (SGLang's aux buffers: the first output token, its logprobs, hidden states)
  travel as a trailer in the room: `aux_tokens` more token rows after the KV pages, holding a
  header (magic, a digest of the aux layout, the room) and the request's slot of every aux
  buffer, in order. Both sides size the room from their own buffers; the decode checks the
  header before it writes anything, so a prefill of another metadata layout (other SGLang
  options) fails the request, after its room's release, instead of landing wrong metadata.

A token's K (and V) of one layer is contiguous in SGLang's MHA pool (`[pages, page size, heads,
head dim]` per layer): a worker row is that K, then that V. Buffers are addressed by the
pointers of `KVArgs` (`kv_data_ptrs`: every layer's K, then every layer's V), wrapped as tensors
through `__array_interface__` (CPU) or `__cuda_array_interface__` (CUDA); the aux buffers are
host memory.

Not served (refused at construction, naming each, rather than failing later): MLA pools (no K/V
split), hybrid pools with state buffers (Mamba, SWA, DSA), a KV layer count that is not the
worker model's, tensor or pipeline parallelism above 1 (one engine rank per worker), speculative
decoding (its draft pool), a decode radix cache, `--disaggregation-decode-allocation-policy
prefill_complete`, SGLang's staging buffer. Not tested here: a running SGLang server (its
scheduler needs a model runner; no GPU; its PD queues are played by a test double), CUDA buffers.
SGLang's deferred-release path is not used: this backend answers `Failed` only after the release.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from . import pd
from .pd import LoadSpec, SendSpec

logger = logging.getLogger(__name__)

try:  # SGLang present (the serving image): its ABCs, so SGLang's scheduler accepts the classes.
    from sglang.srt.disaggregation.base.conn import (
        BaseKVBootstrapServer,
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
        KVPoll,
        KVTransferMetric,
    )
except Exception:  # pragma: no cover - no SGLang: the module imports, the classes are plain.
    BaseKVBootstrapServer = BaseKVManager = BaseKVReceiver = BaseKVSender = object  # type: ignore[misc,assignment]

    class KVPoll:  # type: ignore[no-redef]
        Failed, Bootstrapping, WaitingForInput, Transferring, Success = 0, 1, 2, 3, 4

    KVTransferMetric = None  # type: ignore[assignment]

BACKEND = "tandem"
CONFIG_ENV = "TANDEM_SGLANG_PD"
# The metadata trailer's header: magic "TDMA", the aux layout digest (crc32), the room.
TRAILER_HEADER = struct.Struct("<IIQ")
TRAILER_MAGIC = 0x414D4454
_HOST = re.compile(r"^tandem-([0-9a-f]{16})-([0-9]{1,10})$")


def parse_bootstrap_host(addr: str):
    """(hand-off token, KV deadline ms) from SGLang's bootstrap address (`host:port`, the host as
    the front door wrote it: `tandem-<16 hex digits>-<ms>`), or None for any other address (a
    request that did not come through Tandem's front door)."""
    host = addr.rsplit(":", 1)[0] if isinstance(addr, str) else ""
    m = _HOST.match(host.strip("[]"))
    if m is None:
        return None
    return int(m.group(1), 16), max(1, int(m.group(2)))


# -- the plugin -------------------------------------------------------------------------------


def register() -> None:
    """The `sglang.srt.plugins` entry point (run by SGLang's `load_plugins()` in each of its
    processes; idempotent): `tandem` becomes a `--disaggregation-transfer-backend` choice and a
    `TransferBackend` member, and `get_kv_class` answers this module's classes for it."""
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _registered
    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    _extend_enum(utils.TransferBackend, "TANDEM", BACKEND)
    if not _registered:  # one wrapper per process (SGLang's load_plugins is idempotent too)
        HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND)
        _registered = True


def _get_kv_class(original, transfer_backend, class_type):
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", None) != BACKEND or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    return {
        KVClassType.MANAGER: TandemKVManager,
        KVClassType.SENDER: TandemKVSender,
        KVClassType.RECEIVER: TandemKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: TandemKVBootstrapServer,
    }[class_type]


_registered = False


def _extend_enum(cls, name: str, value: str):
    """`cls(value)`, first adding the member `name` = `value` to the enum `cls` when it has none
    (Python 3.11's enum tables: `_member_names_`, `_member_map_`, `_value2member_map_`)."""
    try:
        return cls(value)
    except ValueError:
        pass
    member = object.__new__(cls)
    member._name_, member._value_ = name, value
    cls._member_names_.append(name)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    type.__setattr__(cls, name, member)
    return member


def config_from_env() -> dict:
    """The backend's config (`TANDEM_SGLANG_PD`, JSON). `ValueError` when it is missing or not
    a JSON object with `model`."""
    raw = os.environ.get(CONFIG_ENV)
    if not raw:
        raise ValueError(f"{CONFIG_ENV} is not set: the tandem transfer backend needs the worker's model (JSON)")
    cfg = json.loads(raw)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise ValueError(f"{CONFIG_ENV} must be a JSON object with the worker config's model")
    return cfg


# -- SGLang's buffers -----------------------------------------------------------------------


class _Mem:
    """Raw memory as a 1-D uint8 array interface (`__array_interface__` on the host,
    `__cuda_array_interface__` on a GPU); the owner (SGLang) keeps it alive."""

    def __init__(self, ptr: int, n: int, cuda: bool):
        iface = {"shape": (int(n),), "typestr": "|u1", "data": (int(ptr), False), "version": 3}
        if cuda:
            self.__cuda_array_interface__ = iface
        else:
            self.__array_interface__ = iface


def _bytes(ptr: int, n: int, device: str):
    torch = _torch()
    if device == "cpu":
        return torch.from_numpy(np.asarray(_Mem(ptr, n, False)))
    return torch.as_tensor(_Mem(ptr, n, True), device=device)


class SglangKv:
    """SGLang's KV and metadata buffers of one rank, from its `KVArgs`: per layer a K and a V
    tensor `[pages, page size, row half]` of bytes, and the aux buffers `[slots, item bytes]`.
    `ValueError` for pools this backend does not serve (module docstring)."""

    def __init__(self, args, device: str, is_mla: bool):
        if is_mla or getattr(args, "is_hybrid_mla_backend", False):
            raise ValueError("the tandem transfer backend serves MHA pools (a K and a V buffer per layer), not MLA")
        if getattr(args, "state_types", None):
            raise ValueError(f"the tandem transfer backend does not move state buffers ({list(args.state_types)})")
        ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
        if not ptrs or len(ptrs) % 2 or len(set(items)) != 1:
            raise ValueError(f"{len(ptrs)} KV buffers of item sizes {sorted(set(items))}: not a K and a V buffer per layer of one size")
        self.page_size = int(args.page_size)
        self.layers = len(ptrs) // 2
        self.device = device
        self.half = items[0] // self.page_size
        if self.half * self.page_size != items[0]:
            raise ValueError(f"a page of {items[0]} B is not {self.page_size} token rows")
        bufs = [_bytes(p, n, device).view(n // items[0], self.page_size, self.half) for p, n in zip(ptrs, lens)]
        self.k, self.v = bufs[: self.layers], bufs[self.layers :]
        self.aux = [(_bytes(p, n, "cpu"), int(i)) for p, n, i in zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)]
        self.aux_bytes = sum(i for _, i in self.aux)
        # The trailer's header: magic, the aux layout's digest (item sizes in order) and the room.
        self.aux_layout = zlib.crc32(json.dumps([i for _, i in self.aux]).encode())

    @property
    def row_bytes(self) -> int:
        """K+V bytes of one token in one layer: the worker pool's page row."""
        return 2 * self.half

    def aux_tokens(self) -> int:
        """Token rows the metadata trailer takes in a room (each holds `layers x row_bytes`):
        `TRAILER_HEADER` bytes, then the request's metadata."""
        return -(-(TRAILER_HEADER.size + self.aux_bytes) // (self.layers * self.row_bytes))

    def trailer(self, slot: int, room: int) -> np.ndarray:
        """The header (magic, layout digest, room) and `slot`'s metadata, as bytes."""
        head = np.frombuffer(TRAILER_HEADER.pack(TRAILER_MAGIC, self.aux_layout, room), dtype=np.uint8)
        return np.concatenate([head, self.read_aux(slot)])

    def check_trailer(self, data: np.ndarray, room: int) -> np.ndarray:
        """The metadata of a received trailer, after checking its header. `ValueError` when the
        prefill's metadata layout is not this decode's or the trailer names another room (the
        request then fails, after its room's release)."""
        magic, layout, got_room = TRAILER_HEADER.unpack(data[: TRAILER_HEADER.size].tobytes())
        if magic != TRAILER_MAGIC or layout != self.aux_layout or got_room != room:
            raise ValueError(
                f"metadata trailer (magic {magic:#x}, layout {layout:#x}, room {got_room}) is not this decode's "
                f"(layout {self.aux_layout:#x}, room {room}): prefill and decode must run the same model and "
                "metadata options"
            )
        return data[TRAILER_HEADER.size : TRAILER_HEADER.size + self.aux_bytes]

    def read_aux(self, slot: int) -> np.ndarray:
        """The request's metadata (`slot` of every aux buffer, in order) as bytes."""
        return np.concatenate([buf[slot * i : (slot + 1) * i].numpy() for buf, i in self.aux]) if self.aux else np.zeros(0, np.uint8)

    def write_aux(self, slot: int, data: np.ndarray) -> None:
        """Writes `read_aux`'s bytes back into `slot` of every aux buffer."""
        at = 0
        for buf, i in self.aux:
            buf[slot * i : (slot + 1) * i] = _torch().from_numpy(np.ascontiguousarray(data[at : at + i]))
            at += i


@dataclass
class SglangLoad(LoadSpec):
    """A decode load: `block_ids` are SGLang page indices; `kv_tokens` = pages x page size, then
    the metadata trailer into `aux_index`."""

    aux_index: int = 0
    kv_tokens: int = 0


@dataclass
class SglangSend(SendSpec):
    """A prefill send: `block_ids` are SGLang page indices; `kv_tokens` = pages x page size, then
    the metadata trailer from `aux_index`."""

    aux_index: int = 0
    kv_tokens: int = 0


class _SglangBuffers:
    """SGLang's buffers for the engine sides (`kv`: `SglangKv`, set before `open_session`)."""

    kv: SglangKv = None

    @staticmethod
    def default_engine() -> str:
        try:
            import sglang

            return f"sglang/{sglang.__version__}"
        except Exception:  # pragma: no cover
            return "sglang/unknown"

    def _row_bytes(self):
        return None if self.kv is None else self.kv.row_bytes

    def _where(self, pool_pages, sgl_pages, first: int, last: int, p_tok: int):
        """Tokens [first, last): (worker page, page row) and (SGLang page, offset) index arrays."""
        t = np.arange(first, last)
        page = np.asarray(pool_pages, dtype=np.int64)[t // p_tok]
        sgl = np.asarray(sgl_pages, dtype=np.int64)[t // self.kv.page_size] if sgl_pages is not None else None
        return page, t % p_tok, sgl, t % self.kv.page_size

    def _trailer(self, rows, pages, spec):
        """The trailer's (worker page, page row) indices of `spec`'s room."""
        page, prow, _, _ = self._where(pages, None, spec.kv_tokens, spec.kv_tokens + self.kv.aux_tokens(), rows.shape[2])
        return page, prow

    def _copy(self, pool, pages, spec) -> None:
        """The room's rows into the request's pages (every layer's K and V), then the trailer
        into its metadata slot."""
        torch = _torch()
        rows = self._rows(pool)
        tp, tr = self._trailer(rows, pages, spec)
        # The header first: a room of another metadata layout or request writes nothing.
        meta = self.kv.check_trailer(rows[tp, :, tr].reshape(-1), spec.tandem_id)
        page, prow, sgl, off = self._where(pages, spec.block_ids, 0, spec.kv_tokens, rows.shape[2])
        sgl_t, off_t = torch.from_numpy(sgl), torch.from_numpy(off)
        dev = self.kv.device
        try:
            for li in range(self.kv.layers):
                src = torch.from_numpy(np.ascontiguousarray(rows[page, li, prow])).to(dev)
                self.kv.k[li][sgl_t, off_t] = src[:, 0]
                self.kv.v[li][sgl_t, off_t] = src[:, 1]
        finally:
            # The writes are kernels on this thread's stream: they must have landed before SGLang
            # reads the pages (Success) or frees them (Failed, after a copy that raised).
            if dev != "cpu":
                torch.cuda.synchronize(dev)
        self.kv.write_aux(spec.aux_index, meta)

    def _copy_out(self, pool, pages, spec, tokens: int) -> None:
        """The request's pages (every layer's K and V) into the room's rows, then its metadata
        slot into the trailer. `ValueError` when the room is smaller than both."""
        if tokens < spec.prompt_tokens:
            raise ValueError(f"the decode's room holds {tokens} tokens; the KV and its metadata take {spec.prompt_tokens}")
        torch = _torch()
        rows = self._rows(pool)
        page, prow, sgl, off = self._where(pages, spec.block_ids, 0, spec.kv_tokens, rows.shape[2])
        sgl_t, off_t = torch.from_numpy(sgl), torch.from_numpy(off)
        for li in range(self.kv.layers):
            rows[page, li, prow, 0] = self.kv.k[li][sgl_t, off_t].cpu().numpy()
            rows[page, li, prow, 1] = self.kv.v[li][sgl_t, off_t].cpu().numpy()
        tp, tr = self._trailer(rows, pages, spec)
        width = self.kv.layers * self.kv.row_bytes
        data = np.zeros(len(tp) * width, dtype=np.uint8)
        head = self.kv.trailer(spec.aux_index, spec.tandem_id)
        data[: len(head)] = head
        rows[tp, :, tr] = data.reshape(len(tp), self.kv.layers, 2, self.kv.half)


class _Outcomes:
    """Per-request outcomes for `poll()`, kept from `track` to `forget` (SGLang's `clear`) only:
    a report that comes after `forget` is dropped."""

    def _init_outcomes(self) -> None:
        self.outcomes = {}  # req_id -> outcome, for requests tracked now
        self.copied = set()  # decode: req_ids whose KV is in SGLang's pages

    def track(self, req_id: str) -> None:
        with self._lock:
            self.outcomes.setdefault(req_id, None)

    def _record(self, req_id: str, outcome) -> None:
        """Called with the lock held."""
        if req_id in self.outcomes:
            self.outcomes[req_id] = outcome

    def forget(self, req_id: str) -> None:
        with self._lock:
            self.outcomes.pop(req_id, None)
            self.copied.discard(req_id)


class SglangDecodeLoader(_Outcomes, _SglangBuffers, pd.DecodeLoader):
    """The decode's worker side over SGLang's buffers; per request: True (loaded) or False
    (failed, after its release)."""

    def __init__(self, extra: dict, page_size: int):
        super().__init__(extra, page_size)
        self._init_outcomes()

    def _report(self, ld, ok: bool) -> None:
        self._record(ld.spec.req_id, ok)

    def _copy(self, pool, pages, spec) -> None:
        super()._copy(pool, pages, spec)
        with self._lock:
            if spec.req_id in self.outcomes:
                self.copied.add(spec.req_id)


class SglangPrefillSender(_Outcomes, _SglangBuffers, pd.PrefillSender):
    """The prefill's worker side over SGLang's buffers; per request a stats key ("sent",
    "no_room", ...)."""

    def __init__(self, extra: dict, page_size: int):
        super().__init__(extra, page_size)
        self._init_outcomes()

    def _report_sent(self, spec, outcome: str) -> None:
        self._record(spec.req_id, outcome)

    def room(self, tandem_id: int, token: int):
        """Whether the decode's room for `tandem_id` has reached this worker: True (with `token`),
        False (not yet), None (with another token: not this request's)."""
        with self._lock:
            w = self._work.get(tandem_id)
        if w is None:
            return False
        # 0: a room of a decode worker older than the token's travel (a rolling upgrade).
        return True if w[0].hand_off_token in (0, token) else None


# -- SGLang's classes -----------------------------------------------------------------------


class _OnePrefill:
    """SGLang's `prefill_info_table` for this backend: every bootstrap address is one prefill
    rank of data parallelism 1 (the worker's room names the peer, not SGLang)."""

    _INFO = SimpleNamespace(dp_size=1, follow_bootstrap_room=True)

    def get(self, _addr, default=None):
        return self._INFO

    def __contains__(self, _addr) -> bool:
        return True


def _refuse_unserved(server_args, args, model: dict) -> None:
    """`ValueError` naming what SGLang accepts but this backend cannot serve (rather than a
    crash, a hang or every request failing later)."""
    unserved = [
        (getattr(server_args, "disaggregation_decode_allocation_policy", "early") != "early",
         "--disaggregation-decode-allocation-policy other than early"),
        (bool(getattr(server_args, "disaggregation_decode_enable_radix_cache", False)),
         "--disaggregation-decode-enable-radix-cache"),
        (int(getattr(server_args, "tp_size", 1) or 1) > 1 or int(getattr(server_args, "pp_size", 1) or 1) > 1,
         "tensor or pipeline parallelism above 1 (one engine rank per worker)"),
        (bool(getattr(server_args, "speculative_algorithm", None)) or int(getattr(args, "num_draft_entries", 0) or 0) > 0,
         "speculative decoding (its draft pool's KV)"),
        (bool(os.environ.get("SGLANG_DISAGG_STAGING_BUFFER")), "SGLANG_DISAGG_STAGING_BUFFER"),
        (getattr(args, "pp_rank", 0) not in (0, None), "pipeline-parallel prefill ranges"),
        (len(args.kv_data_ptrs) != 2 * int(model.get("layers", 0)),
         f"{len(args.kv_data_ptrs)} KV buffers for a worker model of {model.get('layers')} layers (a K and a V per layer)"),
    ]
    named = [what for bad, what in unserved if bad]
    if named:
        raise ValueError("the tandem transfer backend does not serve: " + "; ".join(named))


class TandemKVManager(BaseKVManager):
    """One per SGLang scheduler rank: its buffers and its side of the worker (a
    `SglangPrefillSender` or a `SglangDecodeLoader`, attached from construction on).
    `ValueError` for pools or settings this backend does not serve. SGLang's scheduler reads
    `kv_args` and `prefill_info_table` and calls `try_ensure_parallel_info` on it."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        mode = getattr(disaggregation_mode, "value", disaggregation_mode)
        if mode not in ("prefill", "decode"):
            raise ValueError(f"the tandem transfer backend serves prefill and decode, not {mode!r}")
        cfg = config_from_env()
        device = str(getattr(server_args, "device", "cpu") or "cpu")
        self.kv = SglangKv(args, "cpu" if device == "cpu" else f"{device}:{int(getattr(args, 'gpu_id', 0))}", bool(is_mla_backend))
        _refuse_unserved(server_args, args, cfg["model"])
        self.kv_args, self.mode, self.server_args = args, mode, server_args
        self.prefill_info_table = _OnePrefill()
        self._ids = itertools.count(1)
        self.live_rooms = set()  # decode: rooms with a live receiver (one each)
        side_cls = SglangPrefillSender if mode == "prefill" else SglangDecodeLoader
        self.side = side_cls(cfg, self.kv.page_size)
        self.side.kv = self.kv
        self.side.open_session()

    def register_to_bootstrap(self):
        """Nothing: the worker's rooms are the rendezvous (no bootstrap server)."""

    def try_ensure_parallel_info(self, bootstrap_addr) -> bool:
        """SGLang asks for the prefill's parallel layout: there is one rank, known already."""
        return True

    def next_id(self, room) -> str:
        """A request key unique in this process (a room can be named again, e.g. by a client
        that reaches the engine directly: its outcome must not be another request's)."""
        return f"room-{room}-{next(self._ids)}"

    def close(self) -> None:
        self.side.close()


class _Request:
    """What sender and receiver share: the manager, the room (front door id), token, deadline."""

    def _parse(self, mgr, bootstrap_addr, bootstrap_room):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.req_id = mgr.next_id(bootstrap_room)
        parsed = parse_bootstrap_host(bootstrap_addr)
        self.token, self.kv_deadline_ms = parsed if parsed else (0, 0)
        self.error = None
        if parsed is None or not isinstance(bootstrap_room, int) or bootstrap_room <= 0:
            self.error = (
                f"request with bootstrap address {bootstrap_addr!r} and room {bootstrap_room!r} did not come through "
                "Tandem's front door (the tandem transfer backend serves only its hand-offs)"
            )
        self.bytes = 0

    def failure_exception(self):
        raise RuntimeError(self.error or "the tandem transfer failed")

    def get_transfer_metric(self):
        return KVTransferMetric(transfer_total_bytes=self.bytes) if KVTransferMetric else None


class TandemKVSender(_Request, BaseKVSender):
    """The prefill's sender of one request (module docstring)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        self._parse(mgr, bootstrap_addr, bootstrap_room)
        self.num_pages = None
        self.aux_index = None
        self.pages = []
        self.submitted = False
        self.aborted = False
        self.final = None
        # The decode's room must reach this worker within the KV deadline (plus slack), or the
        # request fails instead of holding its pages while nobody will take its KV.
        self.room_by = time.monotonic() + self.kv_deadline_ms / 1000.0 + mgr.side.kv_slack_s

    def init(self, num_kv_indices: int, aux_index=None):
        self.num_pages, self.aux_index = int(num_kv_indices), int(aux_index or 0)

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None, **_):
        if self.submitted or self.error or self.aborted:
            return
        if state_indices is not None and len(state_indices):
            self.error = "the tandem transfer backend does not move state buffers"
            return
        self.pages.extend(int(i) for i in np.asarray(kv_indices).reshape(-1))
        if self.num_pages is None or len(self.pages) < self.num_pages:
            return
        side, kv = self.kv_mgr.side, self.kv_mgr.kv
        kv_tokens = len(self.pages) * kv.page_size
        spec = SglangSend(
            req_id=self.req_id, tandem_id=self.bootstrap_room, kv_deadline_ms=self.kv_deadline_ms,
            prompt_tokens=kv_tokens + kv.aux_tokens(), block_ids=list(self.pages), token=self.token,
            aux_index=self.aux_index, kv_tokens=kv_tokens,
        )
        self.bytes = kv_tokens * kv.layers * kv.row_bytes + kv.aux_bytes
        self.submitted = True
        side.track(self.req_id)
        side.start(SimpleNamespace(sends=[spec]))

    def poll(self):
        if self.final is not None:
            return self.final
        if self.error:
            return KVPoll.Failed
        side = self.kv_mgr.side
        if not self.submitted:
            if self.aborted:
                return KVPoll.Failed
            known = side.room(self.bootstrap_room, self.token)
            if known is None:
                self.error = f"room {self.bootstrap_room} was opened with another hand-off token: not this request's"
                return KVPoll.Failed
            if not known and time.monotonic() > self.room_by:
                self.error = f"the decode's room {self.bootstrap_room} did not reach this worker within its KV deadline"
                return KVPoll.Failed
            return KVPoll.WaitingForInput if known else KVPoll.Bootstrapping
        with side._lock:
            outcome = side.outcomes.get(self.req_id)
        if outcome is None:
            return KVPoll.Transferring
        # Final: the outcome leaves the side now (SGLang clears only successful senders).
        side.forget(self.req_id)
        if outcome == "sent":
            self.final = KVPoll.Success
        else:
            self.error = f"the KV of room {self.bootstrap_room} was not sent: {outcome}"
            self.final = KVPoll.Failed
        return self.final

    def abort(self):
        self.aborted = True

    def clear(self):
        self.kv_mgr.side.forget(self.req_id)


class TandemKVReceiver(_Request, BaseKVReceiver):
    """The decode's receiver of one request (module docstring)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
        self._parse(mgr, bootstrap_addr, bootstrap_room)
        self.ready = False
        self.started = False
        self.final = None
        self.holds_room = False

    def init(self, prefill_dp_rank=0):
        self.ready = True

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, destination=None):
        if self.error or self.started:
            return
        if state_indices is not None and len(state_indices):
            self.error = "the tandem transfer backend does not move state buffers"
            return
        if decode_prefix_len:
            self.error = "the tandem transfer backend does not serve a decode radix prefix (decode_prefix_len > 0)"
            return
        if destination is not None and getattr(destination, "value", destination) != "device":
            self.error = "the tandem transfer backend lands KV in the device pool only"
            return
        side = self.kv_mgr.side
        with side._lock:  # one live receiver per room: a second one is not this request's
            if self.bootstrap_room in self.kv_mgr.live_rooms:
                self.error = f"room {self.bootstrap_room} already has a live receiver"
                return
            self.kv_mgr.live_rooms.add(self.bootstrap_room)
            self.holds_room = True
        kv = self.kv_mgr.kv
        pages = [int(i) for i in np.asarray(kv_indices).reshape(-1)]
        kv_tokens = len(pages) * kv.page_size
        spec = SglangLoad(
            req_id=self.req_id, tandem_id=self.bootstrap_room, kv_deadline_ms=self.kv_deadline_ms,
            prompt_tokens=kv_tokens + kv.aux_tokens(), first_token=0, block_ids=pages, token=self.token,
            aux_index=int(aux_index or 0), kv_tokens=kv_tokens,
        )
        self.bytes = kv_tokens * kv.layers * kv.row_bytes + kv.aux_bytes
        self.started = True
        self.kv_mgr.side.track(self.req_id)
        self.kv_mgr.side.start(SimpleNamespace(loads=[spec], aborts=[]))

    def poll(self):
        if self.final is not None:
            return self.final
        if self.error and not self.started:
            return KVPoll.Failed  # nothing of this request reached the worker
        if not self.ready:
            return KVPoll.Bootstrapping
        if not self.started:
            return KVPoll.WaitingForInput
        side = self.kv_mgr.side
        with side._lock:
            outcome = side.outcomes.get(self.req_id)
            copied = self.req_id in side.copied
        if outcome is False:
            self.error = self.error or f"room {self.bootstrap_room} failed (its pages are released)"
            self._end(KVPoll.Failed)
        elif outcome is True:
            self._end(KVPoll.Success)
        # The KV is in SGLang's pages once copied; the room's release is the worker's affair.
        if self.final is not None:
            return self.final
        return KVPoll.Success if copied else KVPoll.Transferring

    def _end(self, state) -> None:
        """The load reported (after the room's release): final; the room takes a receiver again."""
        self.final = state
        self.clear()

    def abort(self):
        """Aborts the room; `poll()` answers `Failed` once its SafeToReuse arrived."""
        if self.started:
            self.kv_mgr.side.start(SimpleNamespace(loads=[], aborts=[self.req_id]))
        else:
            self.error = self.error or "aborted before its pages were allocated"

    def clear(self):
        side = self.kv_mgr.side
        side.forget(self.req_id)
        with side._lock:
            if self.holds_room:
                self.kv_mgr.live_rooms.discard(self.bootstrap_room)
                self.holds_room = False


class TandemKVBootstrapServer(BaseKVBootstrapServer):
    """SGLang starts a bootstrap server on a prefill; the tandem backend needs none (the worker's
    rooms are the rendezvous), so this one binds nothing."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port

    def close(self) -> None:
        pass



def _torch():
    import torch

    return torch
