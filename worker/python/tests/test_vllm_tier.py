"""TandemSecondaryTier inside real vLLM 0.33.0 classes, against a real `tandem-worker prefill` with
engine kind vLLM (loopback net 127.0.137.x): `TieringOffloadingSpec` loads the tier from its
`module_path`, its `TieringOffloadingManager` (a real CPU primary tier in a `/dev/shm` region)
cascades stored chunks to it, and a second vLLM instance — a fresh manager with an empty CPU tier
— finds them through `lookup` and promotes them into its own CPU chunks byte-identical.

Needs torch and vLLM, which only the vLLM venv has (worker/tools/vllm-venv.sh): the module skips
without them, unless `TANDEM_REQUIRE_VLLM=1` (CI's run in that venv), where a missing vLLM fails.
"""

import json
import os
import time
import uuid

import pytest

if os.environ.get("TANDEM_REQUIRE_VLLM") == "1":
    import vllm.v1.kv_offload.tiering.spec  # noqa: F401  (fails, not skips, in the vLLM venv)
else:
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

import numpy as np  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from tandem_kv.vllm import TandemSecondaryTier  # noqa: E402

from conftest import MODEL, Worker, free_ports, ready, until  # noqa: E402

NET = 137
# conftest's model: 8 layers x 64 B per token and layer. vLLM blocks of 16 tokens (8 KiB over the
# 8 layers), 32 blocks per offloaded chunk: one chunk = one 512-token worker page of 256 KiB.
BLOCK_TOKENS = 16
BLOCKS_PER_CHUNK = 32
BLOCK_BYTES = 8 * 64 * BLOCK_TOKENS
CHUNK_BYTES = BLOCK_BYTES * BLOCKS_PER_CHUNK
CPU_CHUNKS = 8


def offloading_config(socket_dir, chunk_blocks=BLOCKS_PER_CHUNK, block_bytes=BLOCK_BYTES, **tier):
    tier_cfg = {"type": "TandemSecondaryTier", "module_path": "tandem_kv.vllm", "socket_dir": socket_dir,
                "model": MODEL, "timeout_s": 1.0, "retry_s": 0.2}
    tier_cfg.update(tier)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS, layer_names=tuple(f"model.layers.{i}.attn" for i in range(8)), group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": CPU_CHUNKS * block_bytes * chunk_blocks, "secondary_tiers": [tier_cfg], "tier_poll_interval_s": 0},
        engine_id=f"tandem-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="org/tiny-8l", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=chunk_blocks),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False,
        ),
    )


class Instance:
    """One vLLM instance's scheduler-side offloading: the real spec, manager, CPU tier and ours."""

    def __init__(self, socket_dir, config=None, chunk_bytes=CHUNK_BYTES, **kw):
        self.spec = TieringOffloadingSpec(config or offloading_config(socket_dir, **kw))
        self.chunk_bytes = chunk_bytes
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        # (chunks, row stride) bytes over vLLM's CPU region.
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview())

    def end_step(self):
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self):
        """Ends steps until no transfer is in flight (bounded)."""
        for _ in range(200):
            self.end_step()
            if not self.manager.has_pending_work():
                return
            self.tier.drain_jobs()
        raise AssertionError("offloading jobs still pending after 200 steps")

    def chunk(self, c) -> bytes:
        return self.rows[c, : self.chunk_bytes].tobytes()

    def store(self, req, keys, payload):
        """vLLM's store path: CPU chunks for `keys`, the GPU->CPU copy (here: `payload(i)` written
        into the rows), complete_store (which cascades to the secondary tier)."""
        ctx = ReqContext(req_id=req)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == list(keys)
        for i, c in enumerate(out.store_spec.chunk_ids):
            self.rows[int(c), : self.chunk_bytes] = np.frombuffer(payload(i), dtype=np.uint8)
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()

    def promote(self, req, keys):
        """vLLM's load path on a CPU miss: lookup (the secondary tier hits, a promotion starts),
        steps until the chunks are in the CPU tier; per key the CPU chunk's bytes, or None."""
        ctx = ReqContext(req_id=req)
        self.manager.on_new_request(ctx)
        first = [self.manager.lookup(k, ctx) for k in keys]
        self.settle()
        got = []
        for k, r in zip(keys, first):
            if r is LookupResult.MISS or self.manager.lookup(k, ctx) is not LookupResult.HIT:
                got.append(None)
                continue
            spec = self.manager.prepare_load([k], ctx)
            got.append(self.chunk(int(spec.chunk_ids[0])))
            self.manager.complete_load([k], ctx)
        self.manager.on_request_finished(ctx)
        return first, got

    def close(self):
        del self.rows  # vLLM releases its view of the region at shutdown: no export may remain
        self.manager.shutdown()


