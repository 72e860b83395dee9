"""vLLM prefill/decode through Tandem, the decode side (issue 14): a client's request enters the
decode worker's front door, which picks the prefill and hands the request to the vLLM engine's
API (`roles::decode::own_api`); vLLM's real `Scheduler` runs `TandemConnector`
(`tandem_kv.vllm_pd`, loaded by module path), which Reserves the room under the front door's id,
waits for the KV the prefill wrote into the worker's pool, copies it into vLLM's blocks and
Finishes. Loopback net 127.0.153.x; the vLLM venv (`worker/tools/vllm-venv.sh`).

- A request is served: every token row of every layer in vLLM's blocks equals the prefill's
  bytes, the worker counts the room, and the blocks came through the connector's load.
- An aborted request's blocks are not reused before the room's SafeToReuse: with the prefill
  worker stopped (it cannot acknowledge the abort), a second request that needs those blocks
  waits; once the prefill resumes, SafeToReuse arrives, vLLM frees the blocks, and the second
  request gets them and is served. Negative control: a connector that hands the blocks back at
  the abort (without waiting for SafeToReuse) lets the second request take them while the
  release is still pending — the check catches it.
- A request whose KV never comes (the prefill never answers) fails its room at the KV deadline:
  vLLM gets the blocks as load errors, after the room's SafeToReuse, and recomputes.
- A hand-off the prefill's engine refuses (an error status) fails at once: the Reserve is
  refused, no room opens on the prefill, and vLLM recomputes without waiting for the KV deadline.

- vLLM on both sides: the front door hands the request to the chosen prefill's engine too; its
  connector (producer) copies the prompt's blocks into the room the decode opened, and the
  decode's blocks hold exactly what the prefill computed; both engines free every block after.
  A request sent to the prefill's engine directly, naming a handed-over id with another token,
  sends nothing: the room waits for the request that carries its token.

The other tests' prefill engine is a test double on the engine API, which can hold a room back:
it writes `vllm_engine.pattern` into its pool pages and calls PagesReady.
"""

import json
import os
import signal
import threading
import urllib.request

import pytest

if os.environ.get("TANDEM_REQUIRE_VLLM") == "1":
    import vllm.v1.core.sched.scheduler  # noqa: F401  (fails, not skips, in the vLLM venv)
else:
    pytest.importorskip("vllm.v1.core.sched.scheduler")

import numpy as np  # noqa: E402

from vllm.v1.request import RequestStatus  # noqa: E402

from tandem_kv.client import EngineClient, engine_identity  # noqa: E402
from tandem_kv.vllm_pd import DecodeLoader  # noqa: E402

from conftest import MODEL as BASE_MODEL  # noqa: E402
from conftest import PAGE_TOKENS, kill_all, pd_workers, post_front_door, serve_json, until  # noqa: E402
from vllm_engine import Engine, pattern  # noqa: E402

NET = 153
PROMPT = 1000  # two 512-token worker pages; 63 vLLM blocks of 16
# Two KV heads (the head order inside a row counts), 64-byte rows as conftest's MODEL.
MODEL = dict(BASE_MODEL, name="tiny-8l-2h", kv_heads=2, head_dim=8)
ROW = 2 * MODEL["kv_heads"] * MODEL["head_dim"] * MODEL["dtype_bytes"]


