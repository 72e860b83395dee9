//! `spec.engine` through the pure builders (DESIGN §3.1, issue 13): the pod is the engine as
//! main container with the worker as its native sidecar, sharing the engine-API socket
//! `emptyDir`; the worker config names the seat; SGLang and vLLM are refused before anything is
//! rendered. The pools are the samples in `manifests/samples/` with an `engine` block from YAML.

use std::path::Path;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Container, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tandem_crds::{CacheTier, DecodePool, EngineKind, EngineSpec, PrefillPool};
use tandem_interfaces::config::{EngineKind as SeatKind, EngineSeat, WorkerConfig};
use tandem_operator::controller::revision::{Blocked, resolve_with};
use tandem_operator::policy::TierLookup;
use tandem_operator::render::engine::{ENGINE_SOCKET_DIR, EngineUnsupported};
use tandem_operator::render::{PoolView, workload};

fn load<T: serde::de::DeserializeOwned>(file: &str) -> T {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests/samples")
        .join(file);
    serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

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
    assert_eq!(
        worker.resources, today.resources,
        "the pod's GPU stays with the worker"
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
    let gpu_free = e
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .is_none_or(|l| !l.contains_key("nvidia.com/gpu"));
    assert!(gpu_free, "one GPU per pod, on the worker");

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
    // SGLang and vLLM stay refused on a DecodePool.
    d.spec.engine = Some(engine("kind: vLLM\nimage: vllm/vllm-openai:v0.11.0\n"));
    let lookup = TierLookup::Found {
        name: "llama70b-l3",
        spec: &tier.spec,
        terminating: false,
    };
    match resolve_with(&PoolView::decode(&d), lookup) {
        Err(Blocked::Engine(e)) => assert_eq!(
            e,
            EngineUnsupported::Kind {
                kind: EngineKind::Vllm
            }
        ),
        other => panic!("expected EngineUnsupported::Kind, got {other:?}"),
    }
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

#[test]
fn sglang_and_vllm_are_refused_before_anything_is_rendered() {
    let tier: CacheTier = load("cachetier.yaml");
    for (yaml, kind) in [
        (
            "kind: SGLang\nimage: lmsysorg/sglang:v0.5.4\n",
            EngineKind::SgLang,
        ),
        (
            "kind: vLLM\nimage: vllm/vllm-openai:v0.11.0\n",
            EngineKind::Vllm,
        ),
    ] {
        let mut d: DecodePool = load("decodepool.yaml");
        d.spec.engine = Some(engine(yaml));
        let lookup = TierLookup::Found {
            name: "llama70b-l3",
            spec: &tier.spec,
            terminating: false,
        };
        match resolve_with(&PoolView::decode(&d), lookup) {
            Err(Blocked::Engine(e)) => assert_eq!(e, EngineUnsupported::Kind { kind }),
            other => panic!("{kind}: expected EngineUnsupported, got {other:?}"),
        }
        // Refused first: even a pool whose tier is missing reports the engine.
        let mut p: PrefillPool = load("prefillpool.yaml");
        p.spec.engine = Some(engine(yaml));
        assert!(matches!(
            resolve_with(&PoolView::prefill(&p), TierLookup::Missing("gone")),
            Err(Blocked::Engine(_))
        ));
    }
}
