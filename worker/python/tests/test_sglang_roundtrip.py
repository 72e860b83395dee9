"""TandemHiCacheStorage's data path: v1 set/get round trips byte-identical for each SGLang host
layout (`page_first`, `layer_first`, `page_first_direct`, `page_head`), `batch_exists` is one
Lookup and counts only the shared prefix of a diverging chain, batches larger than the staging
area are split, and a restarted server with its store loaded back serves every key again.

Server: `fake` (tests/fake_worker.py: the engine API's documented Tiers semantics over a real
memfd + SCM_RIGHTS pools socket) always; `worker` (a real `tandem-worker prefill`, net 133) when its
build serves the Tiers calls — at this commit they answer TIER_UNAVAILABLE, so that case skips and
test_sglang.py checks the degradation instead.
"""

import pytest

from tandem_kv import errors
from tandem_kv.sglang import TandemHiCacheStorage

from fake_worker import FakeWorker
from hostpool import HostPool, chain_keys, indices
from test_sglang import storage_config

LAYOUTS = ["page_first", "layer_first", "page_first_direct", "page_head"]
NET = 133


@pytest.fixture(params=["fake", "worker"])
def server(request, tmp_path, make_worker):
    if request.param == "fake":
        f = FakeWorker(str(tmp_path / "sock"), pages=3).start()
        yield ("fake", f, f.dir)
        f.stop()
    else:
        w = make_worker(NET)
        yield ("worker", w, w.socket_dir)


def backend_on(socket_dir, pool):
    b = TandemHiCacheStorage(storage_config(socket_dir), {})
    b.register_mem_pool_host(pool)
    assert b._attached is not None
    try:
        b.client.lookup(b._attached.id, [b"\0" * 8])
    except errors.TierUnavailable:
        b.close()
        pytest.skip("this worker build answers TIER_UNAVAILABLE (Tiers not wired yet)")
    return b


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_byte_identical(server, layout):
    kind, srv, sock = server
    pool = HostPool(8, layout=layout)
    b = backend_on(sock, pool)
    try:
        pool.fill(layout)
        want = [pool.page_bytes(p) for p in range(7)]
        keys = chain_keys(7, salt=10 + LAYOUTS.index(layout))
        assert b.batch_set_v1(keys, indices(range(7))) == [True] * 7
        assert b.batch_exists(keys) == 7
        pool.zero()
        assert pool.page_bytes(0) != want[0]
        # Into other host pages than they came from: pages are addressed by index.
        dst = [7, 6, 5, 4, 3, 2, 1]
        assert b.batch_get_v1(keys, indices(dst)) == [True] * 7
        for i, p in enumerate(dst):
            assert pool.page_bytes(p) == want[i], f"page {i} ({layout}) differs"
        if kind == "fake":
            # 7 pages through 3 staging pages: 3 Stores and 3 Loads, and one Lookup per batch_exists.
            assert (srv.calls["Store"], srv.calls["Load"]) == (3, 3)
    finally:
        b.close()


def test_batch_exists_is_one_lookup_and_counts_the_shared_prefix(server):
    kind, srv, sock = server
    pool = HostPool(8)
    b = backend_on(sock, pool)
    try:
        pool.fill("prefix")
        a = chain_keys(6, salt=1, diverge_at=4)
        other = chain_keys(6, salt=2, diverge_at=4)
        assert a[:4] == other[:4] and a[4] != other[4]
        assert b.batch_set_v1(a, indices(range(6))) == [True] * 6
        before = srv.calls["Lookup"] if kind == "fake" else None
        assert b.batch_exists(other) == 4
        assert b.batch_exists(a) == 6
        if kind == "fake":
            assert srv.calls["Lookup"] - before == 2
        # A miss in the middle: get loads the leading pages only.
        pool.zero()
        assert b.batch_get_v1(other, indices(range(6))) == [True] * 4 + [False] * 2
        assert b.batch_exists(chain_keys(3, salt=99)) == 0
    finally:
        b.close()


def test_restarted_server_serves_the_keys_after_reattach(tmp_path):
    store = {}
    f = FakeWorker(str(tmp_path / "s"), pages=3, store=store).start()
    pool = HostPool(4)
    b = TandemHiCacheStorage(storage_config(f.dir), {})
    try:
        b.register_mem_pool_host(pool)
        pool.fill("restart")
        want = [pool.page_bytes(p) for p in range(4)]
        keys = chain_keys(4, salt=5)
        assert b.batch_set_v1(keys, indices(range(4))) == [True] * 4
        f.stop()
        assert b.batch_exists(keys) == 0  # down: a miss, not an exception
        f = FakeWorker(str(tmp_path / "s"), pages=3, store=store).start()
        # The first call after the restart re-attaches (NotAttached or a new connection) and answers.
        import time

        end = time.monotonic() + 10
        while b.batch_exists(keys) != 4:
            assert time.monotonic() < end, "no re-attach within 10 s"
        pool.zero()
        assert b.batch_get_v1(keys, indices(range(4))) == [True] * 4
        assert [pool.page_bytes(p) for p in range(4)] == want
        assert b.stats["attaches"] == 2
    finally:
        b.close()
        f.stop()


def test_negative_control_a_corrupt_copy_is_detected(tmp_path, request):
    """The byte comparison can fail: a copy that changes one byte per page makes the pages differ."""
    f = FakeWorker(str(tmp_path / "s"), pages=3).start()
    pool = HostPool(4)
    b = backend_on(f.dir, pool)
    try:
        pool.fill("neg")
        want = [pool.page_bytes(p) for p in range(2)]
        keys = chain_keys(2, salt=77)
        request.getfixturevalue("corrupting_copy")
        assert b.batch_set_v1(keys, indices(range(2))) == [True] * 2
        pool.zero()
        assert b.batch_get_v1(keys, indices(range(2))) == [True] * 2
        assert [pool.page_bytes(p) for p in range(2)] != want
    finally:
        b.close()
        f.stop()


def test_concurrent_prefetch_and_backup_threads_do_not_mix_pages(tmp_path):
    """SGLang calls batch_get_v1 (prefetch thread) and batch_set_v1 (backup thread) at once; both
    go through the same staging pages, so each batch must still read back its own bytes."""
    import threading

    f = FakeWorker(str(tmp_path / "s"), pages=2).start()
    pool = HostPool(16)
    b = backend_on(f.dir, pool)
    try:
        pool.fill("concurrent")
        base = chain_keys(4, salt=40)
        assert b.batch_set_v1(base, indices(range(4))) == [True] * 4
        want = [pool.page_bytes(p) for p in range(4)]
        errs = []

        def backup():
            for i in range(10):
                keys = chain_keys(4, salt=100 + i)
                if b.batch_set_v1(keys, indices(range(4, 8))) != [True] * 4:
                    errs.append(f"set {i}")

        def prefetch():
            for i in range(10):
                dst = list(range(8 + (i % 2) * 4, 12 + (i % 2) * 4))
                if b.batch_get_v1(base, indices(dst)) != [True] * 4:
                    errs.append(f"get {i}")
                elif [pool.page_bytes(p) for p in dst] != want:
                    errs.append(f"bytes {i}")

        ts = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not any(t.is_alive() for t in ts) and errs == []
    finally:
        b.close()
        f.stop()
