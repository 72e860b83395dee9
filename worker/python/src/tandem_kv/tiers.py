"""`TierBackend`: what Tandem's L3 adapters for SGLang (`sglang.py`) and vLLM (`vllm.py`) share.

Both engines hand an external KV store whole pages (SGLang: a HiCache host page; vLLM: a chunk of
its CPU offload region) and ask for them back by key. The backend moves them through the worker's
Tiers calls (engine.proto `Tiers`):

- the attach: on first use, and again after any loss of the worker (at most one attempt per
  `retry_s` while it stays down), with an identity the engine adapter derives (`_identity`) and the
  worker checks against its config; the worker's memfd pool arrives by SCM_RIGHTS and is mapped;
- the keepalive: a thread that every `keepalive_s` (default 2 s; 0 turns it off) asks the worker's
  `Health` whether it still holds this attach, and attaches again when it does not (a restarted
  worker) or when there is none — without waiting for the engine's next call. A worker is Ready only
  while its engine is attached, and a pod that is not Ready gets no requests, so without it an
  engine whose worker restarted would never call again, never re-attach, and its pod would stay
  out of its Service for good;
- staging: the adapter's page spans are copied into staging pages of that pool (one host memcpy per
  page each way — the engines' own host memory is not adopted by the worker, which refuses
  engine-owned pools with ADOPTION_UNSUPPORTED), then ONE `Store` or `Load` per batch of at most
  the staging pages;
- keys: the engine's page key, namespaced by the adapter (`_namespace`: engine, model fingerprint
  from the worker, ranks) and hashed to the 8-byte prefix hash of engine.proto.

Failure contract (the engines' storage threads are never restarted): the operations below return
a value of the right shape — never raise — and while the worker is down each call is a miss within
`timeout_s`; `stats` counts attaches, losses, pages stored and loaded, lookups and refusals.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
import time

from . import errors
from .client import EngineClient

logger = logging.getLogger(__name__)

# Errors after which the attach is gone or unusable: drop it and attach again.
LOST = (errors.WorkerUnavailable, errors.CallTimeout, errors.NotAttached, errors.ShuttingDown, errors.PoolsError)

# Keys per Lookup call (engine.proto bounds a request's prefix hashes).
LOOKUP_BATCH = 4096


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


def loaded_pages(events) -> int:
    """The leading pages a `Load` stream's events say were loaded (`done.pages`, or
    `failed.pages_loaded` when it failed partway)."""
    n = 0
    for e in events:
        which = e.WhichOneof("event")
        if which == "done":
            n = e.done.pages
        elif which == "failed":
            n = e.failed.pages_loaded
    return n


class TierBackend:
    """The attach, the staging pages and the three page operations over one worker (see the module
    docstring). An adapter subclasses it and provides `_identity()` (an `EngineIdentity`; may raise
    — the attach is then retried after `retry_s`), `_namespace(fingerprint)` (the key namespace)
    and `_ready()` (False until the engine has handed over what `_identity` needs)."""

    def _init_tiers(self, socket_dir: str, timeout_s: float, retry_s: float, staging_pages=None, keepalive_s: float = 2.0):
        self.socket_dir = socket_dir
        self.timeout_s = float(timeout_s)
        self.retry_s = float(retry_s)
        self.staging_pages = None if staging_pages is None else int(staging_pages)
        self.client = EngineClient(self.socket_dir, call_timeout=self.timeout_s)
        self._attached = None
        self._retry_at = 0.0
        self._staging = []
        self._ns = ""
        self._lock = threading.RLock()
        # The engines call from several threads: the staging pages are one resource, so the calls
        # that use them (Store, Load and their copies) run one at a time.
        self._staging_lock = threading.Lock()
        self._last_log = {}
        self._stats_lock = threading.Lock()
        self.stats = {"attaches": 0, "lost": 0, "stored": 0, "loaded": 0, "lookups": 0, "refused": 0}
        self.keepalive_s = float(keepalive_s)
        self._closing = threading.Event()
        self._keepalive_thread = None

    def _start_keepalive(self) -> None:
        """Starts the keepalive thread (unless `keepalive_s` is 0); the adapter calls it last in
        its constructor, once its hooks can run."""
        if self.keepalive_s > 0:
            self._keepalive_thread = threading.Thread(target=self._keepalive_loop, name="tandem-keepalive", daemon=True)
            self._keepalive_thread.start()

    def _stop_keepalive(self) -> None:
        """Stops the keepalive thread and waits for its tick in progress (bounded by `timeout_s`),
        so that it touches nothing of a backend being closed."""
        self._closing.set()
        t = self._keepalive_thread
        if t is not None and t is not threading.current_thread():
            t.join(self.timeout_s + 1.0)

    # -- to provide ----------------------------------------------------------------------------

    def _ready(self) -> bool:
        return True

    def _identity(self, health):
        raise NotImplementedError

    def _namespace(self, fingerprint: str) -> str:
        raise NotImplementedError

    def _accept(self, att) -> None:
        """Checks a fresh attach against the engine's memory (e.g. the page size); raising refuses
        it: the attach is closed and retried after `retry_s`."""

    # -- the attach ----------------------------------------------------------------------------

    def _log(self, what: str, msg: str, *args):
        """Logs at most once per 10 s per `what` (a worker that is down must not flood the log)."""
        now = time.monotonic()
        if now - self._last_log.get(what, -1e9) > 10.0:
            self._last_log[what] = now
            logger.warning(msg, *args)

    def _session(self):
        """The live attach, attaching first if needed; None while the worker cannot be reached
        (then at most one attempt per `retry_s`)."""
        with self._lock:
            if self._attached is not None:
                return self._attached
            if not self._ready() or time.monotonic() < self._retry_at:
                return None
            try:
                att = self.client.attach(self._identity(self.client.health()))
            except errors.TandemError as e:
                self._retry_at = time.monotonic() + self.retry_s
                self._log("attach", "tandem: cannot attach to the worker at %s (misses until it can): %s", self.socket_dir, e)
                return None
            except Exception as e:  # engine state without the attributes the identity needs, etc.
                self._retry_at = time.monotonic() + self.retry_s
                self._log("attach", "tandem: attach failed: %r", e)
                return None
            try:
                self._accept(att)
            except Exception as e:
                att.close()
                self._retry_at = time.monotonic() + self.retry_s
                self._count("refused")
                self._log("accept", "tandem: the worker's pool does not fit this engine (misses until it does): %s", e)
                return None
            pool = att.pool()
            n = pool.page_count if self.staging_pages is None else self.staging_pages
            self._staging = list(range(min(n, pool.page_count)))
            self._ns = self._namespace(att.reply.model_fingerprint)
            self._attached = att
            self._count("attaches")
            logger.info("tandem: attached (id %d, %d staging pages of %d B)", att.id, len(self._staging), pool.page_bytes)
            return att

    def _keepalive_loop(self) -> None:
        while not self._closing.wait(self.keepalive_s):
            try:
                self._keepalive()
            except Exception as e:  # never let the thread die
                self._log("keepalive", "tandem: keepalive failed: %r", e)

    def _keepalive(self) -> None:
        """One keepalive tick: re-attach when there is no attach, or when the worker's `Health` says
        it holds another one (or none: it restarted) or the worker is gone. A Health call that only
        timed out (a busy or stopped worker) changes nothing: the data calls judge that."""
        att = self._attached
        if att is None:
            self._reattach()
            return
        try:
            held = self.client.health(timeout=self.timeout_s).attach_id
        except errors.CallTimeout:
            return
        except LOST as e:
            self._lost(att, e)
            return
        if held != att.id:
            self._lost(att, f"the worker holds attach {held}, not {att.id} (it restarted)")
            self._reattach()

    def _reattach(self) -> None:
        """Attaches now if the worker can be reached (the adapter may hand it to its own thread)."""
        self._session()

    def _lost(self, att, why) -> None:
        """Ends attach `att`, found dead by the keepalive (the adapter may close it on its own
        thread)."""
        self._drop(att, why)

    def _drop(self, att, why):
        """Ends attach `att` after a call on it failed: forgets it (unless another thread already
        replaced it) and closes it once no copy runs in its pool (the staging lock), so a failure on
        one thread never unmaps the pool under another thread's copy."""
        self._forget(att, why)
        with self._staging_lock:
            att.close()

    def _forget(self, att, why) -> None:
        """Stops using attach `att` (unless another thread already replaced it); the caller closes
        it once nothing copies into its pool."""
        with self._lock:
            if self._attached is att:
                self._attached = None
                self._count("lost")
                self._retry_at = 0.0  # the next call tries once at once
        self._log("lost", "tandem: attach lost (%s); attaching again", why)

    def close(self):
        """Stops the keepalive, detaches and closes the channel (after any copy in the pool has
        finished)."""
        self._stop_keepalive()
        with self._lock:
            att, self._attached = self._attached, None
        if att is not None:
            try:
                self.client.detach(att.id)
            except errors.TandemError:
                pass
            with self._staging_lock:
                att.close()
        self.client.close()

    def _count(self, what: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[what] += n

    def key_hash(self, key) -> bytes:
        """The 8-byte prefix hash of the engine's page key `key` (str or bytes) in this backend's
        namespace."""
        k = key if isinstance(key, (bytes, bytearray)) else str(key).encode()
        return hashlib.sha256(self._ns.encode() + b"|" + bytes(k)).digest()[:8]

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
                    # Replaced while this thread waited (another thread found the worker restarted
                    # and attached again): this attach's pool is unmapped, and the restarted worker
                    # may have given the new attach the same id — use the new one.
                    if self._attached is not att:
                        continue
                    return True, f(att)
            except LOST as e:
                self._drop(att, e)
                if not isinstance(e, errors.NotAttached) or attempt:
                    return False, None
            except errors.TandemError as e:
                self._count("refused")
                self._log(type(e).__name__, "tandem: refused: %s", e)
                return False, None
        return False, None

    # -- the page operations -----------------------------------------------------------------------

    def leading_hits(self, keys) -> int:
        """How many leading `keys` the worker's tiers hold (L2 + L3): one Lookup per 4,096 keys; 0
        while the worker cannot answer."""
        keys = list(keys)
        if not keys:
            return 0
        self._count("lookups")

        def run(att):
            total = 0
            for i in range(0, len(keys), LOOKUP_BATCH):
                part = keys[i : i + LOOKUP_BATCH]
                r = self.client.lookup(att.id, [self.key_hash(k) for k in part])
                hit = min(len(part), sum(h.pages for h in r.hits))
                total += hit
                if hit < len(part):
                    break
            return total

        ok, n = self._call(run, staging=False)
        return int(n) if ok else 0

    def store_pages(self, keys, spans):
        """Stores page `keys[i]` from the spans `spans[i]` (a list of (address, length) whose lengths
        total the worker's page bytes): per key True when the worker accepted the page. Stops at
        the first page the worker does not accept (its tiers are full or it went away)."""
        keys = list(keys)
        out = [False] * len(keys)

        def run(att):
            pool = att.pool()
            done = 0
            for i in range(0, len(keys), len(self._staging)):
                part = range(i, min(len(keys), i + len(self._staging)))
                pages = self._staging[: len(part)]
                for j, page in zip(part, pages):
                    size = sum(s for _, s in spans[j])
                    if size != pool.page_bytes:
                        raise ValueError(f"a page of {size} B, the worker's pages are {pool.page_bytes} B")
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
            self._count("stored", n)
        return out

    def load_pages(self, keys, spans):
        """Loads the leading pages of `keys` present into the spans `spans[i]`: per key True when
        its bytes were copied there. A page after the first miss is never loaded (the worker loads
        leading pages only)."""
        keys = list(keys)
        out = [False] * len(keys)

        def run(att):
            pool = att.pool()
            got = 0
            for i in range(0, len(keys), len(self._staging)):
                part = range(i, min(len(keys), i + len(self._staging)))
                pages = self._staging[: len(part)]
                for j in part:
                    size = sum(s for _, s in spans[j])
                    if size != pool.page_bytes:
                        raise ValueError(f"a page of {size} B, the worker's pages are {pool.page_bytes} B")
                n = min(loaded_pages(self.client.load(att.id, [self.key_hash(keys[j]) for j in part], pages)), len(part))
                for j, page in zip(part[:n], pages):
                    copy_spans(spans[j], pool.page_spans(page))
                    out[j] = True
                got += n
                if n < len(part):
                    break
            return got

        ok, n = self._call(run)
        if ok:
            self._count("loaded", n)
        return out
