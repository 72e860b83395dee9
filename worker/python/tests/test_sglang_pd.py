"""SGLang prefill/decode through Tandem (issue 14): the `tandem` transfer backend
(`tandem_kv.sglang_pd`) inside SGLang 0.5.23's real plugin loader, `get_kv_class`, KV pool
(`MHATokenToKVPool`) and metadata buffers, on CPU, behind real prefill and decode workers and the
decode's front door. Loopback net 127.0.155.x; the SGLang venv (`worker/tools/sglang-venv.sh`).

SGLang's scheduler cannot run here (it needs a model runner), so each engine is a test double of
its PD scheduler around the real backend classes, making the calls SGLang 0.5.23 makes, in its
order (`disaggregation/prefill.py`, `decode.py`): the prefill polls its sender until
`WaitingForInput`, "computes" the prompt (writes a known pattern into its pages and the first
output token into its metadata slot), `init`s the sender and `send`s the pages in two chunks,
then polls until `Success`; the decode `init`s its receiver, allocates pages and a metadata slot,
`send_metadata`, and polls until `Success` or `Failed`.

- `--disaggregation-transfer-backend tandem` is accepted by SGLang's argument parser and
  `get_kv_class` answers the backend's classes once SGLang's `load_plugins()` ran the entry
  point; the other backends are untouched.
- A client's request through the decode's front door: every token row of every layer in the
  decode's pages equals what the prefill computed, and so does the first output token (the
  metadata trailer); both engines' pages go back.
- An aborted decode request answers `Failed` (when SGLang frees its pages) only after the room's
  SafeToReuse: with the prefill worker stopped (it cannot acknowledge the abort; the gate on
  `ack-only`) it stays `Transferring`. Negative control: a backend that reports the failure at
  the abort answers `Failed` while a write could still land — the check catches it.
- A request that did not come through the front door fails at once with a clear error.
"""

import json
import math
import os
import signal
import threading
from types import SimpleNamespace

import pytest

if os.environ.get("TANDEM_REQUIRE_SGLANG") == "1":
    import torch
    import sglang.srt.disaggregation.decode  # noqa: F401  (fails, not skips, in the SGLang venv)
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang.srt.disaggregation.decode")

