"""A vLLM engine for the PD tests (`role` decode or prefill), without a forward pass (no CPU
platform in the vLLM wheel): a real `Scheduler` with `TandemConnector` loaded by module path in the
scheduler role, the connector's worker role on CPU KV tensors of vLLM's layout, and an HTTP API
that the decode worker's front door hands requests to (`POST /v1/completions`). A prefill engine
"computes" a request's prompt by writing `pattern` into its blocks when it is first scheduled.

The engine loop plays vLLM's model runner: each step binds the connector metadata, starts the
loads, reports `get_finished` / `get_block_ids_with_load_errors` in the `KVConnectorOutput`, and
samples one token per scheduled request. When a request is first scheduled after its load, the
loop reads its blocks back and compares every token row with the prefill's bytes (`pattern`); the
response carries that check and how many prompt tokens vLLM computed itself in that step. `events` logs, in order, ("allocated", req_id, blocks) when the
connector learns a request's blocks and ("recving_done", req_id) when the worker side hands them
back: the abort test's evidence.
"""

from __future__ import annotations

import tempfile
import threading

import numpy as np
import torch
from transformers import LlamaConfig
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from tandem_kv.vllm_pd import TandemConnector

from conftest import serve_json

BLOCK = 16


def pattern(request_id: int, tokens: int, layers: int, row: int, token: int = 0) -> np.ndarray:
    """The bytes a test prefill writes for `request_id` handed over with hand-off `token`:
    (tokens, layers, row) uint8, distinct per request, token, layer and byte (one wrong row
    anywhere is caught), and per hand-off token (a request that names another's id with another
    token computes other bytes)."""
    request_id = (request_id ^ token) % (1 << 64)
    t = np.arange(tokens, dtype=np.uint64)[:, None, None]
    layer = np.arange(layers, dtype=np.uint64)[None, :, None]
    b = np.arange(row, dtype=np.uint64)[None, None, :]
    return (((request_id % 65_521) * 1_000_003 + t * 7919 + layer * 104_729 + b * 31) % 251).astype(np.uint8)


