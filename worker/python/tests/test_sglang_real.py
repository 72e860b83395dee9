"""TandemHiCacheStorage inside real SGLang 0.5.23 classes: the dynamic factory
(`StorageBackendFactory.create_backend("dynamic", cfg, None)`), a real `MHATokenToKVPoolHost` on CPU
with the `shm` allocator, torch tensors as host indices: a byte-identical round trip per layout
against the fake engine API and, when its build serves the Tiers calls, a real worker (net 135).

Needs torch and SGLang: CI runs it in the SGLang venv (worker/tools/sglang-venv.sh, a thin venv over
the vLLM venv's torch) with `TANDEM_REQUIRE_SGLANG=1`, where a missing SGLang fails; elsewhere the
module skips without them.
"""

import ctypes
import os

import pytest

if os.environ.get("TANDEM_REQUIRE_SGLANG") == "1":
    import torch
    import sglang.srt.mem_cache.pool_host.mha as mha
else:
    torch = pytest.importorskip("torch")
    mha = pytest.importorskip("sglang.srt.mem_cache.pool_host.mha")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from tandem_kv.sglang import TandemHiCacheStorage  # noqa: E402

from fake_worker import FakeWorker  # noqa: E402
from hostpool import chain_keys  # noqa: E402

PS = 512
LAYOUTS = ["page_first", "layer_first", "page_first_direct", "page_head"]


def host_pool(layout):
    kv = MHATokenToKVPool(8 * PS, PS, torch.float16, head_num=1, head_dim=16, layer_num=8, device="cpu", enable_memory_saver=False)
    return mha.MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2, 0, PS, layout, pin_memory=False, allocator_type="shm",
        device_capacity_tokens=kv.size, start_layer=kv.start_layer, end_layer=kv.end_layer,
        write_back_staging=kv.hicache_write_back_staging,
    )


def backend(socket_dir, layout):
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=layout != "layer_first", model_name="tiny-8l",
        extra_config={"backend_name": "tandem", "module_path": "tandem_kv.sglang", "class_name": "TandemHiCacheStorage",
                      "interface_v1": 1, "socket_dir": socket_dir, "timeout_s": 1.0},
    )
    b = StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert isinstance(b, TandemHiCacheStorage) and isinstance(b, HiCacheStorage)
    return b


def spans_bytes(host, idx):
    ptrs, sizes = host.get_page_buffer_meta(idx)
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["fake", "worker"])
def test_real_factory_and_host_pool_round_trip(tmp_path, make_worker, kind, layout):
    if kind == "fake":
        f = FakeWorker(str(tmp_path / "s"), pages=3).start()
        sock = f.dir
    else:
        f = None
        sock = make_worker(135).socket_dir
    host = host_pool(layout)
    b = backend(sock, layout)
    try:
        b.register_mem_pool_host(host)
        b.on_host_pools_registered()
        assert b._attached is not None
        if kind == "worker":
            from tandem_kv import errors

            try:
                b.client.lookup(b._attached.id, [b"\0" * 8])
            except errors.TierUnavailable:
                pytest.skip("this worker build answers TIER_UNAVAILABLE (Tiers not wired yet)")
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.kv_buffer.dtype))
        idx = torch.arange(5 * PS, dtype=torch.int64)
        want = spans_bytes(host, idx)
        keys = chain_keys(5, salt=3)
        assert b.batch_set_v1(keys, idx) == [True] * 5
        assert b.batch_exists(keys) == 5
        host.kv_buffer.zero_()
        assert b.batch_get_v1(keys, idx) == [True] * 5
        assert spans_bytes(host, idx) == want
    finally:
        b.close()
        if f:
            f.stop()


def test_real_host_pool_attaches_to_a_real_worker(make_worker):
    w = make_worker(134)
    host = host_pool("page_first")
    b = backend(w.socket_dir, "page_first")
    try:
        b.register_mem_pool_host(host)
        assert b._attached is not None and b.client.health().attach_id == b._attached.id
        keys = chain_keys(2)
        r = b.batch_set_v1(keys, torch.arange(2 * PS))
        assert isinstance(r, list) and len(r) == 2 and all(isinstance(x, bool) for x in r)
    finally:
        b.close()
