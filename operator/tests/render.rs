//! The pure builders against the sample stack in `manifests/samples/`.

use std::path::Path;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use tandem_crds::{CacheTier, DecodePool, PrefillPool};
use tandem_interfaces::config::WorkerConfig;
use tandem_interfaces::memory::AllocatorDomain;
use tandem_interfaces::memory::ClientMode;
use tandem_operator::policy::{self, TierLookup};
use tandem_operator::render::{PoolView, config::worker_config, workload};

fn load<T: serde::de::DeserializeOwned>(file: &str) -> T {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests/samples")
        .join(file);
    serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
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

fn rendered(pool: &PoolView<'_>, tier: &CacheTier) -> WorkerConfig {
    let lookup = TierLookup::Found {
        name: "llama70b-l3",
        spec: &tier.spec,
        terminating: false,
    };
    let policy = policy::resolve(pool.model, lookup).expect("sample policy resolves");
    let mut cfg = worker_config(pool, &policy, "").expect("sample renders");
    cfg.revision = workload::revision(pool, &cfg);
    cfg
}

/// Seed 000 at the operator level: the decode pool's draft pool is sized and placed in the tier's
/// SharedMemory domain, and the pod's shared-memory volume holds every pool.
#[test]
fn draft_pool_inherits_the_tier_domain_and_is_counted_in_the_segment() {
    let tier: CacheTier = load("cachetier.yaml");
    let decode: DecodePool = load("decodepool.yaml");
    let view = PoolView::decode(&decode);
    let cfg = rendered(&view, &tier);
    cfg.check()
        .expect("rendered config passes the worker's own checks");

    assert_eq!(cfg.memory.allocator, AllocatorDomain::SharedMemory);
    assert_eq!(cfg.memory.client_mode, Some(ClientMode::Standalone));
    // 1Gi of llama-3-70b KV (327,680 B/token) = 3,276 tokens; the llama-3-8b draft (131,072
    // B/token) needs the same number of tokens.
    assert_eq!(cfg.memory.target_pool_bytes, 1 << 30);
    assert_eq!(cfg.memory.draft_pool_bytes, 3_276 * 131_072);
    assert_eq!(cfg.memory.segment_bytes, (1 << 30) + 3_276 * 131_072);

    let sts = workload::group_statefulset(&view, &cfg, 0, &owner());
    let pod = sts.spec.template.spec.as_ref().unwrap();
    let shm = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == "kv-shm")
        .expect("shm volume");
    assert_eq!(
        shm.empty_dir
            .as_ref()
            .unwrap()
            .size_limit
            .as_ref()
            .unwrap()
            .0,
        cfg.memory.segment_bytes.to_string()
    );
    let sidecar = &pod.init_containers.as_ref().expect("store-client sidecar")[0];
    assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
    assert_eq!(sidecar.args.as_ref().unwrap()[0], "store-client");
}

#[test]
fn group_statefulset_shape() {
    let tier: CacheTier = load("cachetier.yaml");
    let mut prefill: PrefillPool = load("prefillpool.yaml");
    prefill.spec.parallelism.tensor = 2;
    prefill.spec.parallelism.context = 2;
    prefill.spec.layer_split = true;
    let view = PoolView::prefill(&prefill);
    let cfg = rendered(&view, &tier);
    let sts = workload::group_statefulset(&view, &cfg, 3, &owner());

    assert_eq!(sts.metadata.name.as_deref(), Some("llama70b-prefill-g3"));
    assert_eq!(
        sts.spec.replicas,
        Some(4),
        "a group is tensor × context pods"
    );
    assert_eq!(
        sts.spec.update_strategy.as_ref().unwrap().type_.as_deref(),
        Some("OnDelete")
    );
    let labels = sts
        .spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .as_ref()
        .unwrap();
    assert_eq!(labels["serving.tandem.dev/group"], "3");
    assert_eq!(labels["serving.tandem.dev/role"], "prefill");
    assert_eq!(labels["serving.tandem.dev/revision"], cfg.revision);
    let worker = &sts.spec.template.spec.as_ref().unwrap().containers[0];
    let gpu = &worker.resources.as_ref().unwrap().limits.as_ref().unwrap()["nvidia.com/gpu"];
    assert_eq!(gpu.0, "1", "one GPU per pod");
    assert_eq!(
        sts.metadata.owner_references.as_ref().unwrap()[0].uid,
        "u-1"
    );
    // LayerSplit over 2 CP ranks: layers 0..40 on rank 0, 40..80 on rank 1.
    let ls = cfg.layer_split.as_ref().unwrap();
    assert_eq!(ls.owned_by(1).next(), Some(40));
    // The ranks of a group dial each other on the rank link, by pod DNS under the pool's own
    // headless Service (the StatefulSet's serviceName).
    assert_eq!(
        cfg.ports.rank_link,
        Some(tandem_crds::ports::RANK_LINK_PORT)
    );
    assert_eq!(
        cfg.peers.group_service.as_deref(),
        Some("llama70b-prefill-peers.default.svc")
    );
    assert_eq!(
        sts.spec.service_name.as_deref(),
        Some("llama70b-prefill-peers")
    );
    let ports: Vec<_> = worker
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|p| (p.name.as_deref().unwrap(), p.container_port))
        .collect();
    assert!(
        ports.contains(&("rank-link", i32::from(tandem_crds::ports::RANK_LINK_PORT))),
        "{ports:?}"
    );
    cfg.check()
        .expect("the rendered LayerSplit config is consistent");
    // Without LayerSplit the CP ranks are still a group (replicated): the same link.
    prefill.spec.layer_split = false;
    let replicated = rendered(&PoolView::prefill(&prefill), &tier);
    assert_eq!(replicated.ports.rank_link, cfg.ports.rank_link);
    assert_eq!(replicated.peers.group_service, cfg.peers.group_service);
    // A single CP rank has no peer, and a decode pool no rank link.
    prefill.spec.parallelism.context = 1;
    let single = rendered(&PoolView::prefill(&prefill), &tier);
    assert_eq!(single.ports.rank_link, None);
    assert_eq!(single.peers.group_service, None);
    let decode: DecodePool = load("decodepool.yaml");
    let d = rendered(&PoolView::decode(&decode), &tier);
    assert_eq!((d.ports.rank_link, d.peers.group_service), (None, None));
}

