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
this backend uses, from page 0; default all).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
import time

from . import errors
from ._pb import engine_pb2 as pb
from .client import EngineClient, engine_identity

logger = logging.getLogger(__name__)

try:  # SGLang present (the serving image): subclass its ABC so the factory accepts us.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except Exception:  # no SGLang/torch here (CI's venv): a plain base keeps the module importable.

    class _Base:  # type: ignore[no-redef]
        pass


# Errors after which the attach is gone or unusable: drop it and attach again.
_LOST = (errors.WorkerUnavailable, errors.CallTimeout, errors.NotAttached, errors.ShuttingDown, errors.PoolsError)


def _dtype_bytes(dtype) -> int:
    n = getattr(dtype, "itemsize", None)
    if not isinstance(n, int):
        raise ValueError(f"dtype {dtype!r} has no itemsize; set the extra config's `model`")
    return n


def _indices_list(host_indices):
    return host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices)


def copy_spans(dst, src) -> int:
    """Copies the bytes of the `src` spans, in order, into the `dst` spans, in order (each a list of
    (address, length)); returns the bytes copied. Both sides must total the same length."""
    di, doff, total = 0, 0, 0
    for saddr, slen in src:
        soff = 0
        while soff < slen:
            daddr, dlen = dst[di]
            n = min(slen - soff, dlen - doff)
            ctypes.memmove(daddr + doff, saddr + soff, n)
            soff += n
            doff += n
            total += n
            if doff == dlen:
                di, doff = di + 1, 0
    return total


