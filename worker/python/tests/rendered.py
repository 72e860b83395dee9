"""The operator's renders of SGLang and vLLM pools (its golden fixtures,
`operator/tests/fixtures/golden/engine-<kind>-<role>-{configmap,statefulset}.yaml`, rendered from
`manifests/samples/engines/` and checked against the operator's code by `operator/tests/
pool_golden.rs`), for tests that run the adapters with exactly the flags a pod gets."""

import json
from pathlib import Path

import yaml

GOLDEN = Path(__file__).resolve().parents[3] / "operator" / "tests" / "fixtures" / "golden"


def rendered(kind: str, role: str = "prefill"):
    """(worker config dict, engine container dict) of the `kind` ("sglang", "vllm") pool's pod."""
    cm = yaml.safe_load((GOLDEN / f"engine-{kind}-{role}-configmap.yaml").read_text())
    sts = yaml.safe_load((GOLDEN / f"engine-{kind}-{role}-statefulset.yaml").read_text())
    engine = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")
    return json.loads(cm["data"]["worker.json"]), engine


def flag(args, name: str) -> str:
    """The value after `name` in `args`."""
    return args[args.index(name) + 1]


def page_bytes(model: dict, page_tokens: int) -> int:
    """Bytes of one page of a GQA model's KV (K and V, every layer)."""
    return page_tokens * model["layers"] * 2 * model["kv_heads"] * model["head_dim"] * model["dtype_bytes"]


def on_this_machine(cfg: dict, ports, pages: int, l3_service: str) -> dict:
    """The rendered worker config as a test runs it: its model, page size, allocator, tier write
    policy and engine seat kept; the pool shrunk to `pages` pages, the CacheTier one replica at
    `l3_service` reached in-process (client mode Embedded: no store-client sidecar here), the
    test's ports."""
    pool = pages * page_bytes(cfg["model"], cfg["cache"]["pageTokens"])
    out = dict(cfg)
    out["memory"] = dict(
        cfg["memory"], clientMode="Embedded", targetPoolBytes=pool, draftPoolBytes=0, indexerPoolBytes=0,
        snapshotBufferBytes=0, segmentBytes=pool,
    )
    out["cache"] = dict(cfg["cache"], service=l3_service, replicas=1)
    out["speculative"] = None
    out["ports"] = dict(cfg["ports"], control=ports[0], data=ports[1], health=ports[2])
    return out


def tier_for(cfg: dict, health_port: int) -> dict:
    """A CacheTier replica's config for the rendered pool's model and page size (64 MiB memory)."""
    return {
        "apiVersion": "tandem.dev/cache-tier-config/v1", "namespace": cfg["namespace"], "tier": cfg["cache"]["tier"],
        "revision": "t1",
        "model": cfg["model"], "indexer": None, "pageTokens": cfg["cache"]["pageTokens"], "layout": "layerFirst",
        "maxTensor": 64, "maxContext": 64, "memoryBytes": 64 << 20, "diskBytes": 256 << 20, "persistent": True,
        "dataDir": "/var/lib/tandem/cache", "ports": {"l3": 7420, "health": health_port},
        "eviction": {"policy": "LRU", "highWatermarkPercent": 90}, "writePolicy": "writeThrough",
        "registrationFailure": None,
    }