class PrefillDouble:
    """The prefill's engine: attaches to the prefill worker, and for each PrefillWork writes
    `pattern(request_id, hand_off_token)` into free pages of its pool and calls PagesReady (unless the request id
    is in `hold`); pages come back on SourceFree. Its HTTP API (`host:port`) takes the front
    door's hand-off: 200 with one token, or `http_status` when set (a refusal); `posted` records
    the bodies."""

    def __init__(self, socket_dir, host, port):
        self.http_status = 200
        self.posted = []
        self.http = serve_json(host, port, self._hand_off)
        self.client = EngineClient(socket_dir)
        self.att = self.client.attach(engine_identity("vllm/0.33.0", MODEL, PAGE_TOKENS))
        self.pool = self.att.pool()
        self.free = list(range(self.pool.page_count))
        self.hold = set()
        self.seen = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._work, daemon=True).start()
        threading.Thread(target=self._source_free, daemon=True).start()

    def _hand_off(self, body):
        self.posted.append(body)
        return self.http_status, {"choices": [{"text": "x"}]}

    def _work(self):
        while not self._stop.is_set():
            try:
                for w in self.client.watch_work(self.att.id, timeout=3600):
                    self._serve(w)
            except Exception:
                if self._stop.wait(0.1):
                    return

    def _serve(self, w):
        with self._lock:
            self.seen.append(w.request_id)
        if w.request_id in self.hold:
            return
        n_pages = -(-w.tokens // PAGE_TOKENS)
        with self._lock:
            pages, self.free = self.free[:n_pages], self.free[n_pages:]
        want = pattern(w.request_id, n_pages * PAGE_TOKENS, MODEL["layers"], ROW, w.hand_off_token)
        for k, page in enumerate(pages):
            rows = want[k * PAGE_TOKENS : (k + 1) * PAGE_TOKENS]  # (tokens, layers, row)
            self.pool.write_page(page, np.ascontiguousarray(rows.transpose(1, 0, 2)).tobytes())
        self.client.pages_ready(self.att.id, w.room, pages, first_page=0, last=True)

    def _source_free(self):
        while not self._stop.is_set():
            try:
                for ev in self.client.watch_source_free(self.att.id, timeout=3600):
                    with self._lock:
                        self.free.extend(ev.pages)
            except Exception:
                if self._stop.wait(0.1):
                    return

    def close(self):
        self._stop.set()
        self.http.shutdown()
        self.http.server_close()
        self.att.close()
        self.client.close()


def start_workers(tmp_path):
    """A prefill and a decode worker beside vLLM engines (conftest `pd_workers`), and the
    engines' HTTP port."""
    return pd_workers(tmp_path, NET, "vLLM", MODEL)


def stop_all(engines, workers):
    for e in engines:
        e.stop()
    kill_all(workers)


@pytest.fixture
def pd(tmp_path):
    """(prefill worker, decode worker, prefill double, engine factory); the engine factory
    `make(num_blocks, **extra)` starts the vLLM decode engine."""
    prefill, decode, http_port = start_workers(tmp_path)
    double = PrefillDouble(prefill.socket_dir, prefill.ip, http_port)
    engines = []

    def make(num_blocks=160, failure_policy="recompute", **extra):
        e = Engine(decode.socket_dir, MODEL, http_port, num_blocks, extra, failure_policy).start()
        engines.append(e)
        return e

    yield prefill, decode, double, make
    double.close()
    stop_all(engines, (decode, prefill))


@pytest.fixture
def pd_vllm(tmp_path):
    """(prefill worker, decode worker, prefill engine, decode engine): vLLM on both sides."""
    prefill, decode, http_port = start_workers(tmp_path)
    engines = [
        Engine(prefill.socket_dir, MODEL, http_port, 160, role="prefill", host=prefill.ip).start(),
        Engine(decode.socket_dir, MODEL, http_port, 160).start(),
    ]
    yield prefill, decode, engines[0], engines[1]
    stop_all(engines, (decode, prefill))


def post(decode, body, timeout=60):
    return post_front_door(decode, body, timeout)


def post_async(decode, body):
    out = {}

    def run():
        out["reply"] = post(decode, body)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def ready_to_serve(decode, engine):
    """The front door's id of a first request served (a prefill peer is live and the engine's
    connector attached), or None."""
    status, reply = post(decode, {"prompt": [1] * 8, "max_tokens": 1})
    return int(reply["id"].removeprefix("cmpl-")) if status == 200 else None


def test_a_request_through_the_front_door_lands_the_prefills_bytes_in_vllms_blocks(pd):
    _, decode, double, make = pd
    engine = make()
    until(lambda: ready_to_serve(decode, engine), 30, "a first request served")
    status, reply = post(decode, {"prompt": [5] * PROMPT, "max_tokens": 2})
    assert status == 200, reply
    check = reply["tandem_check"]
    # Every row loaded; vLLM computes only the last prompt token itself (to sample the next).
    assert check == {"tokens": PROMPT, "corrupt_rows": 0, "computed_tokens": 1}, check
    loader = engine.worker._loader
    assert loader.stats["loaded"] >= 2 and loader.stats["failed"] == 0, loader.stats
    # The blocks came through the connector: allocated for the load, handed back after it.
    rid = reply["id"]
    assert ("recving_done", rid) in engine.events
    assert any(e[0] == "allocated" and e[1] == rid and len(e[2]) >= PROMPT // 16 for e in engine.events)
    assert engine.free_blocks() == engine.num_blocks - 1  # vLLM's null block; every request ended


def abort_while_the_prefill_is_stopped(pd, negative: bool):
    """The abort scenario; returns (second request's reply, whether the second request got blocks
    while the first one's release was pending, the first one's blocks, the engine)."""
    prefill, decode, double, make = pd
    engine = make(num_blocks=100)  # one 1000-token request (63 blocks) at a time
    loader = engine.worker._loader
    if negative:

        def hand_back_at_once(att, ld, ok):
            with loader._lock:
                loader._done(ld, ok)

        loader._hold = hand_back_at_once
    last = until(lambda: ready_to_serve(decode, engine), 30, "a first request served")
    # The front door numbers requests in order, and nothing else sends it any here.
    first_id, second_id = last + 1, last + 2
    double.hold.add(first_id)
    t1, _ = post_async(decode, {"prompt": [5] * PROMPT, "max_tokens": 2})
    until(lambda: first_id in double.seen, 30, "the first request's room opened on the prefill")
    assert engine.status(first_id) == RequestStatus.WAITING_FOR_REMOTE_KVS, engine.status(first_id)
    first_blocks = next(e[2] for e in engine.events if e[0] == "allocated" and e[1] == f"cmpl-{first_id}")
    # The second request reaches vLLM while the prefill still runs (the front door routes only to
    # a live peer); it needs the first one's blocks, so it waits for them.
    t2, second = post_async(decode, {"prompt": [6] * PROMPT, "max_tokens": 2})
    until(lambda: engine.status(second_id) is not None, 30, "the second request reached vLLM")
    prefill.signal(signal.SIGSTOP)  # it cannot acknowledge the abort: no SafeToReuse yet
    engine.abort(first_id)
    engine.wait_steps(50)
    taken_early = any(e[0] == "allocated" and e[1] == f"cmpl-{second_id}" for e in engine.events)
    prefill.signal(signal.SIGCONT)
    t2.join(90)
    t1.join(30)
    return second.get("reply"), taken_early, first_blocks, engine


def test_an_aborted_requests_blocks_wait_for_safe_to_reuse(pd):
    reply, taken_early, first_blocks, engine = abort_while_the_prefill_is_stopped(pd, negative=False)
    assert not taken_early, "the second request got blocks while the first one's release was pending"
    assert reply is not None and reply[0] == 200, reply
    assert reply[1]["tandem_check"]["corrupt_rows"] == 0, reply
    ev = engine.events
    first = next(e for e in ev if e[0] == "allocated" and e[2] == first_blocks)[1]
    second = reply[1]["id"]
    done_first = ev.index(("recving_done", first))
    alloc_second = next(i for i, e in enumerate(ev) if e[0] == "allocated" and e[1] == second)
    assert done_first < alloc_second, ev
    # The second request reused the first one's blocks: the pool had room for only one.
    second_blocks = ev[alloc_second][2]
    assert set(first_blocks) & set(second_blocks)


def test_negative_control_blocks_handed_back_at_the_abort_are_reused_before_safe_to_reuse(pd):
    _, taken_early, _, _ = abort_while_the_prefill_is_stopped(pd, negative=True)
    assert taken_early, "the check did not catch blocks reused before the room's SafeToReuse"


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_room_that_never_completes_is_a_load_error_after_its_release(pd, policy):
    _, decode, double, make = pd
    engine = make(failure_policy=policy)
    next_id = until(lambda: ready_to_serve(decode, engine), 30, "a first request served") + 1
    double.hold.add(next_id)
    status, reply = post(decode, {"prompt": [5] * PROMPT, "max_tokens": 1, "kv_deadline_ms": 500})
    assert status == 200, reply
    loader = engine.worker._loader
    assert loader.stats["failed"] == 1 and loader.stats["release_timeouts"] == 0, loader.stats
    rid = f"cmpl-{next_id}"
    assert ("recving_done", rid) in engine.events
    if policy == "recompute":
        # vLLM recomputed the whole prompt locally (the KV deadline failed the room).
        assert reply["tandem_check"]["computed_tokens"] == PROMPT, reply
        assert reply["choices"][0]["finish_reason"] == "length", reply
    else:
        # vLLM's default: the request ends with an error, never with blocks it did not fill.
        assert reply["choices"][0]["finish_reason"] == "error" and reply["tandem_check"] is None, reply
    assert engine.free_blocks() == engine.num_blocks - 1


def test_a_hand_off_the_prefills_engine_refuses_fails_at_once_and_the_decode_recomputes(pd):
    _, decode, double, make = pd
    engine = make()
    next_id = until(lambda: ready_to_serve(decode, engine), 30, "a first request served") + 1
    assert double.posted and double.posted[-1]["max_tokens"] == 1, double.posted
    double.http_status = 503  # e.g. still loading its weights
    # A KV deadline far beyond the wait below: the answer must not wait for it.
    status, reply = post(decode, {"prompt": [5] * PROMPT, "max_tokens": 1, "kv_deadline_ms": 600_000}, timeout=30)
    assert status == 200, reply
    assert reply["id"] == f"cmpl-{next_id}", reply
    # No room opened: the Reserve was refused, vLLM recomputed the whole prompt.
    assert next_id not in double.seen, double.seen
    assert reply["tandem_check"]["computed_tokens"] == PROMPT, reply
    loader = engine.worker._loader
    assert loader.stats["failed"] == 1, loader.stats
    report = decode.report()["engine"]
    assert report["prefill_refused"] == 1, report
    assert engine.free_blocks() == engine.num_blocks - 1


def test_the_loader_refuses_a_config_without_the_model():
    with pytest.raises(ValueError, match="model"):
        DecodeLoader({"socket_dir": "/nonexistent"}, 16)


def test_vllm_on_both_sides_the_prefills_computed_kv_lands_in_the_decodes_blocks(pd_vllm):
    prefill, decode, p_engine, d_engine = pd_vllm
    until(lambda: ready_to_serve(decode, d_engine), 30, "a first request served")
    for prompt in (PROMPT, 1, 513):
        status, reply = post(decode, {"prompt": [5] * prompt, "max_tokens": 3})
        assert status == 200, reply
        assert reply["tandem_check"] == {"tokens": prompt, "corrupt_rows": 0, "computed_tokens": 1}, reply
    sender = p_engine.worker._loader
    assert sender.stats["sent"] >= 4 and sender.stats["no_room"] == 0, sender.stats
    # The prefill computed each prompt once (its forward pass), and freed every block after the
    # send; the decode's too.
    assert len(p_engine.computed) == sender.stats["sent"]
    until(lambda: p_engine.free_blocks() == p_engine.num_blocks - 1, 10, "the prefill's blocks freed after the sends")
    assert d_engine.free_blocks() == d_engine.num_blocks - 1


def test_a_request_sent_to_the_prefills_engine_directly_cannot_write_a_handed_over_room(pd_vllm):
    _, decode, p_engine, d_engine = pd_vllm
    handed = until(lambda: ready_to_serve(decode, d_engine), 30, "a first request served") + 1
    # The prefill's engine sees the front door's hand-off of `handed` only once the test lets it
    # in; the decode's engine Reserves meanwhile, so the room waits on the prefill.
    let_in = p_engine.delay_first[handed] = threading.Event()
    t, first = post_async(decode, {"prompt": [5] * PROMPT, "max_tokens": 1})
    until(lambda: handed not in p_engine.delay_first, 30, "the hand-off reached the prefill's engine")
    sender = p_engine.worker._loader
    until(lambda: handed in sender._work, 30, "the decode's room reached the prefill's connector")
    # Someone who reaches the prefill's API directly names that request id with another token:
    # the prefill computes other bytes (the pattern of that token) ...
    body = {"prompt": [9] * PROMPT, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "tandem": {"request_id": handed, "token": 1}}}
    req = urllib.request.Request(p_engine.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
    # ... and sends none of them: the room stays for the request that carries its token.
    until(lambda: sender.stats["wrong_token"] == 1, 30, "the direct request's send given up")
    assert handed in sender._work
    let_in.set()
    t.join(60)
    status, reply = first["reply"]
    assert status == 200, reply
    assert reply["tandem_check"] == {"tokens": PROMPT, "corrupt_rows": 0, "computed_tokens": 1}, reply
    assert sender.stats["no_room"] == 0, sender.stats


def test_the_connector_reattaches_after_the_decode_worker_restarts(pd):
    _, decode, _, make = pd
    engine = make()
    until(lambda: ready_to_serve(decode, engine), 30, "a first request served")
    decode.restart()  # SIGKILL and start: the attach is gone, the new worker is not Ready
    # No request can reach the engine until it attached again (an unready front door admits
    # none): the keepalive must do it on its own.
    until(lambda: ready_to_serve(decode, engine), 30, "a request served after the restart")
    status, reply = post(decode, {"prompt": [5] * PROMPT, "max_tokens": 2})
    assert status == 200 and reply["tandem_check"]["corrupt_rows"] == 0, reply


def test_an_abort_of_a_load_already_reported_is_not_reported_again():
    from tandem_kv.vllm_pd import LoadSpec, TandemConnectorMetadata, _Load

    loader = DecodeLoader({"socket_dir": "/nonexistent", "model": MODEL, "keepalive_s": 0}, 16)
    try:
        spec = LoadSpec("r1", 7, 1000, 32, 0, [1, 2])
        with loader._lock:
            loader._loads["r1"] = ld = _Load(spec)
            loader._done(ld, True)  # the load finished and is reported once
        assert loader.take_finished() == (None, {"r1"})
        # vLLM aborted it before the report was processed: the abort must not report it again
        # (the scheduler asserts every finished id is still one of its requests).
        loader.start(TandemConnectorMetadata(aborts=["r1", "never-loaded"]))
        assert loader.take_finished() == (None, None)
        assert loader.take_load_errors() == set()
    finally:
        loader.close()


def test_a_request_sent_to_the_engine_directly_cannot_claim_a_handed_over_room(pd):
    _, decode, double, make = pd
    engine = make()
    handed = until(lambda: ready_to_serve(decode, engine), 30, "a first request served") + 1
    # The front door hands request `handed` over; vLLM sees it only once the test lets it in.
    let_in = engine.delay_first[handed] = threading.Event()
    t, first = post_async(decode, {"prompt": [5] * PROMPT, "max_tokens": 1})
    until(lambda: handed not in engine.delay_first, 30, "the hand-off reached the engine")
    # Meanwhile someone who reaches vLLM's API directly (the DecodePool Service targets it)
    # names that request id without the front door's hand-off token.
    body = {"prompt": [9] * PROMPT, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_prefill": True, "tandem": {"request_id": handed, "token": 1}}}
    req = urllib.request.Request(engine.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        direct = json.loads(r.read())
    # Its Reserve opened no room: it got none of the handed-over request's KV (vLLM computed the
    # whole prompt itself) ...
    assert direct["tandem_check"]["computed_tokens"] == PROMPT, direct
    # ... and the handed-over request, let in now, still gets its room and its KV.
    let_in.set()
    t.join(60)
    status, reply = first["reply"]
    assert status == 200 and reply["tandem_check"] == {"tokens": PROMPT, "corrupt_rows": 0, "computed_tokens": 1}, reply
