"""TandemHiCacheStorage over a worker with an L3 CacheTier (a `tandem-worker cache` replica, write
through), loopback net 127.0.136.x: after the worker is SIGKILLed and restarted, every key stored
before still exists and reads back byte-identical (from L3: the restarted worker's L2 is empty);
a worker killed in the middle of a large `batch_set_v1` leaves the call returning a list of bools,
and after the restart no key that claims to exist reads back torn bytes.

Needs a worker build that serves the Tiers calls; skips on one that answers TIER_UNAVAILABLE.
"""

import re
import threading
import urllib.request

import pytest

from tandem_kv import errors
from tandem_kv.sglang import TandemHiCacheStorage

from conftest import MODEL, free_ports, until
from hostpool import HostPool, chain_keys, indices
from test_sglang import storage_config

NET = 136
L3 = "l3-store.serving.svc.cluster.local"


def tier_config(health_port):
    return {
        "apiVersion": "tandem.dev/cache-tier-config/v1", "namespace": "serving", "tier": "l3", "revision": "t1",
        "model": MODEL, "indexer": None, "pageTokens": 512, "layout": "layerFirst", "maxTensor": 64, "maxContext": 64,
        "memoryBytes": 64 << 20, "diskBytes": 256 << 20, "persistent": True, "dataDir": "/var/lib/tandem/cache",
        "ports": {"l3": 7420, "health": health_port}, "eviction": {"policy": "LRU", "highWatermarkPercent": 90},
        "writePolicy": "writeThrough", "registrationFailure": None,
    }


@pytest.fixture
def stack(make_worker):
    ports = free_ports(1)
    make_worker.cache(NET, 5, tier_config(ports[0]), names=(L3,))
    cache = {"tier": "l3", "service": L3, "replicas": 1, "pageTokens": 512, "writePolicy": "writeThrough"}
    return make_worker(NET, 1, cache=cache)


def l3_written(w) -> int:
    url = f"http://{w.ip}:{w.config['ports']['health']}/metrics"
    text = urllib.request.urlopen(url, timeout=2).read().decode()
    m = re.search(r"^tandem_l3_pages_written_total (\d+)", text, re.M)
    return int(m.group(1)) if m else 0


def backend_on(w, pool):
    b = TandemHiCacheStorage(storage_config(w.socket_dir, timeout_s=2.0), {})
    b.register_mem_pool_host(pool)
    until(lambda: b._session() is not None, 20, "attach")
    try:
        b.client.lookup(b._attached.id, [b"\0" * 8])
    except errors.TierUnavailable:
        b.close()
        pytest.skip("this worker build answers TIER_UNAVAILABLE (Tiers not wired yet)")
    return b


def test_keys_survive_a_worker_sigkill_and_read_back_identical(stack):
    pool = HostPool(16)
    b = backend_on(stack, pool)
    try:
        pool.fill("l3")
        want = [pool.page_bytes(p) for p in range(6)]
        keys = chain_keys(6, salt=21)
        assert b.batch_set_v1(keys, indices(range(6))) == [True] * 6
        until(lambda: l3_written(stack) >= 6, 20, "6 pages written through to L3")
        stack.kill()
        assert b.batch_exists(keys) == 0  # down: a miss
        stack.start()
        until(lambda: b.batch_exists(keys) == 6, 30, "every key back after the restart")
        pool.zero()
        assert b.batch_get_v1(keys, indices(range(6, 12))) == [True] * 6
        assert [pool.page_bytes(p) for p in range(6, 12)] == want
        assert b.stats["attaches"] == 2
    finally:
        b.close()


def test_killed_mid_write_no_key_claims_a_torn_page(stack):
    pool = HostPool(64)
    b = backend_on(stack, pool)
    try:
        pool.fill("torn")
        n = 64
        want = [pool.page_bytes(p) for p in range(n)]
        keys = chain_keys(n, salt=33)
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", b.batch_set_v1(keys, indices(range(n)))))
        t.start()
        until(lambda: l3_written(stack) >= 1, 20, "the write under way")
        stack.kill()
        t.join(30)
        assert not t.is_alive()
        r = result["r"]
        assert isinstance(r, list) and len(r) == n and all(isinstance(x, bool) for x in r)
        stack.start()
        until(lambda: b._session() is not None, 20, "re-attach")
        k = b.batch_exists(keys)
        print(f"stored before the kill: {sum(r)} of {n}; back after the restart: {k}")
        pool.zero()
        got = b.batch_get_v1(keys[:k], indices(range(k)))
        assert got == [True] * k
        assert [pool.page_bytes(p) for p in range(k)] == want[:k], "a key that exists read back other bytes"
    finally:
        b.close()
