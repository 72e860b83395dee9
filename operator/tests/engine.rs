//! `spec.engine` through the pure builders (DESIGN §3.1, issues 13 and 14): the pod is the engine
//! as main container with the worker as its native sidecar, sharing the engine-API socket
//! `emptyDir`; the worker config names the seat; SGLang and vLLM run with Tandem's adapters wired
//! by their flags, the adapter's model and page size being the worker's own. The pools are the
//! samples in `manifests/samples/` (with an `engine` block from YAML) and
//! `manifests/samples/engines/`.

use std::path::Path;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Container, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::Value;
use tandem_crds::{CacheTier, DecodePool, EngineSpec, PrefillPool};
use tandem_interfaces::config::{EngineKind as SeatKind, EngineSeat, WorkerConfig};
use tandem_operator::controller::revision::resolve_with;
use tandem_operator::policy::TierLookup;
use tandem_operator::render::engine::{
    ENGINE_HTTP_PORT, ENGINE_SOCKET_DIR, SGLANG_PD_CONFIG_ENV, pd_pool, pd_through_tandem,
};
use tandem_operator::render::{PoolView, workload};

mod samples;
use samples::{engine_sample, load, pools_sample};

fn engine(yaml: &str) -> EngineSpec {
    serde_saphyr::from_str(yaml).unwrap()
}

fn owner() -> OwnerReference {
    OwnerReference {
        api_version: "serving.tandem.dev/v1alpha1".into(),
        kind: "DecodePool".into(),
        name: "llama70b-decode".into(),
        uid: "u-1".into(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// The config (at its own revision) and group 0 of `view` against the sample tier, or `None`
/// for no tier.
fn render(view: &PoolView<'_>, tier: Option<&CacheTier>) -> (WorkerConfig, StatefulSet) {
    let lookup = match tier {
        Some(t) => TierLookup::Found {
            name: "llama70b-l3",
            spec: &t.spec,
            terminating: false,
        },
        None => TierLookup::None,
    };
    let r = resolve_with(view, lookup).expect("renders");
    let mut cfg = r.config;
    cfg.revision = r.own_revision;
    let sts = workload::group_statefulset(view, &cfg, 0, &owner());
    (cfg, sts)
}

fn pod(sts: &StatefulSet) -> &PodSpec {
    sts.spec.template.spec.as_ref().unwrap()
}

fn names(cs: Option<&Vec<Container>>) -> Vec<&str> {
    cs.into_iter().flatten().map(|c| c.name.as_str()).collect()
}

fn mount_path<'a>(c: &'a Container, volume: &str) -> Option<&'a str> {
    c.volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == volume)
        .map(|m| m.mount_path.as_str())
}

const SIMULATED: &str = "kind: Simulated\n";

