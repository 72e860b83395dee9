"""The tier calls on a decode worker (issue 14): the operator renders SGLang and vLLM engines on
DecodePools too, with the same L3 adapter as on PrefillPools, so a decode worker beside such an
engine serves Lookup, Load and Store from its own L2 and the CacheTier (`roles::decode::
serves_tiers`), loopback net 127.0.152.x.

- SGLang's backend on a decode worker with a CacheTier replica: a round trip is byte-identical,
  pages are written through to L3, and after the decode worker is SIGKILLed and restarted every key
  still exists and reads back identical (from L3: the new process's L2 is empty).
- Negative control: the same worker beside the Simulated engine (which Reserves its decode pages
  for rooms, so its pool is not the tier calls' to use) answers TIER_UNAVAILABLE.
- The worker's front door beside SGLang (which serves its own API) answers 421
  `engine_serves_its_own_api` at once; beside the Simulated engine it takes the request.
- Beside SGLang the decode is Ready on the attach alone (no prefill peer exists here: the engine
  serves whole requests on its own API); beside the Simulated engine it is not.
"""

import json
import time
import urllib.error
import urllib.request

import pytest

from tandem_kv import errors
from tandem_kv.client import EngineClient, engine_identity
from tandem_kv.sglang import TandemHiCacheStorage

from conftest import MODEL, free_ports, ready, until
from hostpool import HostPool, chain_keys, indices
from test_sglang import storage_config
from test_sglang_l3 import L3, l3_written, tier_config

NET = 152


def post_completion(w):
    """(status, body) of a small completion on `w`'s front door, and the seconds it took."""
    url = f"http://{w.ip}:{w.config['ports']['frontDoor']}/v1/completions"
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), time.monotonic() - t0


CACHE = {"tier": "l3", "service": L3, "replicas": 1, "pageTokens": 512, "writePolicy": "writeThrough"}


def test_an_sglang_decode_worker_serves_the_tiers_and_keys_survive_its_restart(make_worker):
    make_worker.cache(NET, 5, tier_config(free_ports(1)[0]), names=(L3,))
    w = make_worker(NET, 1, role="decode", cache=CACHE)
    pool = HostPool(16)
    b = TandemHiCacheStorage(storage_config(w.socket_dir, timeout_s=2.0), {})
    b.register_mem_pool_host(pool)
    try:
        until(lambda: b._session() is not None, 20, "attach to the decode worker")
        until(lambda: ready(w), 10, "the SGLang decode ready on the attach alone")
        status, body, took = post_completion(w)
        assert (status, body["error"]["code"]) == (421, "engine_serves_its_own_api"), body
        assert took < 2.0
        pool.fill("decode")
        want = [pool.page_bytes(p) for p in range(6)]
        keys = chain_keys(6, salt=52)
        assert b.batch_set_v1(keys, indices(range(6))) == [True] * 6
        assert b.batch_exists(keys) == 6
        assert b.stats["refused"] == 0, b.stats
        until(lambda: l3_written(w) >= 6, 20, "6 pages written through to L3")
        w.kill()
        w.start()
        until(lambda: b.batch_exists(keys) == 6, 30, "every key back after the decode restart")
        pool.zero()
        assert b.batch_get_v1(keys, indices(range(6, 12))) == [True] * 6
        assert [pool.page_bytes(p) for p in range(6, 12)] == want
    finally:
        b.close()


def test_a_decode_worker_beside_the_simulated_engine_refuses_the_tier_calls(make_worker):
    make_worker.cache(NET, 6, tier_config(free_ports(1)[0]), names=(L3,))
    w = make_worker(NET, 2, role="decode", cache=CACHE, engine_kind="Simulated")
    c = EngineClient(w.socket_dir, call_timeout=2.0)
    try:
        h = c.health()
        att = c.attach(engine_identity("simulated/0.1.0", MODEL, 512, layout=h.layout))
        with pytest.raises(errors.TierUnavailable):
            c.lookup(att.id, [b"\0" * 8])
        status, body, _ = post_completion(w)
        assert status != 421, body
        assert not ready(w), "a Simulated decode without a live prefill peer must not be Ready"
    finally:
        c.close()


def test_a_write_back_decode_flushes_its_l2_to_l3_when_it_stops(make_worker):
    # Write-back: a stored page stays in the decode's L2 until eviction or drain; a graceful stop
    # (SIGTERM: the teardown's "L2 flushed to L3" step) writes it, so the restarted worker — whose
    # L2 is empty — still finds and reads it.
    make_worker.cache(NET, 7, tier_config(free_ports(1)[0]), names=(L3,))
    w = make_worker(NET, 3, role="decode", cache=dict(CACHE, writePolicy="writeBack"))
    pool = HostPool(16)
    b = TandemHiCacheStorage(storage_config(w.socket_dir, timeout_s=2.0), {})
    b.register_mem_pool_host(pool)
    try:
        until(lambda: b._session() is not None, 20, "attach to the decode worker")
        pool.fill("write-back")
        want = [pool.page_bytes(p) for p in range(4)]
        keys = chain_keys(4, salt=54)
        assert b.batch_set_v1(keys, indices(range(4))) == [True] * 4
        assert l3_written(w) == 0, "write-back: nothing written to L3 before the drain"
        w.stop()
        w.start()
        until(lambda: b.batch_exists(keys) == 4, 30, "every key back from L3 after the graceful restart")
        pool.zero()
        assert b.batch_get_v1(keys, indices(range(4, 8))) == [True] * 4
        assert [pool.page_bytes(p) for p in range(4, 8)] == want
    finally:
        b.close()
