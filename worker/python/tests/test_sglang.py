"""TandemHiCacheStorage against a real `tandem-worker prefill` (loopback net 127.0.132.x), with a
duck-typed SGLang host pool (tests/hostpool.py; no torch, no SGLang in this venv).

Registration attaches with the identity of the host pool; a pool of another geometry is refused
and every call is then a miss (lists of bools, never None, never an exception); a killed worker
gives misses within `timeout_s` and the backend re-attaches after the restart; a hung worker costs
at most `timeout_s` per call. The data path (Store/Load/Lookup round trip) needs the worker's Tiers
calls: while they answer TIER_UNAVAILABLE the backend must degrade to misses (tested here), and the
round trip runs in test_sglang_roundtrip.py.
"""

import signal
import time
from types import SimpleNamespace

import pytest

from tandem_kv import errors
from tandem_kv.sglang import TandemHiCacheStorage

from conftest import ready, until
from hostpool import HostPool, chain_keys, indices
from test_client import stopped

NET = 132


def storage_config(socket_dir, **extra):
    cfg = dict(
        backend_name="tandem",
        module_path="tandem_kv.sglang",
        class_name="TandemHiCacheStorage",
        interface_v1=1,
        socket_dir=socket_dir,
        timeout_s=1.0,
        retry_s=0.2,
        model_name="tiny-8l",
    )
    cfg.update(extra)
    # The fields of SGLang 0.5.23's HiCacheStorageConfig the backend reads.
    return SimpleNamespace(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="org/tiny-8l", extra_config=cfg,
    )


def tiers_wired(b) -> bool:
    att = b._session()
    try:
        b.client.lookup(att.id, [b"\0" * 8])
        return True
    except errors.TierUnavailable:
        return False


@pytest.fixture
def worker(make_worker):
    return make_worker(NET)


@pytest.fixture
def backend(worker):
    b = TandemHiCacheStorage(storage_config(worker.socket_dir), {})
    yield b
    b.close()


def test_registration_attaches_with_the_host_pools_identity(worker, backend):
    assert backend.client.health().attach_id == 0
    backend.register_mem_pool_host(HostPool(4))
    backend.on_host_pools_registered()
    h = backend.client.health()
    assert h.attach_id != 0 and backend.stats["attaches"] == 1
    assert backend._attached.id == h.attach_id
    # Keys: 8 bytes, namespaced by the worker's model fingerprint and the TP rank.
    k = chain_keys(1)[0]
    assert len(backend.key_hash(k)) == 8
    assert h.model_fingerprint in backend._ns and "org-tiny-8l_0_1" in backend._ns


def test_a_pool_of_another_geometry_is_refused_and_every_call_misses(worker, backend):
    pool = HostPool(4, head_dim=32)  # the worker's model has head_dim 16
    backend.register_mem_pool_host(pool)
    assert backend._attached is None and backend.client.health().attach_id == 0
    keys = chain_keys(2)
    assert backend.batch_set_v1(keys, indices([0, 1])) == [False, False]
    assert backend.batch_get_v1(keys, indices([0, 1])) == [False, False]
    assert backend.batch_exists(keys) == 0 and backend.exists(keys[0]) is False
    # Negative control: the matching geometry attaches.
    backend.register_mem_pool_host(HostPool(4))
    # The backend tries at most once per retry_s (0.2 s): poll.
    assert until(lambda: backend._session(), 5, "attach with the right geometry")


def test_tier_unavailable_degrades_to_misses_never_none(worker, backend):
    backend.register_mem_pool_host(HostPool(4))
    if tiers_wired(backend):
        pytest.skip("this worker build serves the Tiers calls: see test_sglang_roundtrip.py")
    keys = chain_keys(3)
    for r in (backend.batch_set_v1(keys, indices([0, 1, 2])), backend.batch_get_v1(keys, indices([0, 1, 2]))):
        assert r == [False, False, False]
    assert backend.batch_exists(keys) == 0
    assert backend.stats["refused"] >= 3
    # A refusal does not drop the attach.
    assert backend.stats["lost"] == 0 and backend.client.health().attach_id == backend._attached.id


def test_worker_down_gives_misses_within_the_timeout_then_reattaches(worker, backend):
    pool = HostPool(4)
    backend.register_mem_pool_host(pool)
    first = backend._attached.id
    worker.kill()
    keys = chain_keys(4)
    for call in (
        lambda: backend.batch_exists(keys),
        lambda: backend.batch_set_v1(keys, indices([0, 1, 2, 3])),
        lambda: backend.batch_get_v1(keys, indices([0, 1, 2, 3])),
    ):
        t0 = time.monotonic()
        r = call()
        assert r in (0, [False] * 4), r
        assert time.monotonic() - t0 < backend.timeout_s + 0.5
    assert backend._attached is None
    worker.start()
    until(lambda: backend.batch_exists(keys) == 0 and backend._attached is not None, 10, "re-attach after the restart")
    assert backend.stats["attaches"] == 2
    assert backend.client.health().attach_id == backend._attached.id
    assert backend._attached is not None and first != 0


def test_the_keepalive_reattaches_after_a_worker_restart_without_any_call(worker):
    # A worker is Ready only with its engine attached, and a pod that is not Ready gets no
    # requests: the backend must come back by itself, not on SGLang's next call.
    b = TandemHiCacheStorage(storage_config(worker.socket_dir, keepalive_s=0.2), {})
    try:
        b.register_mem_pool_host(HostPool(4))
        assert b.stats["attaches"] == 1
        until(lambda: ready(worker), 10, "the worker ready with the engine attached")
        worker.kill()
        worker.start()
        until(
            lambda: b.stats["attaches"] == 2 and b.client.health().attach_id == b._attached.id,
            10,
            "the keepalive re-attached to the restarted worker",
        )
        until(lambda: ready(worker), 10, "the restarted worker ready again")
        assert b.stats["lost"] == 1
    finally:
        b.close()


def test_a_hung_worker_costs_at_most_the_timeout(worker, backend):
    backend.register_mem_pool_host(HostPool(4))
    worker.signal(signal.SIGSTOP)
    until(lambda: stopped(worker.proc.pid), 5, "the worker is stopped")
    try:
        keys = chain_keys(2)
        t0 = time.monotonic()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, indices([0, 1])) == [False, False]
        assert time.monotonic() - t0 < 2 * backend.timeout_s + 1.0
    finally:
        worker.signal(signal.SIGCONT)
    until(lambda: backend._session() is not None, 10, "re-attach once the worker runs again")


def test_calls_before_registration_are_misses(worker, backend):
    keys = chain_keys(2)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, indices([0, 1])) == [False, False]
    assert backend.batch_get_v1(keys, indices([0, 1])) == [False, False]
    assert backend.batch_get_v1([], []) == [] and backend.batch_exists([]) == 0
    assert backend.client.health().attach_id == 0