#[test]
fn a_simulated_engine_runs_as_the_main_container_beside_the_worker_sidecar() {
    let tier: CacheTier = load("cachetier.yaml");
    let plain: PrefillPool = load("prefillpool.yaml");
    let mut with = plain.clone();
    with.spec.engine = Some(engine(SIMULATED));
    let (plain_cfg, plain_sts) = render(&PoolView::prefill(&plain), Some(&tier));
    let (cfg, sts) = render(&PoolView::prefill(&with), Some(&tier));
    let p = pod(&sts);

    // Start order: store-client (Standalone), then the worker, both native sidecars; then engine.
    assert_eq!(
        names(p.init_containers.as_ref()),
        ["store-client", "worker"]
    );
    assert_eq!(names(Some(&p.containers)), ["engine"]);
    let inits = p.init_containers.as_ref().unwrap();
    for c in inits {
        assert_eq!(c.restart_policy.as_deref(), Some("Always"), "{}", c.name);
    }

    // The worker sidecar is today's worker container plus the sidecar fields and the socket.
    let today = &pod(&plain_sts).containers[0];
    let worker = &inits[1];
    assert_eq!(worker.image, today.image);
    assert_eq!(worker.args, today.args);
    assert_eq!(worker.env, today.env);
    assert_eq!(worker.ports, today.ports);
    assert_eq!(worker.readiness_probe, today.readiness_probe);
    // The pod's one GPU moves to the engine, which computes attention (issue 14); the worker
    // sidecar keeps its CPU and memory.
    let gpu = |c: &Container| {
        c.resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("nvidia.com/gpu"))
            .cloned()
    };
    assert_eq!(gpu(today).map(|q| q.0), Some("1".into()));
    assert_eq!(gpu(worker), None, "the worker sidecar holds no GPU");
    assert_eq!(gpu(&p.containers[0]), gpu(today), "the engine holds it");
    assert_eq!(
        worker.resources.as_ref().unwrap().requests,
        today.resources.as_ref().unwrap().requests
    );
    let startup = worker.startup_probe.as_ref().expect("startup probe");
    let get = startup.http_get.as_ref().unwrap();
    assert_eq!(get.path.as_deref(), Some("/healthz"));
    assert_eq!(get.port, IntOrString::String("health".into()));
    assert!(today.startup_probe.is_none());

    // The engine: the worker image's sim-engine, on the same config file, with the pod ordinal.
    let e = &p.containers[0];
    assert_eq!(
        e.image, today.image,
        "Simulated defaults to the worker image"
    );
    assert_eq!(
        e.args.as_deref().unwrap(),
        [
            "sim-engine",
            "--serve",
            "--socket-dir",
            "/run/tandem/engine",
            "--config",
            "/etc/tandem/worker.json",
            "--ordinal",
            "$(TANDEM_ORDINAL)",
        ]
    );
    assert_eq!(
        today.args.as_deref().unwrap()[2],
        "/etc/tandem/worker.json",
        "the engine reads the config file the worker reads"
    );
    let ordinal = e
        .env
        .iter()
        .flatten()
        .find(|v| v.name == "TANDEM_ORDINAL")
        .expect("ordinal env");
    assert_eq!(
        ordinal
            .value_from
            .as_ref()
            .unwrap()
            .field_ref
            .as_ref()
            .unwrap()
            .field_path,
        "metadata.labels['apps.kubernetes.io/pod-index']"
    );
    assert!(
        e.env
            .iter()
            .flatten()
            .any(|v| v.name == "POD_NAME" && v.value_from.is_some()),
        "the engine gets the pod env the worker gets"
    );
    let gpus: Vec<&str> = p
        .containers
        .iter()
        .chain(inits)
        .filter(|c| {
            c.resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .is_some_and(|l| l.contains_key("nvidia.com/gpu"))
        })
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(gpus, ["engine"], "one GPU per pod, on the engine");

    // One emptyDir, mounted at the same path in both, and the config in both.
    let vol = p
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "engine-socket")
        .expect("socket volume");
    assert!(vol.empty_dir.is_some());
    for c in [worker, e] {
        assert_eq!(mount_path(c, "engine-socket"), Some(ENGINE_SOCKET_DIR));
        assert_eq!(mount_path(c, "config"), Some("/etc/tandem"));
    }
    assert_eq!(mount_path(today, "engine-socket"), None);

    // The worker config names the seat; the rest of the config is unchanged.
    assert_eq!(
        cfg.engine,
        Some(EngineSeat {
            kind: SeatKind::Simulated,
            socket_dir: ENGINE_SOCKET_DIR.into(),
            http_port: None,
        })
    );
    assert_eq!(plain_cfg.engine, None);
    cfg.check().expect("the worker's own checks pass");
    let text = serde_json::to_string(&cfg).unwrap();
    assert_eq!(
        WorkerConfig::from_json(&text, Path::new("/etc/tandem/worker.json")).unwrap(),
        cfg
    );
    let mut same = cfg.clone();
    same.engine = None;
    same.revision = plain_cfg.revision.clone();
    assert_eq!(same, plain_cfg);
    assert_ne!(cfg.revision, plain_cfg.revision, "adding an engine rolls");
}

#[test]
fn a_prefill_pool_without_tier_has_the_worker_as_its_only_sidecar() {
    let mut p: PrefillPool = load("prefillpool.yaml");
    p.spec.cache_tier_ref = None;
    p.spec.engine = Some(engine(SIMULATED));
    let (cfg, sts) = render(&PoolView::prefill(&p), None);
    let spec = pod(&sts);
    assert_eq!(names(spec.init_containers.as_ref()), ["worker"]);
    assert_eq!(names(Some(&spec.containers)), ["engine"]);
    let worker = &spec.init_containers.as_ref().unwrap()[0];
    assert_eq!(worker.args.as_deref().unwrap()[0], "prefill");
    assert!(
        spec.volumes.iter().flatten().all(|v| v.name != "kv-shm"),
        "no store client, no shared-memory segment"
    );
    assert_eq!(cfg.engine.map(|s| s.kind), Some(SeatKind::Simulated));
    // The engine maps the pools as memfds: SharedMemory, not the private mmap of a pool
    // without engine and tier.
    assert_eq!(
        cfg.memory.allocator,
        tandem_interfaces::memory::AllocatorDomain::SharedMemory
    );
    p.spec.engine = None;
    let (plain, _) = render(&PoolView::prefill(&p), None);
    assert_eq!(
        plain.memory.allocator,
        tandem_interfaces::memory::AllocatorDomain::Mmap
    );
}