class TandemHiCacheStorage(_Base):
    """SGLang HiCache storage backend on a Tandem worker (see the module docstring)."""

    def __init__(self, storage_config, kwargs=None):
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.extra = extra
        self.socket_dir = extra.get("socket_dir") or os.environ.get("TANDEM_ENGINE_SOCKET_DIR") or "/run/tandem/engine"
        self.timeout_s = float(extra.get("timeout_s", 2.0))
        self.retry_s = float(extra.get("retry_s", 1.0))
        self.client = EngineClient(self.socket_dir, call_timeout=self.timeout_s)
        self.mem_pool_host = None
        self._attached = None
        self._retry_at = 0.0
        self._lock = threading.RLock()
        # SGLang's prefetch and backup threads call concurrently: the staging pages are one
        # resource, so the calls that use them (Store, Load and their copies) run one at a time.
        self._staging_lock = threading.Lock()
        self._last_log = {}
        self.stats = {"attaches": 0, "lost": 0, "stored": 0, "loaded": 0, "lookups": 0, "refused": 0}

    # -- registration and the attach ---------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host):
        """Remembers the host pool and attaches (a worker that is down is not an error here)."""
        self.mem_pool_host = mem_pool_host
        self._session()

    def on_host_pools_registered(self) -> None:
        """Never raises (a missing worker must not fail SGLang's attach): attaching is retried."""
        self._session()

    def _log(self, what: str, msg: str, *args):
        now = time.monotonic()
        if now - self._last_log.get(what, -1e9) > 10.0:
            self._last_log[what] = now
            logger.warning(msg, *args)

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

    def _session(self):
        """The live attach, attaching first if needed; None while the worker cannot be reached
        (then at most one attempt per `retry_s`)."""
        with self._lock:
            if self._attached is not None:
                return self._attached
            if self.mem_pool_host is None or time.monotonic() < self._retry_at:
                return None
            c = self.storage_config
            try:
                h = self.client.health()
                ident = engine_identity(
                    self._engine(),
                    self._model(),
                    self.mem_pool_host.page_size,
                    layout=h.layout,
                    tp_rank=getattr(c, "tp_rank", 0),
                    tp_size=getattr(c, "tp_size", 1),
                    cp_rank=getattr(c, "attn_cp_rank", 0),
                    cp_size=getattr(c, "attn_cp_size", 1),
                )
                att = self.client.attach(ident)
            except errors.TandemError as e:
                self._retry_at = time.monotonic() + self.retry_s
                self._log("attach", "tandem: cannot attach to the worker at %s (misses until it can): %s", self.socket_dir, e)
                return None
            except Exception as e:  # a host pool without the attributes we need, etc.
                self._retry_at = time.monotonic() + self.retry_s
                self._log("attach", "tandem: attach failed: %r", e)
                return None
            pool = att.pool()
            n = int(self.extra.get("staging_pages", pool.page_count))
            self._staging = list(range(min(n, pool.page_count)))
            self._ns = self._namespace(att.reply.model_fingerprint)
            self._attached = att
            self.stats["attaches"] += 1
            logger.info("tandem: attached (id %d, %d staging pages of %d B)", att.id, len(self._staging), pool.page_bytes)
            return att

    def _drop(self, why):
        with self._lock:
            if self._attached is not None:
                self._attached.close()
                self._attached = None
                self.stats["lost"] += 1
            self._retry_at = 0.0  # the next call tries once at once
        self._log("lost", "tandem: attach lost (%s); attaching again", why)

    def close(self):
        """Detaches and closes the channel (SGLang calls it on detach of the storage backend)."""
        with self._lock:
            if self._attached is not None:
                try:
                    self.client.detach(self._attached.id)
                except errors.TandemError:
                    pass
                self._attached.close()
                self._attached = None
            self.client.close()

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

    def key_hash(self, key: str) -> bytes:
        """The 8-byte prefix hash of SGLang page key `key` in this backend's namespace."""
        return hashlib.sha256(f"{self._ns}|{key}".encode()).digest()[:8]

    # -- calls with the failure contract ---------------------------------------------------------

    def _call(self, f, staging=True):
        """Runs f(att) on the live attach (holding the staging pages unless `staging` is False);
        re-attaches once after NotAttached (a restarted worker). Returns (ok, value): ok False when
        the worker cannot serve it now."""
        for attempt in (0, 1):
            att = self._session()
            if att is None:
                return False, None
            try:
                if not staging:
                    return True, f(att)
                with self._staging_lock:
                    return True, f(att)
            except _LOST as e:
                self._drop(e)
                if not isinstance(e, errors.NotAttached) or attempt:
                    return False, None
            except errors.TandemError as e:
                self.stats["refused"] += 1
                self._log(type(e).__name__, "tandem: refused: %s", e)
                return False, None
        return False, None

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
            keys = list(keys)
            if not keys:
                return 0
            self.stats["lookups"] += 1

            def run(att):
                total = 0
                for i in range(0, len(keys), 4096):
                    part = keys[i : i + 4096]
                    r = self.client.lookup(att.id, [self.key_hash(k) for k in part])
                    hit = min(len(part), sum(h.pages for h in r.hits))
                    total += hit
                    if hit < len(part):
                        break
                return total

            ok, n = self._call(run, staging=False)
            return int(n) if ok else 0
        except Exception as e:  # never into SGLang's threads
            self._log("exists", "tandem: batch_exists failed: %r", e)
            return 0

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        """Stores each page; a list of bools (True: the worker holds the page)."""
        keys = list(keys)
        out = [False] * len(keys)
        if self.mem_pool_host is None or not keys:
            return out
        try:
            spans = self._pages(keys, host_indices)

            def run(att):
                pool = att.pool()
                done = 0
                for i in range(0, len(keys), len(self._staging)):
                    part = range(i, min(len(keys), i + len(self._staging)))
                    pages = self._staging[: len(part)]
                    for j, page in zip(part, pages):
                        if sum(s for _, s in spans[j]) != pool.page_bytes:
                            raise ValueError(f"host page of {sum(s for _, s in spans[j])} B, worker page of {pool.page_bytes} B")
                        copy_spans(pool.page_spans(page), spans[j])
                    r = self.client.store(att.id, [self.key_hash(keys[j]) for j in part], pages)
                    for j in part[: r.pages]:
                        out[j] = True
                    done += r.pages
                    if r.pages < len(part):
                        break
                return done

            ok, n = self._call(run)
            if ok:
                self.stats["stored"] += n
        except Exception as e:
            self._log("set", "tandem: batch_set_v1 failed: %r", e)
        return out

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        """Loads the leading pages present into the host pool; a list of bools (True: loaded)."""
        keys = list(keys)
        out = [False] * len(keys)
        if self.mem_pool_host is None or not keys:
            return out
        try:
            spans = self._pages(keys, host_indices)

            def run(att):
                pool = att.pool()
                got = 0
                for i in range(0, len(keys), len(self._staging)):
                    part = range(i, min(len(keys), i + len(self._staging)))
                    pages = self._staging[: len(part)]
                    for j in part:
                        if sum(s for _, s in spans[j]) != pool.page_bytes:
                            raise ValueError("host page size differs from the worker's page size")
                    events = self.client.load(att.id, [self.key_hash(keys[j]) for j in part], pages)
                    n = 0
                    for e in events:
                        which = e.WhichOneof("event")
                        if which == "done":
                            n = e.done.pages
                        elif which == "failed":
                            n = e.failed.pages_loaded
                    n = min(n, len(part))
                    for j, page in zip(part[:n], pages):
                        copy_spans(spans[j], pool.page_spans(page))
                        out[j] = True
                    got += n
                    if n < len(part):
                        break
                return got

            ok, n = self._call(run)
            if ok:
                self.stats["loaded"] += n
        except Exception as e:
            self._log("get", "tandem: batch_get_v1 failed: %r", e)
        return out

    # -- the legacy tensor interface (abstract in SGLang; the v1 path is the one to use) -----------

    @staticmethod
    def _tensor_span(t):
        return [(t.data_ptr(), t.numel() * t.element_size())]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """Stores flat page tensors `values` (one per key); True when every page was stored."""
        keys = list(keys)
        try:
            spans = [self._tensor_span(v) for v in values]
            return all(self._set_spans(keys, spans))
        except Exception as e:
            self._log("set", "tandem: batch_set failed: %r", e)
            return False

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def _set_spans(self, keys, spans):
        out = [False] * len(keys)

        def run(att):
            pool = att.pool()
            for i in range(0, len(keys), len(self._staging)):
                part = range(i, min(len(keys), i + len(self._staging)))
                pages = self._staging[: len(part)]
                for j, page in zip(part, pages):
                    if sum(s for _, s in spans[j]) != pool.page_bytes:
                        raise ValueError("value size differs from the worker's page size")
                    copy_spans(pool.page_spans(page), spans[j])
                r = self.client.store(att.id, [self.key_hash(keys[j]) for j in part], pages)
                for j in part[: r.pages]:
                    out[j] = True

        self._call(run)
        return out

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Loads into the flat page tensors `target_locations`; per key the tensor or None."""
        keys = list(keys)
        res = [None] * len(keys)
        try:
            spans = [self._tensor_span(t) for t in target_locations]

            def run(att):
                pool = att.pool()
                for i in range(0, len(keys), len(self._staging)):
                    part = range(i, min(len(keys), i + len(self._staging)))
                    pages = self._staging[: len(part)]
                    events = self.client.load(att.id, [self.key_hash(keys[j]) for j in part], pages)
                    n = 0
                    for e in events:
                        w = e.WhichOneof("event")
                        n = e.done.pages if w == "done" else e.failed.pages_loaded if w == "failed" else n
                    for j, page in zip(part[: min(n, len(part))], pages):
                        if sum(s for _, s in spans[j]) != pool.page_bytes:
                            return
                        copy_spans(spans[j], pool.page_spans(page))
                        res[j] = target_locations[j]
                    if n < len(part):
                        return

            self._call(run)
        except Exception as e:
            self._log("get", "tandem: batch_get failed: %r", e)
        return res

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], [target_location])[0]

    def clear(self) -> None:
        """Not supported: Tandem's tiers are shared with other engines and cleared by the operator."""

    def get_stats(self):
        return dict(self.stats)
