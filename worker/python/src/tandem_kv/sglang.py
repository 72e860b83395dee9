"""`TandemHiCacheStorage`: an SGLang HiCache L3 storage backend on Tandem's engine API.

Written against SGLang 0.5.23 (`sglang/srt/mem_cache/hicache_storage.py`, `HiCacheStorage`) and
loaded by its dynamic factory (`storage/backend_factory.py`, `cls(storage_config, kwargs)`):

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tandem",
        "module_path": "tandem_kv.sglang", "class_name": "TandemHiCacheStorage",
        "interface_v1": 1, "socket_dir": "/run/tandem/engine"}'

How it works. At `register_mem_pool_host` (and again after any loss of the worker) the backend
attaches to the `tandem-worker` sidecar over `<socket_dir>/engine.sock` with an identity derived
from the host pool (layers, heads, head_dim, dtype, page size; or the extra config's `model`),
receives the worker's memfd pool by SCM_RIGHTS and maps it. `batch_set_v1(keys, host_indices)`
copies each SGLang page (the spans of `mem_pool_host.get_page_buffer_meta`) into a staging page of
that pool and sends ONE `Tiers.Store` per batch; `batch_get_v1` sends one `Tiers.Load` into
staging pages and copies the pages that loaded back into the host pool; `batch_exists` is ONE
`Tiers.Lookup` (L2 + L3 leading pages). So data moves by page index over shared memory with one
host memcpy per page each way: SGLang's own host pool is not adopted by the worker (engine-owned
pools are refused, ADOPTION_UNSUPPORTED), so this is not zero-copy in the strict sense.

Keys: SGLang's page hashes (chained SHA-256 of `get_hash_str`, one per page) are namespaced as
Mooncake does (`<model>_<tp_rank>_<tp_size>` unless MLA, `_<pp_size>_<pp_rank>`, `_cp<r>_<n>`) and by
the worker's model fingerprint, then hashed to the 8-byte prefix hashes of engine.proto.

Failure contract (SGLang's storage threads are never restarted): every batch call returns a list
of bools of the keys' length (never None) and `batch_exists` an int, and no exception escapes;
while the worker is down every call is a miss/False within `timeout_s`, and the next call after
the worker is back re-attaches (at most one attempt per `retry_s` while it stays down).

Extra config keys (all optional): `socket_dir` (default `$TANDEM_ENGINE_SOCKET_DIR` or
`/run/tandem/engine`), `timeout_s` (2.0), `retry_s` (1.0), `model` (the worker config's `model`
object; else derived from the host pool with `model_name` or SGLang's `model_name`), `engine`
(`sglang/<version>`), `namespace` (extra key namespace), `staging_pages` (pages of the worker pool
this backend uses, from page 0; default all), `keepalive_s` (2.0: how often the attach is checked
and restored without SGLang's calls; 0 turns it off — see `tiers.py`).
"""

from __future__ import annotations

import logging
import os

from .client import engine_identity
from .tiers import TierBackend, copy_spans  # noqa: F401  (copy_spans: re-exported for callers)

logger = logging.getLogger(__name__)

try:  # SGLang present (the serving image): subclass its ABC so the factory accepts us.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except Exception:  # no SGLang/torch here (CI's venv): a plain base keeps the module importable.

    class _Base:  # type: ignore[no-redef]
        pass


def _dtype_bytes(dtype) -> int:
    n = getattr(dtype, "itemsize", None)
    if not isinstance(n, int):
        raise ValueError(f"dtype {dtype!r} has no itemsize; set the extra config's `model`")
    return n


def _indices_list(host_indices):
    return host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices)


