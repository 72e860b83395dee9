//! The operator at a small scale on kwok nodes against a real API server (issue 17): N = 5 stacks
//! and one pool scaled 1 → 8 groups, then rolled — the CI size of `tandem-e2e scale`.
//!
//! Asserts every stack becomes Ready; that the operator's steady resyncs write nothing (read from
//! its own `writes_total`, which counts every write, events included, over a window in which every
//! object was reconciled again), while the same counter did grow while the stacks were applied (it
//! is not a counter that cannot move); that the rolling restart replaced every pod of both pools
//! and never left a pool without a serving group; and that the report (JSON, markdown, SVG) is
//! written.
//!
//! Runs its own cluster (port offset 5600, state in a temp dir). Without cached control-plane
//! binaries it prints why it is skipped, unless `TANDEM_E2E_REQUIRE_CLUSTER` is set. Run it under
//! the shared lock: `flock /work/wt/cluster.lock cargo test -p tandem-e2e --test scale`.

use std::time::{Duration, Instant};

use tandem_e2e::cluster::BuildMode;
use tandem_e2e::runner::image::locate_binary;
use tandem_e2e::scale::{ScaleError, ScaleOptions, run_scale};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_stacks_and_one_pool_scaled_to_eight_on_kwok() {
    let required = std::env::var_os("TANDEM_E2E_REQUIRE_CLUSTER").is_some();
    // `cargo test --workspace` builds the operator binary; a lone `cargo test -p tandem-e2e` needs
    // `cargo build -p tandem-operator` first (building it here would hold the cluster lock).
    let operator = locate_binary("tandem-operator", "TANDEM_OPERATOR_BIN");
    assert!(
        operator.is_file(),
        "{} missing: run `cargo build -p tandem-operator` (or set TANDEM_OPERATOR_BIN)",
        operator.display()
    );
    let tmp = tempfile::tempdir().expect("temp dir");
    let opts = ScaleOptions {
        stacks: vec![5],
        out: tmp.path().join("report"),
        port_offset: 5600,
        state_dir: Some(tmp.path().join("cluster")),
        gpus_per_node: 8,
        scale_groups: 8,
        resync_seconds: Some(10),
        read_cache: true,
        samples: None,
        operator_bin: Some(operator.clone()),
        build: if required {
            BuildMode::BuildIfMissing
        } else {
            BuildMode::CachedOnly
        },
        phase_timeout: Duration::from_secs(120),
        placement_key: None,
        apply_rate: None,
    };
    let started = Instant::now();
    let report = match run_scale(&opts).await {
        Ok(r) => r,
        Err(ScaleError::Cluster(tandem_e2e::cluster::ClusterError::NotBuilt)) if !required => {
            println!("SKIPPED: control-plane binaries are not built (run `tandem-e2e cluster up`)");
            return;
        }
        Err(e) => panic!("scale run: {e}"),
    };
    println!("{}", report.markdown());
    println!("scale suite took {:.1} s", started.elapsed().as_secs_f64());

    let run = &report.runs[0];
    assert_eq!(run.n, 5);
    assert_eq!(run.stacks_ready, 5, "every stack Ready");
    let a = run.apply_to_ready_ms.expect("apply-to-Ready measured");
    assert_eq!(a.count, 5);
    // The write counter moves when the operator writes: applying the stacks took applies,
    // finalizers and status patches.
    for verb in ["apply", "finalizer", "status"] {
        assert!(
            run.operator_writes_by_verb
                .get(verb)
                .copied()
                .unwrap_or(0.0)
                > 0.0,
            "the operator counted no {verb} while applying: {:?}",
            run.operator_writes_by_verb
        );
    }
    // Its events were listed from the API server: every stack's children were Created.
    assert!(
        run.operator_events_by_reason
            .get("Created")
            .copied()
            .unwrap_or(0.0)
            >= 5.0,
        "the operator's events by reason: {:?}",
        run.operator_events_by_reason
    );
    // ... and stays put across a full resync of every object.
    assert!(
        run.steady_reconciles >= 15.0,
        "the steady window saw {} reconciles, not one resync of all 15 objects",
        run.steady_reconciles
    );
    assert_eq!(
        run.steady_writes, 0.0,
        "writes during steady resyncs: {run:?}"
    );
    assert_eq!(run.writes_per_steady_resync, 0.0);
    assert!(run.peak_rss_mib > 0.0 && run.cpu_s_to_settled > 0.0);
    assert!(
        run.api_requests_by_verb.get("LIST").copied().unwrap_or(0.0) > 0.0,
        "{:?}",
        run.api_requests_by_verb
    );

    let s = report.scaled.as_ref().expect("the scale experiment ran");
    assert_eq!(s.target, 8);
    assert_eq!(s.pods_before_restart, 16, "8 decode + 8 prefill pods");
    assert_eq!(s.pods_replaced, 16, "the restart replaced every pod");
    assert_ne!(s.revision_before, s.revision_after);
    assert!(
        s.min_serving_decode_during_restart >= 1 && s.min_serving_prefill_during_restart >= 1,
        "a pool had no serving group during the restart: {s:?}"
    );
    // One group at a time per pool (DESIGN §5): never more than one group of a pool down.
    assert!(
        s.max_not_serving_decode_during_restart <= 1
            && s.max_not_serving_prefill_during_restart <= 1,
        "{s:?}"
    );
    assert!(report.passed(), "{:?}", report.checks);
    for f in [
        "scale.json",
        "scale.md",
        "apply_to_ready.svg",
        "reconcile.svg",
        "rss.svg",
        "serving.svg",
    ] {
        assert!(opts.out.join(f).is_file(), "{f} written");
    }
}

