"""`TandemSecondaryTier`: vLLM's KV offloading reaches Tandem's tiers (L2 in the worker, L3 in the
CacheTier) as a secondary tier behind vLLM's own CPU tier.

Written against vLLM 0.33.0 (`vllm/v1/kv_offload/tiering/base.py`, `SecondaryTierManager`), loaded
by `TieringOffloadingSpec` from the tier's `module_path` (no registration, no vLLM patch):

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 4294967296,
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
of one key, bounded by `timeout_s` (a MISS while the worker is down). Shared with the SGLang
backend: the attach, reconnect after a worker restart, staging and the failure contract
(`tiers.py`).

Identity: one chunk holds the whole model's KV for `tokens_per_block x blocks_per_chunk` tokens
(every TP worker's shard), so the tier attaches as one engine of the whole model (TP 1) with that
page size; the worker refuses a model that is not its own (IDENTITY_MISMATCH), and a worker page
size other than the chunk's KV bytes is refused here — both leave the tier answering MISS, logged.

Keys: vLLM's `OffloadKey` (the block hash and KV group), namespaced by engine, the worker's model
fingerprint (vLLM's block hashes carry none: `kv_offload/spec.py`'s TODO), the model and, unless
vLLM says the bytes are parallelism-agnostic, the worker layout; hashed to engine.proto's 8-byte
prefix hashes.

Tier config keys (besides vLLM's `type` and `module_path`): `model` (required: the worker config's
`model` object), `socket_dir` (default `$TANDEM_ENGINE_SOCKET_DIR` or `/run/tandem/engine`),
`timeout_s` (1.0: each call's deadline), `retry_s` (1.0), `engine` (`vllm/<version>`), `namespace`
(extra key namespace), `staging_pages` (pages of the worker pool used, from page 0; default all).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import numpy as np

from .client import engine_identity
from .tiers import TierBackend

logger = logging.getLogger(__name__)

try:  # vLLM present (the serving image): subclass its ABC so TieringOffloadingSpec accepts us.
    from vllm.v1.kv_offload.base import LookupResult, Medium, RequestOffloadingContext
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

    _HAVE_VLLM = True
except Exception:  # pragma: no cover - no vLLM/torch: the module still imports, the class refuses.
    _HAVE_VLLM = False

    class SecondaryTierManager:  # type: ignore[no-redef]
        pass


_STOP = object()


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
        retry_s: float = 1.0,
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
        self.engine = engine or _vllm_engine()
        self.namespace = namespace
        self._init_tiers(
            socket_dir or os.environ.get("TANDEM_ENGINE_SOCKET_DIR") or "/run/tandem/engine",
            timeout_s=timeout_s,
            retry_s=retry_s,
            staging_pages=staging_pages,
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
        self._layout = "" if cfg is None or cfg.parallel.is_parallelism_agnostic else (
            f"tp{cfg.parallel.tp_size}_pp{cfg.parallel.pp_size}_pcp{cfg.parallel.pcp_size}_dcp{cfg.parallel.dcp_size}"
            f"_{cfg.kv_cache_layout or ''}"
        )
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
        self._thread = threading.Thread(target=self._run, name="tandem-tier", daemon=True)
        self._thread.start()
        self._session()  # a worker that is down is not an error here: attaching is retried

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
        return f"tandem-vllm/v1|{fingerprint}|{self.namespace}|{name}|{self._layout}"

    # -- SecondaryTierManager ----------------------------------------------------------------------

    def lookup(self, key, req_context):
        """HIT when the worker's tiers hold `key`, else MISS (also while the worker is down)."""
        try:
            return LookupResult.HIT if self.leading_hits([key]) == 1 else LookupResult.MISS
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
        """Stops the job thread after the jobs queued (each bounded) and detaches. Raises
        `RuntimeError` when the thread is still copying after the bound: vLLM then keeps its CPU
        region mapped (a tier whose shutdown fails may still use it)."""
        self._jobs.put(_STOP)
        self._thread.join(timeout=max(10.0, 8 * self.timeout_s))
        if self._thread.is_alive():
            raise RuntimeError("tandem: the tier's job thread did not stop; its copies may still touch the CPU region")
        self.close()

    # -- the job thread ----------------------------------------------------------------------------

    def _submit(self, job, store: bool) -> None:
        with self._finished_lock:
            self._in_flight += 1
        self._jobs.put((job, store))

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
                job, store = item
                result = self._do(job, store)
                with self._finished_lock:
                    self._finished.append(result)
                    self._in_flight -= 1
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


def _vllm_engine() -> str:
    try:
        import vllm

        return f"vllm/{vllm.__version__}"
    except Exception:
        return "vllm/unknown"