#[test]
fn a_simulated_engine_on_a_decode_pool_renders_the_engine_beside_its_worker() {
    let tier: CacheTier = load("cachetier.yaml");
    let mut d: DecodePool = load("decodepool.yaml");
    d.spec.engine = Some(engine(SIMULATED));
    let lookup = TierLookup::Found {
        name: "llama70b-l3",
        spec: &tier.spec,
        terminating: false,
    };
    // Served since the decode worker hands its requests to the engine (issue 13).
    assert!(
        resolve_with(&PoolView::decode(&d), lookup).is_ok(),
        "a Simulated engine on a DecodePool must resolve"
    );
    let (cfg, sts) = render(&PoolView::decode(&d), Some(&tier));
    let spec = pod(&sts);
    assert_eq!(names(Some(&spec.containers)), ["engine"]);
    let inits = names(spec.init_containers.as_ref());
    assert_eq!(inits.last().copied(), Some("worker"), "{inits:?}");
    let worker = spec.init_containers.as_ref().unwrap().last().unwrap();
    assert_eq!(worker.args.as_deref().unwrap()[0], "decode");
    let e = &spec.containers[0];
    assert_eq!(e.args.as_deref().unwrap()[..2], ["sim-engine", "--serve"]);
    assert_eq!(cfg.engine.map(|s| s.kind), Some(SeatKind::Simulated));
}

#[test]
fn engine_image_args_and_resources_are_rendered_and_roll_the_pool() {
    let tier: CacheTier = load("cachetier.yaml");
    let mut d: PrefillPool = load("prefillpool.yaml");
    d.spec.engine = Some(engine(SIMULATED));
    let (base_cfg, _) = render(&PoolView::prefill(&d), Some(&tier));
    d.spec.engine = Some(engine(
        "kind: Simulated
image: example.org/tandem-worker:dev
args: [\"--page-tokens\", \"256\"]
resources:
  requests: {cpu: 500m, memory: 1Gi}
",
    ));
    let (cfg, sts) = render(&PoolView::prefill(&d), Some(&tier));
    let e = &pod(&sts).containers[0];
    assert_eq!(e.image.as_deref(), Some("example.org/tandem-worker:dev"));
    let args = e.args.as_deref().unwrap();
    assert_eq!(args[..2], ["sim-engine", "--serve"]);
    assert_eq!(
        args[args.len() - 2..],
        ["--page-tokens", "256"],
        "extra args come last"
    );
    let requests = e.resources.as_ref().unwrap().requests.as_ref().unwrap();
    assert_eq!(requests["cpu"].0, "500m");
    assert_eq!(requests["memory"].0, "1Gi");
    let worker = &pod(&sts).init_containers.as_ref().unwrap()[1];
    assert_ne!(worker.image, e.image, "the worker keeps spec.image");
    assert_ne!(
        cfg.revision, base_cfg.revision,
        "engine image, args and resources are part of the revision"
    );
}

fn render_on(view: &PoolView<'_>, tier: &CacheTier) -> (WorkerConfig, StatefulSet) {
    let lookup = TierLookup::Found {
        name: tier.metadata.name.as_deref().unwrap(),
        spec: &tier.spec,
        terminating: false,
    };
    render_with(view, lookup)
}

/// The worker config and group StatefulSet of `view` with its tier as `lookup` says.
fn render_with(view: &PoolView<'_>, lookup: TierLookup<'_>) -> (WorkerConfig, StatefulSet) {
    let r = resolve_with(view, lookup).expect("renders");
    let mut cfg = r.config;
    cfg.revision = r.own_revision;
    let sts = workload::group_statefulset(view, &cfg, 0, &owner());
    (cfg, sts)
}

/// What every vLLM engine pod of the sample model has ([`assert_engine_pod`], `vllm serve`), and
/// its `--kv-transfer-config` JSON.
fn vllm_transfer_config(cfg: &WorkerConfig, sts: &StatefulSet) -> Value {
    assert_engine_pod(
        cfg,
        sts,
        SeatKind::Vllm,
        &["meta-llama/Llama-3.1-8B-Instruct"],
    );
    let e = &pod(sts).containers[0];
    assert_eq!(e.command.as_deref().unwrap(), ["vllm", "serve"]);
    serde_json::from_str(flag(e.args.as_deref().unwrap(), "--kv-transfer-config")).unwrap()
}

/// The DecodePool `d`'s Service reaches the worker's front door.
fn assert_service_targets_the_front_door(d: &DecodePool) {
    let svc = workload::front_door_service(&PoolView::decode(d), 80, &owner());
    assert_eq!(
        svc.spec.unwrap().ports.unwrap()[0].target_port,
        Some(IntOrString::Int(i32::from(
            tandem_crds::ports::FRONT_DOOR_PORT
        ))),
        "the Service reaches the worker's front door"
    );
}

/// The value after `flag` in `args`.
fn flag<'a>(args: &'a [String], flag: &str) -> &'a str {
    let i = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    &args[i + 1]
}