#[test]
fn revision_changes_with_restart_id_and_image_only() {
    let tier: CacheTier = load("cachetier.yaml");
    let decode: DecodePool = load("decodepool.yaml");
    let base = rendered(&PoolView::decode(&decode), &tier).revision;
    assert_eq!(
        rendered(&PoolView::decode(&decode), &tier).revision,
        base,
        "deterministic"
    );

    let mut d2 = decode.clone();
    d2.spec.restart = Some(tandem_crds::RestartSpec {
        id: "second".into(),
    });
    assert_ne!(rendered(&PoolView::decode(&d2), &tier).revision, base);

    let mut d3 = decode.clone();
    d3.spec.image = "example/tandem-worker:next".into();
    assert_ne!(rendered(&PoolView::decode(&d3), &tier).revision, base);

    let mut d4 = decode.clone();
    d4.spec.replicas = 7; // scaling adds groups; it does not restart the running ones
    assert_eq!(rendered(&PoolView::decode(&d4), &tier).revision, base);

    // Placement is in the pod template of OnDelete StatefulSets: only a new revision makes the
    // rollout replace the pods so the scheduler applies it (adding, changing, removing it).
    use tandem_crds::{PlacementMode, PlacementSpec, TopologyKey};
    let mut d5 = decode.clone();
    d5.spec.placement = Some(PlacementSpec {
        topology_key: TopologyKey("topology.kubernetes.io/zone".into()),
        mode: PlacementMode::Preferred,
    });
    let preferred = rendered(&PoolView::decode(&d5), &tier).revision;
    assert_ne!(preferred, base);
    d5.spec.placement.as_mut().unwrap().mode = PlacementMode::Required;
    assert_ne!(rendered(&PoolView::decode(&d5), &tier).revision, preferred);
}

#[test]
fn config_file_round_trips_through_the_worker_loader() {
    let tier: CacheTier = load("cachetier.yaml");
    let prefill: PrefillPool = load("prefillpool.yaml");
    let view = PoolView::prefill(&prefill);
    let cfg = rendered(&view, &tier);
    let cm = workload::config_map(&view, &cfg, &owner()).unwrap();
    let text = &cm.data.as_ref().unwrap()["worker.json"];
    // The worker's loader reads the file and parses and checks its text with `from_json`.
    let path = Path::new("/etc/tandem/worker.json");
    assert_eq!(WorkerConfig::from_json(text, path).unwrap(), cfg);
    // A field the worker does not know is refused, not dropped.
    let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
    v["memory"]["surprise"] = serde_json::json!(1);
    assert!(WorkerConfig::from_json(&v.to_string(), path).is_err());
}