def tiny_model_dir(model: dict) -> str:
    """A local model directory of `model`'s KV geometry (config only: nothing is downloaded)."""
    d = tempfile.mkdtemp(prefix="tandem-vllm-model-")
    heads = 4
    LlamaConfig(
        vocab_size=1000,
        hidden_size=heads * model["head_dim"],
        intermediate_size=128,
        num_hidden_layers=model["layers"],
        num_attention_heads=heads,
        num_key_value_heads=model["kv_heads"],
        max_position_embeddings=8192,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(d)
    return d


class Engine:
    """The engine: `start()`, `abort(tandem_id)`, `stop()`; `url` is its API."""

    def __init__(self, socket_dir: str, model: dict, port: int, num_blocks: int, extra=None, failure_policy="recompute", role="decode", host="127.0.0.1"):
        self.role = role
        self.host = host
        self.model = model
        self.num_blocks = num_blocks
        cfg = dict(socket_dir=socket_dir, model=model, timeout_s=5.0, release_timeout_s=60.0)
        cfg.update(extra or {})
        mc = ModelConfig(model=tiny_model_dir(model), skip_tokenizer_init=True, dtype="float16", max_model_len=4096)
        self.vllm_config = VllmConfig(
            model_config=mc,
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096, is_encoder_decoder=False),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="TandemConnector",
                kv_connector_module_path="tandem_kv.vllm_pd",
                kv_role="kv_consumer" if role == "decode" else "kv_producer",
                kv_load_failure_policy=failure_policy,
                kv_connector_extra_config=cfg,
            ),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        names = [f"model.layers.{i}.self_attn.attn" for i in range(model["layers"])]
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=model["kv_heads"], head_size=model["head_dim"], dtype=torch.float16)
        kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK,
            log_stats=False,
        )
        assert type(self.scheduler.connector).__name__ == "TandemConnector", type(self.scheduler.connector)
        self.worker = TandemConnector(self.vllm_config, KVConnectorRole.WORKER, kcc)
        # vLLM's own allocation, in a block-outermost layout: strided per-layer views
        # `[blocks, kv_heads, BLOCK, 2 x head_dim]`, as its GPU model runner hands them over.
        page = spec.page_size_bytes
        kcc.kv_cache_tensors = [KVCacheTensor(size=page * num_blocks * len(names), layers=names, layer_stride=page, block_stride=page * len(names))]
        self.kv = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.BLNHC, None)
        self.names = names
        self._sched_side = self.scheduler.connector._sched
        self._wrap_scheduler_side()
        self.events = []
        self.computed = []
        # front door id -> Event: the first request naming the id waits for it before vLLM sees it.
        self.delay_first = {}
        self.steps = 0
        self._lock = threading.Condition()
        self._waiting = {}  # req_id -> dict(done=Event, result=...)
        self._checked = set()
        self._stop = threading.Event()
        self.port = port
        self.url = f"http://{host}:{port}"
        self._http = None
        self._loop = None

    # -- bookkeeping hooks (evidence for the tests) --------------------------------------------

    def _wrap_scheduler_side(self):
        side = self._sched_side
        orig_alloc, orig_finished = side.allocated, side.finished

        def allocated(request, block_ids, n):
            self.events.append(("allocated", request.request_id, tuple(block_ids)))
            return orig_alloc(request, block_ids, n)

        def finished(req_ids):
            for r in req_ids:
                self.events.append(("recving_done", r))
            return orig_finished(req_ids)

        side.allocated, side.finished = allocated, finished

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self):
        self.worker.register_kv_caches(self.kv)
        self._http = serve_json(self.host, self.port, self._serve)
        self._loop = threading.Thread(target=self._run, daemon=True)
        self._loop.start()
        return self

    def stop(self):
        self._stop.set()
        if self._http:
            self._http.shutdown()
            self._http.server_close()
        if self._loop:
            self._loop.join(10)
        self.worker.shutdown()

    # -- requests ------------------------------------------------------------------------------

    def _serve(self, body):
        params = body.get("kv_transfer_params") or {}
        tandem = params.get("tandem") or {}
        prompt = body.get("prompt")
        n = len(prompt) if isinstance(prompt, list) else int(body.get("input_tokens") or 1)
        req_id = f"cmpl-{tandem.get('request_id', 0)}"
        with self._lock:
            if req_id in self._waiting or req_id in self.scheduler.requests:  # a second claim of the id
                req_id += f"-{len(self.events)}-{self.steps}"
        sp = SamplingParams(max_tokens=int(body.get("max_tokens") or 1), extra_args={"kv_transfer_params": params})
        req = Request(request_id=req_id, prompt_token_ids=[1 + i % 900 for i in range(n)], sampling_params=sp, pooling_params=None)
        delay = self.delay_first.pop(tandem.get("request_id"), None)
        if delay is not None:  # the test lets this first claim of the id in later
            delay.wait(60)
        slot = {"done": threading.Event(), "tandem": tandem, "n": n}
        with self._lock:
            self._waiting[req_id] = slot
            self.scheduler.add_request(req)
        if not slot["done"].wait(120):
            return 504, {"error": "engine timeout"}
        return slot["status"], slot["reply"]

    def abort(self, tandem_id: int):
        """What vLLM does when a request's client goes away (`finish_requests`, ABORTED)."""
        req_id = f"cmpl-{tandem_id}"
        with self._lock:
            self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
            slot = self._waiting.pop(req_id, None)
        if slot:
            slot.update(status=499, reply={"error": "aborted"})
            slot["done"].set()

    def status(self, tandem_id: int):
        r = self.scheduler.requests.get(f"cmpl-{tandem_id}")
        return None if r is None else r.status

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def wait_steps(self, n: int, within: float = 30.0):
        """Returns once the loop has run `n` more steps (the abort test's observation window)."""
        with self._lock:
            target = self.steps + n
            if not self._lock.wait_for(lambda: self.steps >= target, within):
                raise AssertionError(f"the engine loop did not run {n} steps within {within}s")

    # -- the loop ------------------------------------------------------------------------------

    def _run(self):
        while not self._stop.is_set():
            with self._lock:
                self._step()
                self.steps += 1
                self._lock.notify_all()
            self._stop.wait(0.005)

    def _step(self):
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        if meta is not None:
            self.worker.bind_connector_metadata(meta)
            self.worker.start_load_kv(None)
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        if meta is not None:
            self.worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        for r in ids:
            if r not in self._checked:
                self._checked.add(r)
                if self.role == "prefill":
                    self._compute(r)
                else:
                    self._check(r, out.num_scheduled_tokens[r])
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid),
        )
        outputs = self.scheduler.update_from_output(out, mro)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self._checked.discard(o.request_id)  # a later request may reuse the name
                    slot = self._waiting.pop(o.request_id, None)
                    if slot:
                        slot.update(status=200, reply={"id": o.request_id, "choices": [{"text": "x", "finish_reason": str(o.finish_reason)}], "tandem_check": slot.get("check")})
                        slot["done"].set()

    def _rows_of(self, req_id):
        """(token count, the request's blocks, the prefill's bytes (tokens, layers, row)), or
        None for a request that did not come through the front door."""
        slot = self._waiting.get(req_id)
        if slot is None or not slot["tandem"]:
            return None
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        n = slot["n"]
        row = 2 * self.model["kv_heads"] * self.model["head_dim"] * 2
        t = slot["tandem"]
        return slot, n, blocks, pattern(t["request_id"], n, self.model["layers"], row, int(t.get("token") or 0))

    def _kv_of(self, row_bytes):
        """A worker row's K and V of each head as float16 (heads, dim) arrays: the row is K of
        every head, then V of every head."""
        h, d = self.model["kv_heads"], self.model["head_dim"]
        half = len(row_bytes) // 2
        k = np.frombuffer(row_bytes[:half].tobytes(), dtype=np.float16).reshape(h, d)
        v = np.frombuffer(row_bytes[half:].tobytes(), dtype=np.float16).reshape(h, d)
        return k, v

    def _compute(self, req_id):
        """The prefill's forward pass, as far as the KV goes: the prompt's K and V of every head
        and layer become `pattern(front door id, hand-off token)` in the request's blocks."""
        got = self._rows_of(req_id)
        if got is None:
            return
        _, n, blocks, want = got
        d = self.model["head_dim"]
        for li, name in enumerate(self.names):
            kv = self.kv[name]
            for t in range(n):
                k, v = self._kv_of(want[t, li])
                b, r = blocks[t // BLOCK], t % BLOCK
                kv[b, :, r, :d] = torch.from_numpy(k.copy())
                kv[b, :, r, d:] = torch.from_numpy(v.copy())
        self.computed.append(req_id)

    def _check(self, req_id, scheduled: int):
        """Reads the request's blocks back and compares each token's K and V of every head and
        layer with the prefill's bytes; `scheduled` is how many prompt tokens vLLM computes itself
        in the request's first step (1 after a load: the last token; the whole prompt after a
        failed one)."""
        got = self._rows_of(req_id)
        if got is None:
            return
        slot, n, blocks, want = got
        d = self.model["head_dim"]
        corrupt = 0
        for li, name in enumerate(self.names):
            kv = self.kv[name]
            for t in range(n):
                k, v = self._kv_of(want[t, li])
                b, r = blocks[t // BLOCK], t % BLOCK
                # Bytes, not floats: the pattern's halves include NaN encodings.
                got_k = np.ascontiguousarray(kv[b, :, r, :d].numpy()).view(np.uint8)
                got_v = np.ascontiguousarray(kv[b, :, r, d:].numpy()).view(np.uint8)
                if not (np.array_equal(got_k, k.view(np.uint8)) and np.array_equal(got_v, v.view(np.uint8))):
                    corrupt += 1
        slot["check"] = {"tokens": n, "corrupt_rows": corrupt, "computed_tokens": scheduled}