/// What every SGLang or vLLM engine container has: the pod's GPU (the worker none), the
/// `engine-http` port and a readiness probe on its `/health`, the socket directory in its env, the
/// user's args first (vLLM's model must be), the worker config's engine seat of that kind.
fn assert_engine_pod(cfg: &WorkerConfig, sts: &StatefulSet, kind: SeatKind, user_args: &[&str]) {
    let spec = pod(sts);
    assert_eq!(names(Some(&spec.containers)), ["engine"]);
    let e = &spec.containers[0];
    let gpu = |c: &Container| {
        c.resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("nvidia.com/gpu"))
            .map(|q| q.0.clone())
    };
    assert_eq!(gpu(e).as_deref(), Some("1"), "the engine holds the GPU");
    let worker = spec.init_containers.as_ref().unwrap().last().unwrap();
    assert_eq!(worker.name, "worker");
    assert_eq!(gpu(worker), None, "the worker sidecar holds no GPU");
    let port = e.ports.as_ref().unwrap();
    assert_eq!(port[0].name.as_deref(), Some("engine-http"));
    assert_eq!(port[0].container_port, i32::from(ENGINE_HTTP_PORT));
    // The worker's front door hands requests to this port when the config names none.
    assert_eq!(
        ENGINE_HTTP_PORT,
        tandem_interfaces::config::DEFAULT_ENGINE_HTTP_PORT
    );
    let env = e.env.as_ref().unwrap();
    assert!(
        env.iter().any(|v| v.name == "TANDEM_ENGINE_SOCKET_DIR"
            && v.value.as_deref() == Some(ENGINE_SOCKET_DIR))
    );
    assert!(
        env.iter().any(|v| v.name == "HF_TOKEN"),
        "spec.engine.env reaches the engine"
    );
    let args = e.args.as_deref().unwrap();
    assert_eq!(args[..user_args.len()], *user_args, "user args come first");
    let probe = e
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .unwrap();
    assert_eq!(probe.path.as_deref(), Some("/health"));
    assert_eq!(probe.port, IntOrString::String("engine-http".into()));
    assert_eq!(flag(args, "--port"), ENGINE_HTTP_PORT.to_string());
    assert_eq!(mount_path(e, "engine-socket"), Some(ENGINE_SOCKET_DIR));
    assert_eq!(cfg.engine.as_ref().map(|s| s.kind), Some(kind));
    // A memory-backed /dev/shm of its own (a runtime's default is 64 MiB): the engines' IPC, and
    // for vLLM its CPU offload tier, a file there of cpu_bytes_to_use.
    assert_eq!(mount_path(e, "engine-shm"), Some("/dev/shm"));
    let shm = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "engine-shm")
        .and_then(|v| v.empty_dir.as_ref())
        .expect("engine-shm emptyDir");
    assert_eq!(shm.medium.as_deref(), Some("Memory"));
    let limit: u64 = shm.size_limit.as_ref().unwrap().0.parse().unwrap();
    let cpu_tier = if kind == SeatKind::Vllm && cfg.cache.is_some() {
        cfg.memory.target_pool_bytes
    } else {
        0
    };
    assert_eq!(limit, (2 << 30) + cpu_tier);
}