class TandemHiCacheStorage(TierBackend, _Base):
    """SGLang HiCache storage backend on a Tandem worker (see the module docstring)."""

    def __init__(self, storage_config, kwargs=None):
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.extra = extra
        self._init_tiers(
            extra.get("socket_dir") or os.environ.get("TANDEM_ENGINE_SOCKET_DIR") or "/run/tandem/engine",
            timeout_s=extra.get("timeout_s", 2.0),
            retry_s=extra.get("retry_s", 1.0),
            staging_pages=extra.get("staging_pages"),
            keepalive_s=extra.get("keepalive_s", 2.0),
        )
        self.mem_pool_host = None
        self._start_keepalive()

    # -- registration and the attach ---------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host):
        """Remembers the host pool and attaches (a worker that is down is not an error here)."""
        self.mem_pool_host = mem_pool_host
        self._session()

    def on_host_pools_registered(self) -> None:
        """Never raises (a missing worker must not fail SGLang's attach): attaching is retried."""
        self._session()

    def _ready(self) -> bool:
        return self.mem_pool_host is not None

    def _model(self) -> dict:
        if "model" in self.extra:
            return self.extra["model"]
        p, c = self.mem_pool_host, self.storage_config
        name = self.extra.get("model_name") or getattr(c, "model_name", None) or "unknown"
        m = {"name": name, "layers": p.layer_num, "dtype_bytes": _dtype_bytes(p.dtype)}
        if getattr(c, "is_mla_model", False):
            m.update(attention="mla", kv_lora_rank=p.kv_lora_rank, rope_dim=p.qk_rope_head_dim)
        else:
            m.update(attention="gqa", kv_heads=p.head_num, head_dim=p.head_dim)
        return m

    def _engine(self) -> str:
        if "engine" in self.extra:
            return self.extra["engine"]
        try:
            import sglang

            return f"sglang/{sglang.__version__}"
        except Exception:
            return "sglang/unknown"

    def _identity(self, health):
        c = self.storage_config
        return engine_identity(
            self._engine(),
            self._model(),
            self.mem_pool_host.page_size,
            layout=health.layout,
            tp_rank=getattr(c, "tp_rank", 0),
            tp_size=getattr(c, "tp_size", 1),
            cp_rank=getattr(c, "attn_cp_rank", 0),
            cp_size=getattr(c, "attn_cp_size", 1),
        )

    # -- keys ---------------------------------------------------------------------------------

    def _namespace(self, fingerprint: str) -> str:
        c = self.storage_config
        model = (self.extra.get("model", {}).get("name") if "model" in self.extra else None) or getattr(c, "model_name", None) or "unknown"
        s = str(model).replace("/", "-")
        if not getattr(c, "is_mla_model", False):
            s += f"_{getattr(c, 'tp_rank', 0)}_{getattr(c, 'tp_size', 1)}"
        if getattr(c, "pp_size", 1) > 1:
            s += f"_{c.pp_size}_{c.pp_rank}"
        if getattr(c, "attn_cp_size", 1) > 1:
            s += f"_cp{c.attn_cp_rank}_{c.attn_cp_size}"
        return f"tandem-sglang/v1|{fingerprint}|{self.extra.get('namespace', '')}|{s}"

    # -- the page spans of SGLang's host pool -----------------------------------------------------

    def _page_spans(self, host_indices, n_pages):
        """Per page, the (ptr, size) spans of the host pool for `host_indices` (n_pages pages)."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // n_pages if n_pages else 0
        if per * n_pages != len(ptrs):
            raise ValueError(f"{len(ptrs)} buffers for {n_pages} pages")
        return [list(zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per])) for i in range(n_pages)]

    def _pages(self, keys, host_indices):
        ps = self.mem_pool_host.page_size
        idx = host_indices
        if len(_indices_list(idx)) != len(keys) * ps:
            raise ValueError(f"{len(_indices_list(idx))} host indices for {len(keys)} pages of {ps} tokens")
        return self._page_spans(idx, len(keys))

    # -- the v1 page interface (interface_v1: 1) ------------------------------------------------

    def batch_exists(self, keys, extra_info=None) -> int:
        """Leading keys present in the worker's tiers (L2 + L3): one Lookup per 4096 keys."""
        try:
            return self.leading_hits(keys)
        except Exception as e:  # never into SGLang's threads
            self._log("exists", "tandem: batch_exists failed: %r", e)
            return 0

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        """Stores each page; a list of bools (True: the worker holds the page)."""
        keys = list(keys)
        if self.mem_pool_host is None or not keys:
            return [False] * len(keys)
        try:
            return self.store_pages(keys, self._pages(keys, host_indices))
        except Exception as e:
            self._log("set", "tandem: batch_set_v1 failed: %r", e)
            return [False] * len(keys)

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        """Loads the leading pages present into the host pool; a list of bools (True: loaded)."""
        keys = list(keys)
        if self.mem_pool_host is None or not keys:
            return [False] * len(keys)
        try:
            return self.load_pages(keys, self._pages(keys, host_indices))
        except Exception as e:
            self._log("get", "tandem: batch_get_v1 failed: %r", e)
            return [False] * len(keys)

    # -- the legacy tensor interface (abstract in SGLang; the v1 path is the one to use) -----------

    @staticmethod
    def _tensor_span(t):
        return [(t.data_ptr(), t.numel() * t.element_size())]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """Stores flat page tensors `values` (one per key); True when every page was stored."""
        keys = list(keys)
        try:
            return all(self.store_pages(keys, [self._tensor_span(v) for v in values]))
        except Exception as e:
            self._log("set", "tandem: batch_set failed: %r", e)
            return False

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Loads into the flat page tensors `target_locations`; per key the tensor or None."""
        keys = list(keys)
        try:
            got = self.load_pages(keys, [self._tensor_span(t) for t in target_locations])
            return [t if ok else None for t, ok in zip(target_locations, got)]
        except Exception as e:
            self._log("get", "tandem: batch_get failed: %r", e)
            return [None] * len(keys)

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location])[0]

    def clear(self) -> None:
        """Not supported: Tandem's tiers are shared with other engines and cleared by the operator."""

    def get_stats(self):
        return dict(self.stats)