/// `spec.placement` (issue 17): a group's pods share the topology domain of `topologyKey` (a
/// term selecting exactly that group's pods), a DecodePool's pods go where its paired
/// PrefillPool's pods run, `Required` and `Preferred` render the hard and the weighted forms,
/// and no placement renders no affinity (the scheduler's own spreading).
#[test]
fn placement_renders_group_packing_and_pairing_affinity() {
    use tandem_crds::{PlacementMode, PlacementSpec, TopologyKey};
    let tier: CacheTier = load("cachetier.yaml");
    let zone = "topology.kubernetes.io/zone";
    let mut decode: DecodePool = load("decodepool.yaml");
    let plain = {
        let view = PoolView::decode(&decode);
        let cfg = rendered(&view, &tier);
        workload::group_statefulset(&view, &cfg, 1, &owner())
    };
    assert!(
        plain
            .spec
            .template
            .spec
            .as_ref()
            .unwrap()
            .affinity
            .is_none(),
        "no placement, no affinity"
    );
    decode.spec.placement = Some(PlacementSpec {
        topology_key: TopologyKey(zone.into()),
        mode: PlacementMode::Required,
    });
    let view = PoolView::decode(&decode);
    let cfg = rendered(&view, &tier);
    let sts = workload::group_statefulset(&view, &cfg, 1, &owner());
    let pa = sts
        .spec
        .template
        .spec
        .as_ref()
        .unwrap()
        .affinity
        .as_ref()
        .unwrap()
        .pod_affinity
        .as_ref()
        .unwrap();
    // Required on a paired DecodePool: pairing is the required term, packing the weighted one
    // (kube-scheduler meets required terms only through one pod matching all of them, and no pod
    // is both a decode and a prefill pod: two required terms would leave every decode Pending).
    let required = pa
        .required_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap();
    assert_eq!(required.len(), 1, "pairing only: {required:?}");
    let preferred = pa
        .preferred_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap();
    assert_eq!(preferred.len(), 1, "packing, weighted: {preferred:?}");
    assert_eq!(preferred[0].weight, 100);
    let terms = [required[0].clone(), preferred[0].pod_affinity_term.clone()];
    let sel = |i: usize| {
        terms[i]
            .label_selector
            .as_ref()
            .unwrap()
            .match_labels
            .clone()
            .unwrap()
    };
    assert!(terms.iter().all(|t| t.topology_key == zone));
    // The packing term selects this group's pods, and they carry its labels (a pod matches its
    // own term, which lets the scheduler place a group's first pod).
    let own = sel(1);
    let pod_labels = sts
        .spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    assert_eq!(own["serving.tandem.dev/group"], "1");
    assert!(
        own.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
        "{own:?} ⊄ {pod_labels:?}"
    );
    let pair = sel(0);
    assert_eq!(pair["serving.tandem.dev/pool"], "llama70b-prefill");
    assert_eq!(pair["serving.tandem.dev/role"], "prefill");
    assert!(!pair.contains_key("serving.tandem.dev/group"));

    // Required on a PrefillPool: its packing term alone, required.
    let mut prefill: PrefillPool = load("prefillpool.yaml");
    prefill.spec.placement = Some(PlacementSpec {
        topology_key: TopologyKey(zone.into()),
        mode: PlacementMode::Required,
    });
    let view = PoolView::prefill(&prefill);
    let cfg = rendered(&view, &tier);
    let pa = workload::group_statefulset(&view, &cfg, 2, &owner())
        .spec
        .template
        .spec
        .unwrap()
        .affinity
        .unwrap()
        .pod_affinity
        .unwrap();
    assert!(
        pa.preferred_during_scheduling_ignored_during_execution
            .is_none()
    );
    let required = pa
        .required_during_scheduling_ignored_during_execution
        .unwrap();
    assert_eq!(required.len(), 1, "{required:?}");
    let own = required[0]
        .label_selector
        .clone()
        .unwrap()
        .match_labels
        .unwrap();
    assert_eq!(own["serving.tandem.dev/pool"], "llama70b-prefill");
    assert_eq!(own["serving.tandem.dev/group"], "2");

    // Preferred: the same terms, weighted; a PrefillPool gets only its packing term.
    prefill.spec.placement = Some(PlacementSpec {
        topology_key: TopologyKey(zone.into()),
        mode: PlacementMode::Preferred,
    });
    let view = PoolView::prefill(&prefill);
    let cfg = rendered(&view, &tier);
    let sts = workload::group_statefulset(&view, &cfg, 0, &owner());
    let pa = sts
        .spec
        .template
        .spec
        .unwrap()
        .affinity
        .unwrap()
        .pod_affinity
        .unwrap();
    assert!(
        pa.required_during_scheduling_ignored_during_execution
            .is_none()
    );
    let weighted = pa
        .preferred_during_scheduling_ignored_during_execution
        .unwrap();
    assert_eq!(weighted.len(), 1, "{weighted:?}");
    assert_eq!(weighted[0].weight, 100);
    assert_eq!(
        weighted[0]
            .pod_affinity_term
            .label_selector
            .as_ref()
            .unwrap()
            .match_labels
            .as_ref()
            .unwrap()["serving.tandem.dev/pool"],
        "llama70b-prefill"
    );
}