#[test]
fn an_sglang_engine_runs_with_tandems_hicache_backend_at_the_workers_page_size() {
    let (tier, p, d) = engine_sample("engines/sglang.yaml");
    for view in [PoolView::prefill(&p), PoolView::decode(&d)] {
        let (cfg, sts) = render_on(&view, &tier);
        let user = ["--model-path", "meta-llama/Llama-3.1-8B-Instruct"];
        assert_engine_pod(&cfg, &sts, SeatKind::SgLang, &user);
        let e = &pod(&sts).containers[0];
        assert_eq!(
            e.command.as_deref().unwrap(),
            ["python3", "-m", "sglang.launch_server"]
        );
        let args = e.args.as_deref().unwrap();
        assert!(args.iter().any(|a| a == "--enable-hierarchical-cache"));
        assert_eq!(
            flag(args, "--hicache-size"),
            cfg.memory.target_pool_bytes.div_ceil(1 << 30).to_string(),
            "SGLang's host pool is hostPool.size, not a share of the node's memory"
        );
        assert_eq!(flag(args, "--hicache-storage-backend"), "dynamic");
        assert_eq!(
            flag(args, "--page-size"),
            cfg.cache.as_ref().unwrap().page_tokens.to_string(),
            "SGLang's pages are the worker's (the attach identity checks it)"
        );
        let extra: Value =
            serde_json::from_str(flag(args, "--hicache-storage-backend-extra-config")).unwrap();
        assert_eq!(extra["module_path"], "tandem_kv.sglang");
        assert_eq!(extra["class_name"], "TandemHiCacheStorage");
        assert_eq!(extra["interface_v1"], 1);
        assert_eq!(extra["socket_dir"], ENGINE_SOCKET_DIR);
        assert_eq!(
            extra["model"],
            serde_json::to_value(&cfg.model).unwrap(),
            "the backend attaches as the worker's own model"
        );
    }
}

#[test]
fn a_vllm_engine_runs_with_tandems_offloading_tier_one_chunk_per_worker_page() {
    let (tier, p, d) = engine_sample("engines/vllm.yaml");
    for view in [PoolView::prefill(&p), PoolView::decode(&d)] {
        let (cfg, sts) = render_on(&view, &tier);
        let t = vllm_transfer_config(&cfg, &sts);
        assert_eq!(t["kv_connector"], "OffloadingConnector");
        assert_eq!(t["kv_role"], "kv_both");
        let x = &t["kv_connector_extra_config"];
        assert_eq!(x["spec_name"], "TieringOffloadingSpec");
        assert_eq!(
            x["block_size"],
            cfg.cache.as_ref().unwrap().page_tokens,
            "one offloaded chunk is one worker page"
        );
        assert_eq!(x["cpu_bytes_to_use"], cfg.memory.target_pool_bytes);
        let tier = &x["secondary_tiers"][0];
        assert_eq!(tier["type"], "TandemSecondaryTier");
        assert_eq!(tier["module_path"], "tandem_kv.vllm");
        assert_eq!(tier["socket_dir"], ENGINE_SOCKET_DIR);
        assert_eq!(tier["model"], serde_json::to_value(&cfg.model).unwrap());
    }
}

/// The DecodePool's Service `http` port reaches the worker's front door for the Simulated engine
/// (and none), and the engine's own API for SGLang and vLLM.
#[test]
fn the_front_door_service_targets_the_engine_api_of_sglang_and_vllm() {
    let target = |d: &DecodePool| {
        let view = PoolView::decode(d);
        let svc = workload::front_door_service(&view, 80, &owner());
        svc.spec.unwrap().ports.unwrap()[0].target_port.clone()
    };
    let mut plain: DecodePool = load("decodepool.yaml");
    let front = target(&plain);
    plain.spec.engine = Some(engine(SIMULATED));
    assert_eq!(target(&plain), front);
    assert_ne!(front, Some(IntOrString::Int(i32::from(ENGINE_HTTP_PORT))));
    for file in ["engines/sglang.yaml", "engines/vllm.yaml"] {
        let (_, _, d) = engine_sample(file);
        assert_eq!(
            target(&d),
            Some(IntOrString::Int(i32::from(ENGINE_HTTP_PORT))),
            "{file}"
        );
    }
}