import numpy as np  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import (  # noqa: E402
    DisaggregationMode,
    KVClassType,
    MetadataBuffers,
    TransferBackend,
    get_kv_class,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

from tandem_kv import sglang_pd  # noqa: E402

from conftest import MODEL as BASE_MODEL  # noqa: E402
from conftest import kill_all, pd_workers, post_front_door, serve_json, until  # noqa: E402

NET = 155
PS = 16  # SGLang's page size
PROMPT = 1000  # 63 SGLang pages; two 512-token worker pages plus the metadata trailer
MODEL = dict(BASE_MODEL, name="tiny-8l-2h", kv_heads=2, head_dim=8)
HEADS, DIM, LAYERS = MODEL["kv_heads"], MODEL["head_dim"], MODEL["layers"]

load_plugins()  # what SGLang runs first in each of its processes: the entry point registers `tandem`


def backend(kind):
    return get_kv_class(TransferBackend("tandem"), kind)


def poll_until(x, states, within=60.0):
    """Polls `x` (a sender or receiver) until its state is one of `states`; returns it."""
    return until(lambda: (lambda p: (p,) if p in states else None)(x.poll()), within, f"a poll in {states}")[0]


def kv_pattern(room: int, tokens: int, layer: int, v: bool):
    """The K (or V) a test prefill computes for `room`: (tokens, heads, dim) float16, small
    integers (exact in float16), distinct per room, token, layer, head and element."""
    t = np.arange(tokens)[:, None, None]
    e = np.arange(HEADS * DIM).reshape(1, HEADS, DIM)
    return (((room % 997) * 7 + t * 31 + layer * 131 + e + (500 if v else 0)) % 1021).astype(np.float16)


def first_token(room: int) -> int:
    return 1 + room % 30_000


class SglangEngine:
    """A test double of SGLang's PD scheduler around the real `tandem` backend (module docstring):
    an HTTP API on (host, port) taking the front door's hand-off, a real `MHATokenToKVPool` and
    `MetadataBuffers` on CPU, and the backend's manager from SGLang's `get_kv_class`. `gate`
    (prefill) holds every request before its send while cleared; `receivers` (decode) are the
    live receivers by room."""

    def __init__(self, role, socket_dir, host, port, pages=160, hidden_size=16):
        self.role = role
        self.kv = MHATokenToKVPool(pages * PS, PS, torch.float16, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
                                   device="cpu", enable_memory_saver=False)
        self.meta = MetadataBuffers(8, hidden_size=hidden_size, hidden_states_dtype=torch.float16, max_sampling_mask_tokens=1)
        args = KVArgs()
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = self.kv.get_contiguous_buf_infos()
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        args.page_size, args.state_types, args.pp_rank, args.gpu_id = PS, [], 0, 0
        os.environ[sglang_pd.CONFIG_ENV] = json.dumps({"model": MODEL, "socket_dir": socket_dir, "keepalive_s": 0.2})
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        self.mgr = backend(KVClassType.MANAGER)(args, mode, SimpleNamespace(device="cpu"), False)
        self.free = list(range(1, pages))  # SGLang keeps page 0 as padding
        self.slots = list(range(8))
        self.gate = threading.Event()
        self.gate.set()
        self.receivers = {}
        self.polls = {}
        self._lock = threading.Lock()
        self.http = serve_json(host, port, self.serve)

    def _alloc(self, n):
        with self._lock:
            pages, self.free = self.free[:n], self.free[n:]
            slot = self.slots.pop()
        assert len(pages) == n, "test pool exhausted"
        return pages, slot

    def _release(self, pages, slot):
        with self._lock:
            self.free.extend(pages)
            self.slots.append(slot)

    def _tokens(self, pages, n):
        p = np.asarray(pages)[np.arange(n) // PS]
        return torch.from_numpy(p * PS + np.arange(n) % PS)


    def serve(self, body):
        room, addr = body["bootstrap_room"], f"{body['bootstrap_host']}:{body['bootstrap_port']}"
        n = len(body["prompt"])
        n_pages = math.ceil(n / PS)
        if self.role == "prefill":
            sender = backend(KVClassType.SENDER)(self.mgr, addr, room)
            if poll_until(sender, (KVPoll.WaitingForInput, KVPoll.Failed), 30) == KVPoll.Failed:
                return 503, {"error": sender.error}
            pages, slot = self._alloc(n_pages)
            idx = self._tokens(pages, n)
            for layer in range(LAYERS):  # the forward pass, as far as the KV goes
                self.kv.k_buffer[layer][idx] = torch.from_numpy(kv_pattern(room, n, layer, False))
                self.kv.v_buffer[layer][idx] = torch.from_numpy(kv_pattern(room, n, layer, True))
            self.meta.output_ids[slot, 0] = first_token(room)
            self.gate.wait(60)
            sender.init(n_pages, slot)
            sender.send(np.asarray(pages[: n_pages // 2], dtype=np.int32))
            sender.send(np.asarray(pages[n_pages // 2 :], dtype=np.int32))
            poll = poll_until(sender, (KVPoll.Success, KVPoll.Failed))
            sender.clear()
            self._release(pages, slot)
            return 200, {"poll": int(poll)}
        receiver = backend(KVClassType.RECEIVER)(self.mgr, addr, room)
        receiver.init(0)
        if receiver.poll() != KVPoll.WaitingForInput:
            return 503, {"error": receiver.error}
        pages, slot = self._alloc(n_pages)
        self.meta.output_ids[slot, 0] = 0
        self.receivers[room] = receiver
        receiver.send_metadata(np.asarray(pages, dtype=np.int32), slot)
        poll = poll_until(receiver, (KVPoll.Success, KVPoll.Failed), 120)
        self.polls[room] = poll
        check = None
        if poll == KVPoll.Success:
            idx = self._tokens(pages, n)
            corrupt = 0
            for layer in range(LAYERS):
                k = self.kv.k_buffer[layer][idx].numpy()
                v = self.kv.v_buffer[layer][idx].numpy()
                bad = (k != kv_pattern(room, n, layer, False)).any(axis=(1, 2)) | (v != kv_pattern(room, n, layer, True)).any(axis=(1, 2))
                corrupt += int(bad.sum())
            check = {"tokens": n, "corrupt_rows": corrupt, "first_token": int(self.meta.output_ids[slot, 0]) == first_token(room)}
        receiver.clear()
        self._release(pages, slot)
        return 200, {"poll": int(poll), "tandem_check": check, "error": receiver.error}

    def close(self):
        self.http.shutdown()
        self.http.server_close()
        self.mgr.close()


@pytest.fixture
def make_pd(tmp_path):
    """`make(decode_hidden_size=16)` -> (prefill worker, decode worker, prefill engine, decode
    engine); the decode's metadata layout differs from the prefill's when its hidden size does."""
    made = []

    def make(decode_hidden_size=16):
        prefill, decode, http_port = pd_workers(tmp_path, NET, "SGLang", MODEL)
        made.append((prefill, decode))
        engines = [
            SglangEngine("prefill", prefill.socket_dir, prefill.ip, http_port),
            SglangEngine("decode", decode.socket_dir, "127.0.0.1", http_port, hidden_size=decode_hidden_size),
        ]
        made.append(engines)
        return prefill, decode, engines[0], engines[1]

    yield make
    for m in reversed(made):
        if isinstance(m, list):
            for e in m:
                e.close()
        else:
            kill_all((m[1], m[0]))


@pytest.fixture
def pd(make_pd):
    """(prefill worker, decode worker, prefill engine, decode engine)."""
    return make_pd()


def post(decode, body, timeout=90):
    return post_front_door(decode, body, timeout)


def served(decode):
    status, reply = post(decode, {"prompt": [1] * 8, "max_tokens": 1})
    return reply if status == 200 and reply.get("poll") == KVPoll.Success else None


def test_sglang_accepts_the_tandem_backend_and_its_classes_come_from_the_plugin():
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "/nonexistent", "--disaggregation-mode", "decode",
                                "--disaggregation-transfer-backend", "tandem"])
    assert args.disaggregation_transfer_backend == "tandem"
    assert backend(KVClassType.MANAGER) is sglang_pd.TandemKVManager
    assert backend(KVClassType.SENDER) is sglang_pd.TandemKVSender
    assert backend(KVClassType.RECEIVER) is sglang_pd.TandemKVReceiver
    assert backend(KVClassType.BOOTSTRAP_SERVER) is sglang_pd.TandemKVBootstrapServer
    assert backend(KVClassType.KVARGS) is KVArgs
    # The contract: SGLang's abstract methods are all implemented (a new one in a release breaks
    # this test before it breaks a server).
    for cls in (sglang_pd.TandemKVManager, sglang_pd.TandemKVSender, sglang_pd.TandemKVReceiver,
                sglang_pd.TandemKVBootstrapServer):
        assert not getattr(cls, "__abstractmethods__", None), (cls, cls.__abstractmethods__)
    # The other backends are untouched.
    fake = get_kv_class(TransferBackend("fake"), KVClassType.SENDER)
    assert fake.__module__.startswith("sglang.srt.disaggregation.fake")


def test_a_request_through_the_front_door_lands_the_prefills_kv_and_first_token_in_sglangs_pages(pd):
    _, decode, p_engine, d_engine = pd
    until(lambda: served(decode), 30, "a first request served")
    status, reply = post(decode, {"prompt": list(range(PROMPT)), "max_tokens": 4})
    assert status == 200, reply
    assert reply["tandem_check"] == {"tokens": PROMPT, "corrupt_rows": 0, "first_token": True}, reply
    side = d_engine.mgr.side
    assert side.stats["loaded"] >= 2 and side.stats["failed"] == 0, side.stats
    assert p_engine.mgr.side.stats["sent"] >= 2, p_engine.mgr.side.stats
    # Every page and metadata slot went back on both sides; no outcome is left behind.
    for e in (p_engine, d_engine):
        assert len(e.free) == 159 and len(e.slots) == 8
    until(lambda: not d_engine.mgr.side.outcomes and not p_engine.mgr.side.outcomes, 10, "outcomes forgotten")


def abort_while_the_prefill_is_stopped(pd, negative: bool):
    """Aborts a decode request whose room waits on a stopped prefill; returns (the decode's
    final poll if it came while the prefill was stopped, else None; the final poll after it
    resumed)."""
    prefill, decode, p_engine, d_engine = pd
    side = d_engine.mgr.side
    if negative:

        def fail_at_once(att, ld, ok):
            with side._lock:
                side._done(ld, ok)

        side._hold = fail_at_once
    until(lambda: served(decode), 30, "a first request served")
    p_engine.gate.clear()  # the prefill computes but does not send
    before = set(d_engine.receivers)
    t = threading.Thread(target=post, args=(decode, {"prompt": list(range(PROMPT)), "max_tokens": 1}), daemon=True)
    t.start()
    room = until(lambda: next(iter(set(d_engine.receivers) - before), None), 30, "the decode's receiver")
    receiver = d_engine.receivers[room]
    until(lambda: room in p_engine.mgr.side._work, 30, "the room open on the prefill")
    prefill.signal(signal.SIGSTOP)  # it cannot acknowledge the abort: no SafeToReuse yet
    try:
        receiver.abort()
        if negative:  # the backend reports the failure at once; the decode sees it
            until(lambda: room in d_engine.polls, 30, "the decode's final poll")
        else:  # the room failed; its load waits for the SafeToReuse
            until(lambda: any(ld.spec.req_id == receiver.req_id for ld, _, _ in side._held.values()), 30, "the release held")
            assert receiver.poll() == KVPoll.Transferring
        stopped = d_engine.polls.get(room)
    finally:
        prefill.signal(signal.SIGCONT)
        p_engine.gate.set()
    after = until(lambda: (d_engine.polls[room],) if room in d_engine.polls else None, 60, "the final poll")[0]
    t.join(60)
    return stopped, after


def test_an_aborted_request_fails_only_after_its_rooms_safe_to_reuse(pd):
    stopped, after = abort_while_the_prefill_is_stopped(pd, negative=False)
    assert stopped is None, "the decode saw its request end while a write of its room could still land"
    assert after == KVPoll.Failed


def test_negative_control_failing_at_the_abort_frees_pages_a_write_could_still_reach(pd):
    stopped, _ = abort_while_the_prefill_is_stopped(pd, negative=True)
    assert stopped == KVPoll.Failed, "the check did not catch a failure reported before the room's SafeToReuse"


def test_a_prefill_of_another_metadata_layout_fails_the_request_after_its_release(make_pd):
    _, decode, _, d_engine = make_pd(decode_hidden_size=32)  # hidden states: another aux layout
    body = {"prompt": list(range(PROMPT)), "max_tokens": 1}
    # The first request the front door takes (it answers 503 until a prefill peer is live).
    _, reply = until(lambda: (lambda r: r if r[0] == 200 else None)(post(decode, body)), 30, "a request taken")
    assert reply["poll"] == KVPoll.Failed and reply["tandem_check"] is None, reply
    side = d_engine.mgr.side
    assert side.stats["failed"] == 1 and side.stats["release_timeouts"] == 0, side.stats


def test_a_second_receiver_for_a_live_room_is_refused_without_touching_the_first(pd):
    _, _, _, d_engine = pd
    addr = "tandem-00000000000000ab-5000:8998"
    first = backend(KVClassType.RECEIVER)(d_engine.mgr, addr, 4242)
    second = backend(KVClassType.RECEIVER)(d_engine.mgr, addr, 4242)
    assert first.req_id != second.req_id
    for r in (first, second):
        r.init(0)
        r.send_metadata(np.asarray([1, 2], dtype=np.int32), 0)
    assert second.poll() == KVPoll.Failed
    assert "live receiver" in second.error
    # The first one's load goes on (the worker refuses its Reserve: no hand-off names room 4242)
    # and ends Failed on its own, after which the room takes a receiver again.
    poll_until(first, (KVPoll.Failed,), 30)
    assert 4242 not in d_engine.mgr.live_rooms


def test_a_request_that_did_not_come_through_the_front_door_fails_at_once(pd):
    _, _, _, d_engine = pd
    r = backend(KVClassType.RECEIVER)(d_engine.mgr, "10.0.0.9:8998", 12345)
    r.init(0)
    assert r.poll() == KVPoll.Failed
    with pytest.raises(RuntimeError, match="front door"):
        r.failure_exception()
    assert sglang_pd.parse_bootstrap_host("tandem-00000000000000ab-5000:8998") == (0xAB, 5000)
    assert sglang_pd.parse_bootstrap_host("tandem-xyz-5000:8998") is None


def test_the_manager_refuses_what_the_backend_does_not_move(monkeypatch):
    monkeypatch.setenv(sglang_pd.CONFIG_ENV, json.dumps({"model": MODEL, "socket_dir": "/nonexistent", "keepalive_s": 0}))
    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = [1], [512], [512]
    args.aux_data_ptrs = args.aux_data_lens = args.aux_item_lens = []
    args.page_size, args.state_types, args.pp_rank = PS, [], 0
    with pytest.raises(ValueError, match="MLA"):
        sglang_pd.TandemKVManager(args, DisaggregationMode.DECODE, SimpleNamespace(device="cpu"), True)
    with pytest.raises(ValueError, match="a K and a V buffer per layer"):
        sglang_pd.TandemKVManager(args, DisaggregationMode.DECODE, SimpleNamespace(device="cpu"), False)
    # A real pool: what SGLang accepts but this backend cannot serve is named at construction.
    pool = MHATokenToKVPool(4 * PS, PS, torch.float16, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
                            device="cpu", enable_memory_saver=False)
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    for setting, named in [
        (dict(tp_size=2), "tensor or pipeline parallelism"),
        (dict(speculative_algorithm="EAGLE"), "speculative decoding"),
        (dict(disaggregation_decode_enable_radix_cache=True), "radix-cache"),
        (dict(disaggregation_decode_allocation_policy="prefill_complete"), "allocation-policy"),
    ]:
        with pytest.raises(ValueError, match=named):
            sglang_pd.TandemKVManager(args, DisaggregationMode.DECODE, SimpleNamespace(device="cpu", **setting), False)
    other = dict(MODEL, layers=LAYERS * 2)
    monkeypatch.setenv(sglang_pd.CONFIG_ENV, json.dumps({"model": other, "socket_dir": "/nonexistent", "keepalive_s": 0}))
    with pytest.raises(ValueError, match="KV buffers for a worker model of 16 layers"):
        sglang_pd.TandemKVManager(args, DisaggregationMode.DECODE, SimpleNamespace(device="cpu"), False)
    monkeypatch.delenv(sglang_pd.CONFIG_ENV)
    with pytest.raises(ValueError, match=sglang_pd.CONFIG_ENV):
        sglang_pd.TandemKVManager(args, DisaggregationMode.DECODE, SimpleNamespace(device="cpu"), False)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_operators_render_selects_this_backend_with_a_config_it_reads(role, monkeypatch):
    from sglang.srt.server_args import prepare_server_args

    from rendered import flag, rendered

    cfg, engine = rendered("sglang-pd", role)
    env = {e["name"]: e.get("value") for e in engine["env"]}
    monkeypatch.setenv(sglang_pd.CONFIG_ENV, env[sglang_pd.CONFIG_ENV])
    pd_cfg = sglang_pd.config_from_env()
    assert pd_cfg["model"] == cfg["model"] and pd_cfg["socket_dir"] == cfg["engine"]["socketDir"]
    args = engine["args"]
    assert flag(args, "--disaggregation-mode") == role
    # SGLang's own parser takes the rendered flags (the model path is the sample's).
    parsed = prepare_server_args(args)
    assert parsed.disaggregation_transfer_backend == "tandem"
    assert parsed.disaggregation_mode == role
    assert parsed.page_size == int(flag(args, "--page-size"))
