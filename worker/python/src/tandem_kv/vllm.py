"""`TandemSecondaryTier`: vLLM's KV offloading reaches Tandem's tiers (L2 in the worker, L3 in the
CacheTier) as a secondary tier behind vLLM's own CPU tier.

Written against vLLM 0.33.0 (`vllm/v1/kv_offload/tiering/base.py`, `SecondaryTierManager`), loaded
by `TieringOffloadingSpec` from the tier's `module_path` (no registration, no vLLM patch):

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 4294967296, "block_size": 512,
        "secondary_tiers": [{"type": "TandemSecondaryTier", "module_path": "tandem_kv.vllm",
          "socket_dir": "/run/tandem/engine",
          "model": {"name": "llama-3-70b", "layers": 80, "attention": "gqa",
                    "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}}]}}'

How it works. vLLM offloads GPU blocks to its CPU tier (one chunk = `blocks_per_chunk` blocks of
every worker's shard, a row of its shared `/dev/shm` region) and cascades chunks from there to its
secondary tiers; on a CPU miss it asks them and promotes a hit back into a CPU chunk. This tier
runs in the scheduler process: `submit_store` copies the chunk rows into staging pages of the
worker's pool and sends one `Tiers.Store`, `submit_load` sends one `Tiers.Load` and copies the pages
that loaded into the chunk rows vLLM allocated; both run on one background thread (vLLM requires
submit calls not to block) and report through `get_finished_jobs`. `lookup` is one `Tiers.Lookup`
of one key on the live attach, bounded by `lookup_timeout_s`; it never attaches (a MISS until the
job thread has attached, which it is woken to do) and never waits for the job thread. Shared with
the SGLang backend: the attach, reconnect after a worker restart, staging and the failure contract
(`tiers.py`).

Identity: one chunk holds the whole model's KV for `tokens_per_block x blocks_per_chunk` tokens
(every TP worker's shard), so the tier attaches as one engine of the whole model (TP 1) with that
page size; the worker refuses a model that is not its own (IDENTITY_MISMATCH), and a worker page
size other than the chunk's KV bytes is refused here — both leave the tier answering MISS, logged.

Keys: vLLM's `OffloadKey` (the block hash and KV group), namespaced by everything that fixes the
chunk's bytes — the worker's model fingerprint (vLLM's block hashes carry none: `kv_offload/spec.py`'s
TODO), the engine and its version, the model name, the KV dtype, the host layout (canonical or
direct, the KV cache layout), the groups' block sizes and layer counts and, unless vLLM says the
bytes are parallelism-agnostic, the TP/PP/CP layout (as vLLM's own `file_mapper.py` does); hashed
to engine.proto's 8-byte prefix hashes.

Tier config keys (besides vLLM's `type` and `module_path`): `model` (required: the worker config's
`model` object), `socket_dir` (default `$TANDEM_ENGINE_SOCKET_DIR` or `/run/tandem/engine`),
`timeout_s` (1.0: the deadline of each call of a job), `lookup_timeout_s` (0.1), `retry_s` (1.0),
`locality` (vLLM's `LOCAL`/`REMOTE`), `engine` (`vllm/<version>`), `namespace`
(extra key namespace), `staging_pages` (pages of the worker pool used, from page 0; default all),
`keepalive_s` (2.0: how often the attach is checked and restored without vLLM's calls; 0 turns it
off — see `tiers.py`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import numpy as np

from . import errors
from .client import engine_identity
from .tiers import LOST, TierBackend

logger = logging.getLogger(__name__)

try:  # vLLM present (the serving image): subclass its ABC so TieringOffloadingSpec accepts us.
    from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, RequestOffloadingContext
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

    _HAVE_VLLM = True
except Exception:  # pragma: no cover - no vLLM/torch: the module still imports, the class refuses.
    _HAVE_VLLM = False

    class SecondaryTierManager:  # type: ignore[no-redef]
        pass


_STOP = object()
_ATTACH = object()


class _Close:
    """A job-thread item: close this attach (lost on the scheduler thread)."""

    def __init__(self, att):
        self.att = att


class TandemSecondaryTier(TierBackend, SecondaryTierManager):
    """A vLLM secondary offloading tier on a Tandem worker (see the module docstring)."""

    # Tandem's L2/L3 sit behind the worker: a store beyond this host's CPU tier.
    medium = Medium.STORAGE if _HAVE_VLLM else None

    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str,
        model: dict | None = None,
        socket_dir: str | None = None,
        timeout_s: float = 1.0,
        lookup_timeout_s: float = 0.1,
        retry_s: float = 1.0,
        keepalive_s: float = 2.0,
        locality: str | None = None,
        engine: str | None = None,
        namespace: str = "",
        staging_pages: int | None = None,
        backpressure_detector=None,
        **unknown,
    ):
        if not _HAVE_VLLM:
            raise RuntimeError("tandem_kv.vllm needs vLLM (vllm.v1.kv_offload.tiering)")
        if unknown:
            raise ValueError(f"TandemSecondaryTier: unknown tier config keys {sorted(unknown)}")
        if not isinstance(model, dict):
            raise ValueError("TandemSecondaryTier: the tier config needs `model` (the worker config's model object)")
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        self.model = model
        if locality is not None:
            self.locality = Locality(locality)
        self.lookup_timeout_s = float(lookup_timeout_s)
        self.engine = engine or _vllm_engine()
        self.namespace = namespace
        self._init_tiers(
            socket_dir or os.environ.get("TANDEM_ENGINE_SOCKET_DIR") or "/run/tandem/engine",
            timeout_s=timeout_s,
            retry_s=retry_s,
            staging_pages=staging_pages,
            keepalive_s=keepalive_s,
        )
        spec = offloading_spec
        self.page_tokens = int(spec.tokens_per_block[0]) * int(spec.blocks_per_chunk)
        cfg = getattr(spec, "config", None)
        world = cfg.parallel.world_size if cfg is not None else 1
        copies = 1 if getattr(spec, "replicated_layout", False) else max(1, world)
        # The KV bytes of one chunk (the row's stride may add alignment padding after them).
        self.chunk_kv_bytes = (
            cfg.worker_kv_bytes_per_block * copies * int(spec.blocks_per_chunk) if cfg is not None else self.block_size_bytes
        )
        self._format = _format_of(cfg)
        # The rows' address, without holding an export of the view: vLLM releases the view at its
        # shutdown (after ours, which stops the job thread first).
        rows = np.asarray(primary_kv_view)
        self._primary_base = rows.ctypes.data
        self._primary_rows = rows.shape[0]
        del rows

        self._jobs: queue.Queue = queue.Queue()
        self._finished: list = []
        self._finished_lock = threading.Lock()
        self._in_flight = 0
        self._attach_queued = False
        self._thread = threading.Thread(target=self._run, name="tandem-tier", daemon=True)
        self._thread.start()
        self._session()  # a worker that is down is not an error here: attaching is retried
        self._start_keepalive()

    # -- TierBackend -----------------------------------------------------------------------------

    def _identity(self, health):
        return engine_identity(self.engine, self.model, self.page_tokens, layout=health.layout)

    def _accept(self, att) -> None:
        got = att.pool().page_bytes
        if got != self.chunk_kv_bytes or got > self.block_size_bytes:
            raise ValueError(
                f"the worker's pages are {got} B, a vLLM chunk holds {self.chunk_kv_bytes} B of KV "
                f"({self.page_tokens} tokens; row stride {self.block_size_bytes} B)"
            )

    def _namespace(self, fingerprint: str) -> str:
        name = str(self.model.get("name", "unknown")).replace("/", "-")
        return f"tandem-vllm/v1|{fingerprint}|{self.namespace}|{self.engine}|{name}|{self._format}"

    # -- SecondaryTierManager ----------------------------------------------------------------------

    def lookup(self, key, req_context):
        """HIT when the worker's tiers hold `key`, else MISS (also while the worker is down or not
        attached yet). One Lookup of at most `lookup_timeout_s` on the live attach; never attaches
        and never waits for the job thread (vLLM calls it under its manager lock)."""
        att = self._attached
        if att is None:
            self._wake_attach()
            return LookupResult.MISS
        try:
            self._count("lookups")
            r = self.client.lookup(att.id, [self.key_hash(key)], timeout=self.lookup_timeout_s)
            return LookupResult.HIT if sum(h.pages for h in r.hits) >= 1 else LookupResult.MISS
        except LOST as e:
            # Closing unmaps the pool: the job thread does it between jobs, never under a copy.
            self._forget(att, e)
            self._jobs.put(_Close(att))
            self._wake_attach()
        except errors.TandemError as e:
            self._count("refused")
            self._log(type(e).__name__, "tandem: lookup refused: %s", e)
        except Exception as e:  # never into vLLM's scheduler
            self._log("lookup", "tandem: lookup failed: %r", e)
        return LookupResult.MISS

    def submit_store(self, job_metadata) -> None:
        """Queues the copy of the job's chunk rows to the worker (vLLM pins them until the job's
        result is taken)."""
        self._submit(job_metadata, store=True)

    def submit_load(self, job_metadata) -> None:
        """Queues the load of the job's keys into its chunk rows."""
        self._submit(job_metadata, store=False)

    def get_finished_jobs(self):
        with self._finished_lock:
            done, self._finished = self._finished, []
        return done

    def has_pending_work(self) -> bool:
        with self._finished_lock:
            return self._in_flight > 0 or bool(self._finished)

    def on_new_request(self, req_context):
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Returns when every submitted job has a result (each is bounded by `timeout_s` per call)."""
        self._jobs.join()

    def shutdown(self) -> None:
        """Fails the jobs not started yet, stops the job thread after the one in progress (bounded
        by `timeout_s` per call) and detaches. Raises `RuntimeError` when the thread is still
        copying after the bound: vLLM then keeps its CPU region mapped (a tier whose shutdown fails
        may still use it)."""
        # First the keepalive: an attach it dropped now would queue its close behind the stop.
        self._stop_keepalive()
        closes = []
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple):
                job, _ = item
                self._finish(JobResult(job_id=job.job_id, success=False))
            elif isinstance(item, _Close):
                closes.append(item)  # the job in progress may still use that attach's pool
            self._jobs.task_done()
        for c in closes:
            self._jobs.put(c)
        self._jobs.put(_STOP)
        self._thread.join(timeout=max(10.0, 8 * self.timeout_s))
        if self._thread.is_alive():
            raise RuntimeError("tandem: the tier's job thread did not stop; its copies may still touch the CPU region")
        self.close()

    def _reattach(self) -> None:
        # The attach maps the worker's pool: the job thread does it, between jobs.
        self._wake_attach()

    def _lost(self, att, why) -> None:
        # Closing unmaps the pool: the job thread does it between jobs, never under a copy (or
        # here, once that thread has stopped).
        self._forget(att, why)
        if self._thread.is_alive():
            self._jobs.put(_Close(att))
        else:
            att.close()

    # -- the job thread ----------------------------------------------------------------------------

    def _submit(self, job, store: bool) -> None:
        with self._finished_lock:
            self._in_flight += 1
        self._jobs.put((job, store))

    def _wake_attach(self) -> None:
        """Has the job thread attach (once queued at a time; it honours `retry_s`)."""
        with self._finished_lock:
            if self._attach_queued:
                return
            self._attach_queued = True
        self._jobs.put(_ATTACH)

    def _finish(self, result) -> None:
        with self._finished_lock:
            self._finished.append(result)
            self._in_flight -= 1

    def _spans(self, chunk_ids):
        rows = [int(c) for c in chunk_ids]
        for r in rows:
            if not 0 <= r < self._primary_rows:
                raise ValueError(f"chunk {r} outside the CPU tier's {self._primary_rows} chunks")
        stride = self.block_size_bytes
        return [[(self._primary_base + r * stride, self.chunk_kv_bytes)] for r in rows]

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, _Close):
                    item.att.close()
                    continue
                if item is _ATTACH:
                    with self._finished_lock:
                        self._attach_queued = False
                    self._session()
                    continue
                job, store = item
                try:
                    result = self._do(job, store)
                except Exception as e:  # the thread must outlive any job: vLLM waits on each one
                    self._log("job", "tandem: job %r failed: %r", getattr(job, "job_id", None), e)
                    result = JobResult(job_id=job.job_id, success=False)
                self._finish(result)
            except Exception as e:
                self._log("thread", "tandem: job thread: %r", e)
            finally:
                self._jobs.task_done()

    def _do(self, job, store: bool):
        """One job's result; never raises (a failure is a failed `JobResult`)."""
        keys = list(job.keys)
        start = time.monotonic()
        try:
            spans = self._spans(job.chunk_ids)
            if len(spans) != len(keys):
                raise ValueError(f"{len(keys)} keys for {len(spans)} chunks")
            ok = self.store_pages(keys, spans) if store else self.load_pages(keys, spans)
        except Exception as e:
            self._log("job", "tandem: %s job %d failed: %r", "store" if store else "load", job.job_id, e)
            ok = [False] * len(keys)
        done = [k for k, good in zip(keys, ok) if good]
        success = len(done) == len(keys)
        return JobResult(
            job_id=job.job_id,
            success=success,
            successful_keys=None if success or store else done,
            transfer_time=time.monotonic() - start,
            transfer_bytes=len(done) * self.chunk_kv_bytes,
        )


def _format_of(cfg) -> str:
    """What fixes a chunk's bytes besides the model (see Keys in the module docstring); "" without
    vLLM's offloading config."""
    if cfg is None:
        return ""
    groups = ",".join(f"{g.group_id}:{g.tokens_per_block}x{len(g.layer_names)}" for g in cfg.groups)
    parts = [
        f"dtype={cfg.model.dtype}",
        f"canonical={int(bool(getattr(cfg, 'canonical_layout', False)))}",
        f"layout={getattr(cfg, 'kv_cache_layout', None) or ''}",
        f"groups={groups}",
    ]
    p = cfg.parallel
    if not p.is_parallelism_agnostic:
        parts.append(f"tp{p.tp_size}_pp{p.pp_size}_pcp{p.pcp_size}_dcp{p.dcp_size}")
    return "|".join(parts)


def _vllm_engine() -> str:
    try:
        import vllm

        return f"vllm/{vllm.__version__}"
    except Exception:
        return "vllm/unknown"
