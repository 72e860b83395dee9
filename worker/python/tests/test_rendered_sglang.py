"""The SGLang pod the operator renders (`manifests/samples/engines/sglang.yaml` through the
operator's golden render, `rendered.py`) against the real backend and a `tandem-worker` run from
the rendered `worker.json`, loopback net 127.0.153.x: SGLang's own HiCache config built from the
rendered `--hicache-storage-backend-extra-config` and `--page-size` (and a host pool of the model's
geometry) attaches — the worker accepts the identity — and a round trip through the worker's L2 and
the CacheTier is byte-identical. A key the backend does not read, a model object in another form or
a page size other than the worker's fails here. Not run: SGLang's argument parser and server (no
torch in this venv)."""

import json
from types import SimpleNamespace

from tandem_kv.sglang import TandemHiCacheStorage

from conftest import Worker, free_ports, until
from hostpool import HostPool, chain_keys, indices
from rendered import flag, on_this_machine, rendered, tier_for
from test_sglang_l3 import l3_written

NET = 153
L3 = "l3-rendered.serving.svc.cluster.local"


def test_the_rendered_sglang_flags_attach_and_round_trip_through_the_tiers(tmp_path):
    cfg, engine = rendered("sglang")
    assert engine["command"] == ["python3", "-m", "sglang.launch_server"]
    args = engine["args"]
    assert "--enable-hierarchical-cache" in args
    assert flag(args, "--hicache-storage-backend") == "dynamic"
    page = int(flag(args, "--page-size"))
    extra = json.loads(flag(args, "--hicache-storage-backend-extra-config"))
    # The decode pool's pods get the same adapter flags.
    _, decode = rendered("sglang", "decode")
    assert json.loads(flag(decode["args"], "--hicache-storage-backend-extra-config")) == extra

    made = []
    try:
        made.append(Worker(tmp_path, NET, 5, tier_for(cfg, free_ports(1)[0]), role="cache", config_file="tier.json", names=(L3,)).start())
        w = Worker(tmp_path, NET, 1, on_this_machine(cfg, free_ports(3), pages=8, l3_service=L3)).start()
        made.append(w)
        assert extra["socket_dir"] == "/run/tandem/engine"
        extra["socket_dir"] = w.socket_dir  # the pod's path, under this test's root
        m = extra["model"]
        pool = HostPool(8, page_size=page, layer_num=m["layers"], head_num=m["kv_heads"], head_dim=m["head_dim"], itemsize=m["dtype_bytes"])
        config = SimpleNamespace(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=True, model_name="meta-llama/Llama-3.1-8B-Instruct",
            extra_config=extra,
        )
        b = TandemHiCacheStorage(config, {})
        try:
            b.register_mem_pool_host(pool)
            until(lambda: b._session() is not None, 20, "the rendered backend attaches to the rendered worker")
            assert b.stats["refused"] == 0, b.stats
            pool.fill("rendered")
            want = [pool.page_bytes(p) for p in range(3)]
            keys = chain_keys(3, salt=53, page_size=page)
            assert b.batch_set_v1(keys, indices(range(3), page_size=page)) == [True] * 3
            until(lambda: l3_written(w) >= 3, 20, "3 pages written through to L3")
            assert b.batch_exists(keys) == 3
            pool.zero()
            assert b.batch_get_v1(keys, indices(range(3, 6), page_size=page)) == [True] * 3
            assert [pool.page_bytes(p) for p in range(3, 6)] == want
        finally:
            b.close()
    finally:
        for x in made:
            x.kill()