/// The samples with `spec.placement: {topologyKey: key, mode}` on both pools, prefill groups of
/// two pods (tensor 2), written to `dir`.
fn placed_samples(dir: &std::path::Path, key: &str, mode: &str) {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/samples");
    for f in ["cachetier.yaml", "prefillpool.yaml", "decodepool.yaml"] {
        let mut text = std::fs::read_to_string(src.join(f)).unwrap();
        if f == "prefillpool.yaml" {
            assert!(text.contains("    tensor: 1\n"), "{f} changed");
            text = text.replacen("    tensor: 1\n", "    tensor: 2\n", 1);
        }
        if f != "cachetier.yaml" {
            assert!(text.contains("\n  hostPool:\n"), "{f} changed");
            text = text.replacen(
                "\n  hostPool:\n",
                &format!("\n  placement:\n    topologyKey: {key}\n    mode: {mode}\n  hostPool:\n"),
                1,
            );
        }
        std::fs::write(dir.join(f), text).unwrap();
    }
}

/// Issue 17, topology-aware placement on kwok nodes in two zones: three stacks whose pools say
/// `placement: {topologyKey: topology.kubernetes.io/zone, mode: Required}`, prefill groups of two
/// pods. Every group's pods share a zone, every decode pod is in a zone holding prefill pods of
/// its stack, no pod is on a node without the label, both zones are used, and no pool reports a
/// node without the label.
///
/// The baseline (run first) places by a label no node has, `Preferred`: the scheduler has nothing
/// to prefer, so it spreads as without placement and splits two-pod groups across the zones (the
/// negative control of the packing check; 12 of 12 groups when written), and every pool reports
/// `Degraded`, `NodeWithoutTopologyLabel` (the operator's check of the nodes, on a real API
/// server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_zone_placement_packs_groups_and_pairs_decode_with_prefill_on_kwok() {
    let required = std::env::var_os("TANDEM_E2E_REQUIRE_CLUSTER").is_some();
    let operator = locate_binary("tandem-operator", "TANDEM_OPERATOR_BIN");
    assert!(operator.is_file(), "{} missing", operator.display());
    let tmp = tempfile::tempdir().expect("temp dir");
    let mut figures = Vec::new();
    // Each run has its own control plane and ports (offsets 5300 and 5400).
    let zone = "topology.kubernetes.io/zone";
    for (name, key, mode, ports) in [
        ("baseline", "example.com/absent-rack", "Preferred", 5300),
        ("required", zone, "Required", 5400),
    ] {
        let samples = tmp.path().join(name).join("samples");
        std::fs::create_dir_all(&samples).unwrap();
        placed_samples(&samples, key, mode);
        let opts = ScaleOptions {
            stacks: vec![3],
            out: tmp.path().join(name).join("report"),
            port_offset: ports,
            state_dir: Some(tmp.path().join(name).join("cluster")),
            // Two nodes of 32 GPUs, one per zone: either zone alone holds all three stacks (27
            // GPUs). With 8-GPU nodes (24 and 16 GPUs per zone) the scheduler could start two
            // stacks' groups in the smaller zone and leave a group's second pod unschedulable
            // (Required keeps it there): seen twice in seven runs.
            gpus_per_node: 32,
            scale_groups: 0,
            resync_seconds: Some(10),
            read_cache: true,
            samples: Some(samples),
            operator_bin: Some(operator.clone()),
            build: if required {
                BuildMode::BuildIfMissing
            } else {
                BuildMode::CachedOnly
            },
            phase_timeout: Duration::from_secs(120),
            placement_key: Some(zone.into()),
            apply_rate: None,
        };
        let report = match run_scale(&opts).await {
            Ok(r) => r,
            Err(ScaleError::Cluster(tandem_e2e::cluster::ClusterError::NotBuilt)) if !required => {
                println!("SKIPPED: control-plane binaries are not built");
                return;
            }
            Err(e) => panic!("{name} run: {e}"),
        };
        assert_eq!(report.runs[0].stacks_ready, 3, "{name}: every stack Ready");
        figures.push((name, report.runs[0].placement.clone()));
    }
    let baseline = figures[0].1.clone().expect("baseline figures");
    println!("baseline without placement: {baseline:?}");
    // The negative control: without placement the scheduler's default spreading splits two-pod
    // groups across the zones (12 of 12 in the first run), so the assertions below can fail.
    assert!(
        baseline.split_groups > 0,
        "the baseline split no group: the check below would not discriminate: {baseline:?}"
    );
    assert_eq!(baseline.pools, 6, "{baseline:?}");
    assert_eq!(
        baseline.pools_reporting_unlabeled_nodes, 6,
        "every pool runs on nodes without example.com/absent-rack and must say so: {baseline:?}"
    );
    let p = figures[1]
        .1
        .clone()
        .expect("placement figures of the Required run");
    println!("required zone placement: {p:?}");
    assert!(
        p.pods >= 3 * (4 * 2 + 1),
        "3 stacks of 4 two-pod prefill groups and a decode: {p:?}"
    );
    assert_eq!(p.multi_pod_groups, 12, "{p:?}");
    assert_eq!(p.split_groups, 0, "a group's pods in two zones: {p:?}");
    assert_eq!(
        p.unpaired_decode_pods, 0,
        "a decode pod away from its prefill pods: {p:?}"
    );
    assert_eq!(p.pods_on_unlabeled_nodes, 0, "{p:?}");
    assert_eq!(p.pods_per_domain.len(), 2, "both zones used: {p:?}");
    assert_eq!(p.pools_reporting_unlabeled_nodes, 0, "{p:?}");
}
