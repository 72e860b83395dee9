"""The tandem-kv client against a real `tandem-worker prefill` (loopback net 127.0.131.x).

Attach (fds by SCM_RIGHTS, mapped shared), health, the typed refusals (identity mismatch, malformed
input, a second engine, a stale attach id, the Tiers calls on a worker without a tier), and failure:
a killed worker fails calls at once and within their deadline, a stopped (hung) worker fails them
at their deadline, and after a restart the same client reconnects and re-attaches.
"""

import os
import signal
import time

import pytest

import tandem_kv as t
from tandem_kv import errors, pb
from tandem_kv.pools import claim

from conftest import MODEL, PAGE_TOKENS, until

NET = 131


def ident(model=MODEL, engine="sglang/0.5.23", **kw):
    return t.engine_identity(engine, model, PAGE_TOKENS, **kw)


@pytest.fixture
def worker(make_worker):
    return make_worker(NET)


@pytest.fixture
def client(worker):
    c = t.EngineClient(worker.socket_dir, call_timeout=2.0)
    yield c
    c.close()


def test_health_then_attach_maps_the_workers_memfd_pool(worker, client):
    h = client.health()
    assert (h.role, h.page_tokens, h.layout, h.attach_id) == ("prefill", PAGE_TOKENS, pb.POOL_LAYOUT_PAGE_FIRST, 0)
    assert h.max_call_ms > 0 and h.model_fingerprint
    assert [p.kind for p in h.pools] == [pb.POOL_KIND_TARGET]
    a = client.attach(ident())
    try:
        assert a.id != 0 and a.reply.role == "prefill"
        assert a.reply.model_fingerprint == h.model_fingerprint
        p = a.pool()
        assert (p.page_count, p.layers, p.chunk_bytes) == (32, 8, PAGE_TOKENS * 64)
        assert p.page_bytes == 8 * PAGE_TOKENS * 64
        # The fd came by SCM_RIGHTS and is the worker's memfd, mapped shared and writable.
        assert os.readlink(f"/proc/self/fd/{p.fd}").startswith("/memfd:")
        data = bytes(range(256)) * (p.page_bytes // 256)
        p.write_page(3, data)
        assert p.read_page(3) == data
        assert client.health().attach_id == a.id
        # A second mapping of the same fd sees the bytes: MAP_SHARED, not a private copy.
        import mmap

        other = mmap.mmap(p.fd, p.descriptor.map_length, flags=mmap.MAP_SHARED)
        off = p.chunk_offset(3, 0)
        assert other[off : off + 256] == data[:256]
        other.close()
        assert client.detach(a.id).rooms_aborted == 0
        assert client.health().attach_id == 0
    finally:
        a.close()


def test_mismatched_identity_is_refused_typed_and_allocates_nothing(worker, client):
    with pytest.raises(errors.IdentityMismatch) as e:
        client.attach(ident(model=dict(MODEL, layers=9)))
    assert (e.value.field, e.value.ours, e.value.theirs) == ("model.layers", "8", "9")
    assert e.value.code.name == "FAILED_PRECONDITION"
    with pytest.raises(errors.IdentityMismatch) as e:
        client.attach(ident(engine="vllm/0.33.0"))
    assert e.value.field == "engine"
    with pytest.raises(errors.IdentityMismatch) as e:
        client.attach(ident(layout="layer_first"))
    assert client.health().attach_id == 0
    # Negative control: the same call with the right identity attaches.
    a = client.attach(ident())
    a.close()


def test_malformed_requests_get_typed_errors_and_the_worker_lives(worker, client):
    a = client.attach(ident())
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.Malformed) as e:
            client.lookup(a.id, [])
        assert e.value.field == "prefix_hashes"
        with pytest.raises(errors.PageOutOfRange):
            client.pages_ready(a.id, pb.RoomRef(room_id=1, generation=1), [10_000])
        with pytest.raises(errors.UnknownRoom):
            client.pages_ready(a.id, pb.RoomRef(room_id=1, generation=1), [1])
        with pytest.raises(errors.NotAttached):
            client.detach(a.id + 1000)
        # An identity with nothing in it: refused, typed.
        with pytest.raises(errors.ApiError):
            client.attach_only(pb.EngineIdentity())
        assert time.monotonic() - t0 < 2.0, "refusals must be immediate"
        assert worker.proc.poll() is None
        assert client.health().attach_id == a.id
    finally:
        a.close()