/// vLLM prefill/decode through Tandem (`engines/vllm-pd.yaml`, no CacheTier): both engines run
/// `TandemConnector` (the prefill's as producer, the decode's as consumer, failed loads
/// recomputed), without vLLM's CPU offload tier in their `/dev/shm`; the DecodePool Service reaches
/// the worker's front door, which hands requests to the engines with the pool's KV deadline.
#[test]
fn a_vllm_pd_stack_runs_tandems_connector_behind_the_front_door() {
    let (p, d) = pools_sample("engines/vllm-pd.yaml");
    for (view, role) in [
        (PoolView::prefill(&p), "kv_producer"),
        (PoolView::decode(&d), "kv_consumer"),
    ] {
        let (cfg, sts) = render_with(&view, TierLookup::None);
        assert!(pd_through_tandem(&cfg) && pd_pool(&view), "{role}");
        let t = vllm_transfer_config(&cfg, &sts);
        assert_eq!(t["kv_connector"], "TandemConnector");
        assert_eq!(t["kv_connector_module_path"], "tandem_kv.vllm_pd");
        assert_eq!(t["kv_role"], role);
        assert_eq!(t["kv_load_failure_policy"], "recompute");
        let x = &t["kv_connector_extra_config"];
        assert_eq!(x["socket_dir"], ENGINE_SOCKET_DIR);
        assert_eq!(x["model"], serde_json::to_value(&cfg.model).unwrap());
        assert_eq!(cfg.engine.as_ref().unwrap().http_port(), ENGINE_HTTP_PORT);
        if role == "kv_consumer" {
            assert_eq!(
                cfg.kv_deadline.map(|k| k.milliseconds),
                Some(10_000),
                "the front door hands the pool's KV deadline to the connector"
            );
            // The worker accepts it beside vLLM (its config check runs on load).
            cfg.check().expect("the rendered config loads");
        }
    }
    assert_service_targets_the_front_door(&d);
    // With a CacheTier the same engine serves whole requests (the offloading tier instead).
    let (tier, _, d) = engine_sample("engines/vllm.yaml");
    let view = PoolView::decode(&d);
    let (cfg, _) = render_on(&view, &tier);
    assert!(!pd_through_tandem(&cfg) && !pd_pool(&view));
}

/// SGLang prefill/decode through Tandem (`engines/sglang-pd.yaml`, no CacheTier): both engines
/// run in SGLang's PD mode with the `tandem` transfer backend and its config (the socket
/// directory and the worker's model) in the environment, without HiCache; the DecodePool Service
/// reaches the worker's front door, and the worker accepts the pool's KV deadline.
#[test]
fn an_sglang_pd_stack_runs_the_tandem_transfer_backend_behind_the_front_door() {
    let (p, d) = pools_sample("engines/sglang-pd.yaml");
    for (view, mode) in [
        (PoolView::prefill(&p), "prefill"),
        (PoolView::decode(&d), "decode"),
    ] {
        let (cfg, sts) = render_with(&view, TierLookup::None);
        assert!(pd_through_tandem(&cfg) && pd_pool(&view), "{mode}");
        let engine = &pod(&sts).containers[0];
        assert_eq!(
            engine.command.as_deref().unwrap(),
            ["python3", "-m", "sglang.launch_server"]
        );
        let args = engine.args.clone().unwrap();
        assert_eq!(flag(&args, "--disaggregation-mode"), mode);
        assert_eq!(flag(&args, "--disaggregation-transfer-backend"), "tandem");
        assert!(!args.iter().any(|a| a.starts_with("--hicache")), "{args:?}");
        let env = engine.env.clone().unwrap();
        let pd = env
            .iter()
            .find(|e| e.name == SGLANG_PD_CONFIG_ENV)
            .and_then(|e| e.value.as_deref())
            .expect("the backend's config");
        let pd: serde_json::Value = serde_json::from_str(pd).unwrap();
        assert_eq!(pd["socket_dir"], ENGINE_SOCKET_DIR);
        assert_eq!(pd["model"], serde_json::to_value(&cfg.model).unwrap());
        if mode == "decode" {
            assert_eq!(cfg.kv_deadline.map(|k| k.milliseconds), Some(10_000));
            cfg.check().expect("the rendered config loads");
        }
    }
    assert_service_targets_the_front_door(&d);
    // With a CacheTier the same engine serves whole requests with HiCache (no PD mode).
    let (tier, _, d) = engine_sample("engines/sglang.yaml");
    let (cfg, sts) = render_on(&PoolView::decode(&d), &tier);
    assert!(!pd_through_tandem(&cfg));
    let args = pod(&sts).containers[0].args.clone().unwrap();
    assert!(
        !args.iter().any(|a| a.starts_with("--disaggregation")),
        "{args:?}"
    );
}