def payload_of(salt, size=CHUNK_BYTES):
    def p(i):
        rng = np.random.default_rng(salt * 1000 + i)
        return rng.integers(0, 256, size, dtype=np.uint8).tobytes()

    return p


def keys_of(salt, n):
    return [make_offload_key(f"block-{salt}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]


@pytest.fixture
def worker(make_worker):
    return make_worker(NET, 1, engine_kind="vLLM")


def test_the_spec_loads_the_tier_from_its_module_path(worker):
    a = Instance(worker.socket_dir)
    try:
        assert isinstance(a.tier, TandemSecondaryTier)
        assert a.tier.page_tokens == BLOCK_TOKENS * BLOCKS_PER_CHUNK
        assert a.tier.chunk_kv_bytes == CHUNK_BYTES
        until(lambda: a.tier._session() is not None, 10, "the tier attaches")
    finally:
        a.close()


def test_a_restarted_instance_promotes_the_chunks_its_predecessor_stored(worker):
    # One engine per worker (its sidecar): the worker's tiers outlive a vLLM restart.
    a = Instance(worker.socket_dir)
    keys = keys_of(1, 3)
    pay = payload_of(1)
    try:
        a.store("a-1", keys, pay)
        assert a.tier.stats["stored"] == 3
    finally:
        a.close()
    b = Instance(worker.socket_dir)
    try:
        first, got = b.promote("b-1", keys + keys_of(2, 1))
        # The CPU tier of b is empty: every stored chunk is a secondary hit being promoted; the
        # never-stored key misses.
        assert first == [LookupResult.HIT_PENDING] * 3 + [LookupResult.MISS]
        assert got[:3] == [pay(i) for i in range(3)]
        assert got[3] is None
        assert b.tier.stats["loaded"] == 3
    finally:
        b.close()


def test_another_models_worker_is_refused_and_every_lookup_misses(make_worker):
    w = make_worker(NET, 2, engine_kind="vLLM", model=dict(MODEL, layers=4))
    a = Instance(w.socket_dir)
    try:
        for i in range(3):
            t0 = time.monotonic()
            assert a.tier.lookup(keys_of(3, 3)[i], ReqContext(req_id="x")) is LookupResult.MISS
            assert time.monotonic() - t0 < 0.5
        # Refused by the worker (IDENTITY_MISMATCH), not by the tier's own page-size check.
        assert a.tier._attached is None and a.tier.stats["attaches"] == 0 and a.tier.stats["refused"] == 0
    finally:
        a.close()


def test_a_chunk_of_other_tokens_is_refused_by_the_worker(worker):
    # 16 blocks per chunk: 256-token chunks against the worker's 512-token pages.
    a = Instance(worker.socket_dir, chunk_blocks=BLOCKS_PER_CHUNK // 2)
    try:
        assert a.tier.lookup(keys_of(4, 1)[0], ReqContext(req_id="x")) is LookupResult.MISS
        assert a.tier._attached is None and a.tier.stats["attaches"] == 0 and a.tier.stats["refused"] == 0
    finally:
        a.close()


def test_a_chunk_of_other_bytes_is_refused_by_the_tier(worker):
    # vLLM's KV is 4 B per element while `model` says 2 (the worker accepts the identity): the
    # chunk holds 512 KiB of KV, the worker's pages 256 KiB; nothing may be stored or loaded.
    a = Instance(worker.socket_dir, block_bytes=2 * BLOCK_BYTES)
    try:
        assert a.tier.lookup(keys_of(4, 1)[0], ReqContext(req_id="x")) is LookupResult.MISS
        assert a.tier._attached is None and a.tier.stats["refused"] >= 1
        a.store("x", keys_of(4, 1), lambda i: bytes(CHUNK_BYTES))
        assert a.tier.stats["stored"] == 0
    finally:
        a.close()


def test_the_keepalive_reattaches_after_a_worker_restart_without_any_call(worker):
    # The worker is Ready only with its engine attached and a pod that is not Ready gets no
    # requests: the tier must come back by itself, not on vLLM's next lookup or job.
    a = Instance(worker.socket_dir, keepalive_s=0.2)
    try:
        until(lambda: a.tier._attached is not None, 10, "the tier attaches")
        until(lambda: ready(worker), 10, "the worker ready with the engine attached")
        worker.kill()
        worker.start()
        until(
            lambda: a.tier.stats["attaches"] == 2 and a.tier.client.health().attach_id == a.tier._attached.id,
            10,
            "the keepalive re-attached to the restarted worker",
        )
        until(lambda: ready(worker), 10, "the restarted worker ready again")
        assert a.tier.stats["lost"] == 1
    finally:
        a.close()


def test_worker_down_gives_misses_and_failed_jobs_then_the_tier_reattaches(worker):
    a = Instance(worker.socket_dir)
    try:
        until(lambda: a.tier._session() is not None, 10, "the tier attaches")
        worker.kill()
        t0 = time.monotonic()
        assert a.tier.lookup(keys_of(5, 1)[0], ReqContext(req_id="x")) is LookupResult.MISS
        assert time.monotonic() - t0 <= a.tier.timeout_s + 1.0
        # A store while the worker is down: the cascade job fails within its bound, nothing hangs,
        # and the CPU tier keeps the chunks.
        a.store("down", keys_of(5, 2), payload_of(5))
        assert a.tier.stats["stored"] == 0
        worker.start()
        # The next store after the restart re-attaches (retry_s 0.2 s).
        until(lambda: a.tier._session() is not None, 10, "the tier re-attaches")
        a.store("up", keys_of(6, 2), payload_of(6))
        assert a.tier.stats["attaches"] >= 2 and a.tier.stats["lost"] >= 1
    finally:
        a.close()
    b = Instance(worker.socket_dir)
    try:
        _, got = b.promote("b", keys_of(6, 2))
        assert got == [payload_of(6)(i) for i in range(2)]
    finally:
        b.close()


def test_a_promotion_whose_chunks_are_gone_fails_and_frees_its_cpu_chunks(worker):
    """A chunk found by lookup but gone before the load (here: the worker restarted, its L2 empty
    and no L3): the job fails, vLLM frees the CPU chunks it reserved and the key misses."""
    keys = keys_of(8, 2)
    a = Instance(worker.socket_dir)
    try:
        a.store("a", keys, payload_of(8))
    finally:
        a.close()
    b = Instance(worker.socket_dir)
    try:
        ctx = ReqContext(req_id="b")
        b.manager.on_new_request(ctx)
        assert [b.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 2
        worker.restart()
        b.settle()
        assert [b.manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 2
        assert not b.manager.has_pending_work()
        assert b.tier.stats["loaded"] == 0
        b.manager.on_request_finished(ctx)
    finally:
        b.close()


def test_negative_control_a_corrupt_copy_is_detected(worker, corrupting_copy):
    """The byte comparison can fail: a copy that changes one byte per page makes the chunks differ."""
    keys = keys_of(7, 2)
    a = Instance(worker.socket_dir)
    try:
        a.store("a", keys, payload_of(7))
    finally:
        a.close()
    b = Instance(worker.socket_dir)
    try:
        _, got = b.promote("b", keys)
        assert all(g is not None for g in got)
        assert got != [payload_of(7)(i) for i in range(2)]
    finally:
        b.close()


def test_the_tier_config_needs_the_model(worker):
    with pytest.raises(ValueError, match="needs `model`"):
        Instance(worker.socket_dir, model=None)
    with pytest.raises(ValueError, match="unknown tier config keys"):
        Instance(worker.socket_dir, modle=MODEL)


def test_shutdown_stops_the_job_thread(worker):
    a = Instance(worker.socket_dir)
    thread = a.tier._thread
    a.close()
    assert not thread.is_alive()


def test_the_rendered_vllm_transfer_config_stores_and_promotes_one_chunk_per_worker_page(tmp_path):
    """The vLLM pod the operator renders (`manifests/samples/engines/vllm.yaml` through its golden
    render, `rendered.py`): vLLM's own `KVTransferConfig` accepts the rendered
    `--kv-transfer-config`; the offloading config vLLM derives from it (`block_size` tokens per
    chunk over 16-token GPU blocks: `offloading/config.py`) with the rendered secondary tier,
    against a worker run from the rendered `worker.json`, attaches (one chunk is one worker page)
    and a chunk stored by one instance is promoted byte-identical by the next. Not run: vLLM's
    argument parser and server."""
    from vllm.config import KVTransferConfig

    from rendered import flag, on_this_machine, page_bytes, rendered, tier_for

    cfg, engine = rendered("vllm")
    assert engine["command"] == ["vllm", "serve"]
    transfer = json.loads(flag(engine["args"], "--kv-transfer-config"))
    parsed = KVTransferConfig(**transfer)
    assert parsed.kv_connector == "OffloadingConnector" and parsed.kv_role == "kv_both"
    x = transfer["kv_connector_extra_config"]
    assert x["spec_name"] == "TieringOffloadingSpec"
    _, decode = rendered("vllm", "decode")
    assert json.loads(flag(decode["args"], "--kv-transfer-config")) == transfer

    l3 = "l3-rendered-vllm.serving.svc.cluster.local"
    made = []
    try:
        made.append(Worker(tmp_path, NET, 7, tier_for(cfg, free_ports(1)[0]), role="cache", config_file="tier.json", names=(l3,)).start())
        w = Worker(tmp_path, NET, 6, on_this_machine(cfg, free_ports(3), pages=4, l3_service=l3)).start()
        made.append(w)
        tier = dict(x["secondary_tiers"][0], socket_dir=w.socket_dir, keepalive_s=0.2)
        m = tier["model"]
        gpu_block = 16
        assert x["block_size"] % gpu_block == 0
        chunk_blocks = x["block_size"] // gpu_block
        block_bytes = page_bytes(m, gpu_block)
        chunk = block_bytes * chunk_blocks
        assert chunk == page_bytes(m, cfg["cache"]["pageTokens"])

        def config():
            return OffloadingConfig(
                groups=(OffloadingGroupConfig(tokens_per_block=gpu_block, layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(m["layers"])), group_id=0),),
                worker_kv_bytes_per_block=block_bytes,
                enable_kv_cache_events=False,
                # The rendered extra config, with a CPU tier of 2 chunks (the render gives it
                # hostPool.size, 8 GiB, in the pod's own /dev/shm).
                extra_config=dict(x, cpu_bytes_to_use=2 * chunk, secondary_tiers=[tier], tier_poll_interval_s=0),
                engine_id=f"tandem-rendered-{uuid.uuid4().hex[:12]}",
                model=OffloadingModelConfig(name="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16"),
                cache=OffloadingCacheConfig(tokens_per_hash=gpu_block, blocks_per_chunk=chunk_blocks),
                parallel=OffloadingParallelConfig(
                    rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
                    data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False,
                ),
            )

        keys = keys_of(9, 2)
        pay = payload_of(9, size=chunk)
        a = Instance(None, config=config(), chunk_bytes=chunk)
        try:
            until(lambda: a.tier._attached is not None, 20, "the rendered tier attaches to the rendered worker")
            a.store("a", keys, pay)
            assert a.tier.stats["stored"] == 2 and a.tier.stats["refused"] == 0, a.tier.stats
        finally:
            a.close()
        b = Instance(None, config=config(), chunk_bytes=chunk)
        try:
            _, got = b.promote("b", keys)
            assert got == [pay(i) for i in range(2)]
        finally:
            b.close()
    finally:
        for x_ in made:
            x_.kill()