def test_one_engine_at_a_time_and_claims_are_checked(worker, client):
    a = client.attach(ident())
    try:
        with pytest.raises(errors.AlreadyAttached):
            client.attach(ident())
        # A second claim of the same attach, and a wrong token: the pools socket refuses, typed.
        sock = os.path.join(worker.socket_dir, "pools.sock")
        with pytest.raises(errors.PoolsError) as e:
            claim(sock, a.id, a.reply.claim_token, timeout=2.0)
        assert e.value.reason == "ALREADY_CLAIMED"
    finally:
        a.close()
    # Closing the pools connection ends the attach on the worker.
    until(lambda: client.health().attach_id == 0, 5, "the attach ends when its connection closes")
    reply = client.attach_only(ident())
    with pytest.raises(errors.PoolsError) as e:
        claim(os.path.join(worker.socket_dir, "pools.sock"), reply.attach_id, reply.claim_token ^ 1, timeout=2.0)
    assert e.value.reason in ("ALREADY_CLAIMED", "NOT_ATTACHED")


def test_tier_calls_are_typed_and_round_trip_when_wired(worker, client):
    a = client.attach(ident())
    try:
        h = [b"\x00\x01\x02\x03\x04\x05\x06\x07"]
        # A pool this attach does not have: refused as malformed, typed, before any tier is asked.
        with pytest.raises(errors.Malformed) as e:
            client.load(a.id, h, [0], pools=[pb.POOL_KIND_DRAFT])
        assert e.value.field == "pools[0]"
        try:
            client.lookup(a.id, h)
        except errors.TierUnavailable as e:
            # A worker build without the Tiers calls wired (main at this commit): every tier call
            # says so, typed.
            assert e.reason == "TIER_UNAVAILABLE" and e.code.name == "FAILED_PRECONDITION"
            for call in (lambda: client.store(a.id, h, [0]), lambda: client.load(a.id, h, [0])):
                with pytest.raises(errors.TierUnavailable):
                    call()
            return
        # Wired: Store copies the page, Lookup finds it, Load writes it back into another page.
        p = a.pool()
        data = bytes((i * 7 + 3) & 0xFF for i in range(p.page_bytes))
        p.write_page(2, data)
        assert client.store(a.id, h, [2]).pages == 1
        assert sum(t.pages for t in client.lookup(a.id, h + [b"\xff" * 8]).hits) == 1
        events = client.load(a.id, h, [5])
        assert events[-1].WhichOneof("event") == "done" and events[-1].done.pages == 1
        assert {(e.layer.layer) for e in events if e.WhichOneof("event") == "layer"} == set(range(p.layers))
        assert p.read_page(5) == data
    finally:
        a.close()


def test_streams_end_at_their_deadline(worker, client):
    a = client.attach(ident())
    try:
        t0 = time.monotonic()
        with pytest.raises((errors.DeadlineExceeded, errors.CallTimeout)):
            list(client.watch_work(a.id, timeout=0.5))
        assert time.monotonic() - t0 < 1.5
    finally:
        a.close()


def test_killed_worker_fails_calls_within_their_timeout_then_reattach_after_restart(worker, client):
    a = client.attach(ident())
    stream = client.watch_source_free(a.id, timeout=30)
    worker.kill()
    # The open stream ends with the connection, not at its 30 s deadline.
    t0 = time.monotonic()
    with pytest.raises(errors.WorkerUnavailable):
        next(stream)
    assert time.monotonic() - t0 < 5
    for call in (client.health, lambda: client.detach(a.id), lambda: client.lookup(a.id, [b"12345678"])):
        t0 = time.monotonic()
        with pytest.raises(errors.WorkerUnavailable):
            call()
        assert time.monotonic() - t0 < client.call_timeout + 0.5
    a.close()
    worker.start()
    # The same client reconnects by itself; the old attach is gone; a new one works.
    until(lambda: client.health(), 10, "health after the restart")
    with pytest.raises(errors.NotAttached):
        client.detach(a.id if a.id != 1 else 999)
    b = client.attach(ident())
    try:
        assert client.health().attach_id == b.id
        assert b.pool().page_count == 32
    finally:
        b.close()


def stopped(pid):
    """True when every thread of `pid` is stopped (state T)."""
    tasks = os.listdir(f"/proc/{pid}/task")
    return all(open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] == "T" for t in tasks)


def test_hung_worker_fails_calls_at_their_deadline(worker, client):
    assert client.health().role == "prefill"  # connected before the worker hangs
    worker.signal(signal.SIGSTOP)
    until(lambda: stopped(worker.proc.pid), 5, "the worker is stopped")
    try:
        for timeout in (0.3, 1.0):
            t0 = time.monotonic()
            with pytest.raises(errors.CallTimeout):
                client.health(timeout=timeout)
            took = time.monotonic() - t0
            assert timeout - 0.05 <= took < timeout + 1.0, took
    finally:
        worker.signal(signal.SIGCONT)
    assert client.health().role == "prefill"
