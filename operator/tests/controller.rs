//! The reconcilers against a mock API (tower-test): exact request sequences.
//!
//! - a steady-state resync makes zero writes (and the `always_apply` negative control makes
//!   writes, so the count can fail);
//! - a PolicyConflict creates and updates no child;
//! - once `deletionTimestamp` is set nothing creates or applies a child, including under
//!   foreground cascading deletion (and the `reconcile_while_deleting` negative control does);
//! - a hand-edited group replica count is restored with a `ReplicaDrift` event;
//! - a restart rolls prefill before decode;
//! - SGLang and vLLM engines roll out with the adapters' flags, the worker as their native
//!   sidecar and the front door on the engine's own API port;
//! - a two-pod group is Ready only whole: the group-ready readiness gate opens on both pods once
//!   both are `ContainersReady`, closes on both when one rank drops, with no write at rest.

mod support;

use std::path::Path;
use std::sync::Arc;

use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Api, Client};
use serde_json::{Value, json};
use support::{Call, FakeApi, paths};
use tandem_crds::{CacheTier, DecodePool, PrefillPool};
use tandem_operator::controller::cache::{Caches, Trim};
use tandem_operator::controller::{Context, cache_tier, decode_pool, prefill_pool};
use tandem_operator::metrics::Metrics;

fn sample(file: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests/samples")
        .join(file);
    serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn seed(fake: &FakeApi) {
    fake.insert(paths::TIERS, sample("cachetier.yaml"));
    fake.insert(paths::PREFILLS, sample("prefillpool.yaml"));
    fake.insert(paths::DECODES, sample("decodepool.yaml"));
}

fn context(client: Client) -> Arc<Context> {
    let mut ctx = Context::new(client, Metrics::new());
    ctx.probe_reports = false;
    Arc::new(ctx)
}

const TIER: &str = "llama70b-l3";
const PREFILL: &str = "llama70b-prefill";
const DECODE: &str = "llama70b-decode";

async fn reconcile_tier(ctx: &Arc<Context>) {
    let api: Api<CacheTier> = Api::namespaced(ctx.client.clone(), "default");
    if let Some(t) = api.get_opt(TIER).await.unwrap() {
        cache_tier::reconcile(Arc::new(t), ctx.clone())
            .await
            .unwrap();
    }
}

async fn reconcile_prefill(ctx: &Arc<Context>) {
    let api: Api<PrefillPool> = Api::namespaced(ctx.client.clone(), "default");
    if let Some(p) = api.get_opt(PREFILL).await.unwrap() {
        prefill_pool::reconcile(Arc::new(p), ctx.clone())
            .await
            .unwrap();
    }
}

async fn reconcile_decode(ctx: &Arc<Context>) {
    let api: Api<DecodePool> = Api::namespaced(ctx.client.clone(), "default");
    if let Some(d) = api.get_opt(DECODE).await.unwrap() {
        decode_pool::reconcile(Arc::new(d), ctx.clone())
            .await
            .unwrap();
    }
}

async fn round(ctx: &Arc<Context>) {
    reconcile_tier(ctx).await;
    reconcile_prefill(ctx).await;
    reconcile_decode(ctx).await;
}

/// Runs rounds (materialising pods in between) until a round writes nothing; panics after 8.
async fn converge(fake: &FakeApi, ctx: &Arc<Context>) {
    for _ in 0..8 {
        fake.clear_calls();
        round(ctx).await;
        fake.materialize_pods();
        if fake.writes().is_empty() {
            return;
        }
    }
    panic!(
        "no steady state after 8 rounds; last writes: {:#?}",
        summary(&fake.writes())
    );
}

fn summary(calls: &[Call]) -> Vec<String> {
    calls
        .iter()
        .map(|c| {
            format!(
                "{} {} {}",
                c.method,
                c.path,
                c.content_type.as_deref().unwrap_or("")
            )
        })
        .collect()
}

fn child_collections() -> [&'static str; 3] {
    [paths::STS, paths::SVC, paths::CM]
}

/// Writes that create or apply a child (the thing a terminating or conflicting resource must
/// never do).
fn child_creates_or_applies(calls: &[Call]) -> Vec<String> {
    let bad: Vec<Call> = calls
        .iter()
        .filter(|c| child_collections().iter().any(|p| c.path.starts_with(p)))
        .filter(|c| {
            c.method == "POST" || (c.method == "PATCH" && c.is_apply()) || c.method == "PUT"
        })
        .cloned()
        .collect();
    summary(&bad)
}

/// The status condition of `type_` on `obj` (panics when absent: the tests expect it).
fn condition(obj: &Value, type_: &str) -> Value {
    obj["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {obj}"))
        .clone()
}

fn event_reasons(calls: &[Call]) -> Vec<String> {
    calls
        .iter()
        .filter(|c| c.path.starts_with(paths::EVENTS) && c.method == "POST")
        .filter_map(|c| c.body.as_ref()?["reason"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn the_stack_converges_and_a_steady_state_resync_makes_zero_writes() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client);
    converge(&fake, &ctx).await;

    // What the stack became: ratio 4:1 with one decode group → four prefill groups.
    let sts = fake.names(paths::STS);
    for g in 0..4 {
        assert!(sts.contains(&format!("{PREFILL}-g{g}")), "{sts:?}");
    }
    assert!(sts.contains(&format!("{DECODE}-g0")));
    assert!(sts.contains(&format!("{TIER}-store")));
    let svcs = fake.names(paths::SVC);
    for s in [
        DECODE,
        "llama70b-decode-peers",
        "llama70b-prefill-peers",
        "llama70b-l3-store",
    ] {
        assert!(svcs.contains(&s.to_string()), "{svcs:?}");
    }
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    assert_eq!(
        p["status"]["replicasOwner"],
        json!("DecodePool/llama70b-decode ratio 4:1")
    );
    assert_eq!(p["status"]["desiredReplicas"], json!(4));
    assert_eq!(p["status"]["readyReplicas"], json!(4));
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(
        d["status"]["scaling"]["applied"],
        json!({"decode": 1, "prefill": 4})
    );
    assert_eq!(
        d["status"]["updateRevision"], p["status"]["updateRevision"],
        "one revision per pair"
    );
    let ready = condition(&d, "Ready");
    assert_eq!(ready["status"], "True", "{ready}");
    let t = fake.get(paths::TIERS, TIER).unwrap();
    let warm = condition(&t, "CacheWarm");
    assert_eq!(
        (warm["status"].as_str(), warm["reason"].as_str()),
        (Some("True"), Some("ReadyApproximation"))
    );
    for o in [&p, &d, &t] {
        assert_eq!(
            o["metadata"]["finalizers"],
            json!(["serving.tandem.dev/teardown"])
        );
    }

    // The resync.
    fake.clear_calls();
    round(&ctx).await;
    let calls = fake.calls();
    assert!(calls.len() > 10, "the resync reads the world");
    assert_eq!(
        summary(&fake.writes()),
        Vec::<String>::new(),
        "steady state must not write"
    );
}

/// Negative control: without the desired-hash comparison every resync writes every child.
#[tokio::test]
async fn negative_control_always_apply_makes_the_resync_write() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client.clone());
    converge(&fake, &ctx).await;
    let mut unsafe_ctx = Context::new(client, Metrics::new());
    unsafe_ctx.probe_reports = false;
    unsafe_ctx.unsafe_modes.always_apply = true;
    let unsafe_ctx = Arc::new(unsafe_ctx);
    fake.clear_calls();
    round(&unsafe_ctx).await;
    let applies = fake.writes().iter().filter(|c| c.is_apply()).count();
    assert!(
        applies >= 8,
        "the zero-write test can fail: {applies} applies"
    );
}

#[tokio::test]
async fn a_policy_conflict_creates_no_child_and_says_why() {
    let (fake, client) = FakeApi::start();
    let mut tier = sample("cachetier.yaml");
    tier["spec"]["model"]["headDim"] = json!(64);
    fake.insert(paths::TIERS, tier);
    fake.insert(paths::PREFILLS, sample("prefillpool.yaml"));
    fake.insert(paths::DECODES, sample("decodepool.yaml"));
    let ctx = context(client);
    reconcile_prefill(&ctx).await;
    reconcile_decode(&ctx).await;
    reconcile_decode(&ctx).await;
    let calls = fake.calls();
    assert_eq!(child_creates_or_applies(&calls), Vec::<String>::new());
    assert!(fake.names(paths::STS).is_empty());
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    let pc = condition(&d, "PolicyConflict");
    assert_eq!(
        (pc["status"].as_str(), pc["reason"].as_str()),
        (Some("True"), Some("ModelMismatch"))
    );
    assert!(pc["message"].as_str().unwrap().contains("head_dim"), "{pc}");
    let reasons = event_reasons(&calls);
    assert_eq!(
        reasons.iter().filter(|r| *r == "ModelMismatch").count(),
        2,
        "one event per pool, not one per reconcile: {reasons:?}"
    );
}

/// Issue 14: a vLLM DecodePool without a CacheTier (Tandem's connector) paired with a Simulated
/// PrefillPool could move no KV: the DecodePool is refused with `PrefillEngineMismatch`, naming
/// both paths, and creates no child; both vLLM without a tier is admitted.
#[tokio::test]
async fn a_pair_whose_engines_move_kv_differently_is_refused() {
    let (fake, client) = FakeApi::start();
    let mut d = sample("decodepool.yaml");
    let spec = d["spec"].as_object_mut().unwrap();
    spec.remove("cacheTierRef");
    spec.remove("speculative");
    spec.insert(
        "engine".into(),
        json!({"kind": "vLLM", "image": "vllm/vllm-openai:v0.33.0", "args": ["m"]}),
    );
    fake.insert(paths::PREFILLS, sample("prefillpool.yaml"));
    fake.insert(paths::DECODES, d);
    let ctx = context(client);
    reconcile_decode(&ctx).await;
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    let pc = condition(&d, "PolicyConflict");
    assert_eq!(
        (pc["status"].as_str(), pc["reason"].as_str()),
        (Some("True"), Some("PrefillEngineMismatch"))
    );
    let m = pc["message"].as_str().unwrap();
    assert!(
        m.contains("TandemConnector") && m.contains("Simulated"),
        "{m}"
    );
    assert!(fake.names(paths::STS).is_empty());
    // The PrefillPool on vLLM without a tier too: the pair moves KV one way, and rolls out.
    fake.edit(paths::PREFILLS, PREFILL, |o| {
        o["spec"].as_object_mut().unwrap().remove("cacheTierRef");
        o["spec"]["engine"] =
            json!({"kind": "vLLM", "image": "vllm/vllm-openai:v0.33.0", "args": ["m"]});
        o["metadata"]["generation"] = json!(2);
    });
    reconcile_prefill(&ctx).await;
    reconcile_decode(&ctx).await;
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(condition(&d, "PolicyConflict")["status"], "False", "{d}");
}

fn mark_deleting(fake: &FakeApi, collection: &str, name: &str) {
    fake.edit(collection, name, |o| {
        o["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    });
}

/// Background deletion: the DecodePool stops routing, scales its groups to zero, waits for the
/// pods, and releases its finalizer — creating or applying nothing.
#[tokio::test]
async fn a_deleted_decode_pool_tears_down_in_order_without_creating_or_applying() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client);
    converge(&fake, &ctx).await;
    mark_deleting(&fake, paths::DECODES, DECODE);
    fake.clear_calls();

    reconcile_decode(&ctx).await; // stop routing
    assert!(
        fake.get(paths::SVC, DECODE).is_none(),
        "front door deleted first"
    );
    assert_eq!(
        fake.get(paths::STS, "llama70b-decode-g0").unwrap()["spec"]["replicas"],
        json!(1)
    );
    reconcile_decode(&ctx).await; // scale to zero
    assert_eq!(
        fake.get(paths::STS, "llama70b-decode-g0").unwrap()["spec"]["replicas"],
        json!(0)
    );
    reconcile_decode(&ctx).await; // pods still there: wait
    assert!(fake.get(paths::DECODES, DECODE).is_some());
    // The PrefillPool, also deleted, waits for the decode pods.
    mark_deleting(&fake, paths::PREFILLS, PREFILL);
    reconcile_prefill(&ctx).await;
    assert_eq!(
        fake.get(paths::STS, "llama70b-prefill-g0").unwrap()["spec"]["replicas"],
        json!(1),
        "prefill waits for decode to drain"
    );
    fake.materialize_pods(); // the StatefulSet controller removes the decode pod
    reconcile_decode(&ctx).await; // release
    assert!(
        fake.get(paths::DECODES, DECODE).is_none(),
        "finalizer removed"
    );
    reconcile_prefill(&ctx).await; // now prefill scales down
    assert_eq!(
        fake.get(paths::STS, "llama70b-prefill-g0").unwrap()["spec"]["replicas"],
        json!(0)
    );

    let calls = fake.calls();
    assert_eq!(child_creates_or_applies(&calls), Vec::<String>::new());
    let reasons = event_reasons(&calls);
    let pos = |r: &str| {
        reasons
            .iter()
            .position(|x| x == r)
            .unwrap_or_else(|| panic!("{r} in {reasons:?}"))
    };
    assert!(pos("StopRouting") < pos("Draining"));
    assert!(pos("Draining") < pos("TeardownComplete"));
}

/// Foreground cascading deletion: the garbage collector deletes the children (marked, then
/// gone) before the owner; the operator must not bring any of them back.
#[tokio::test]
async fn foreground_deletion_never_recreates_children() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client);
    converge(&fake, &ctx).await;
    mark_deleting(&fake, paths::DECODES, DECODE);
    // GC marks the dependents first...
    for c in child_collections() {
        for n in fake.names(c).into_iter().filter(|n| n.starts_with(DECODE)) {
            mark_deleting(&fake, c, &n);
        }
    }
    fake.clear_calls();
    reconcile_decode(&ctx).await;
    // ...then removes them.
    for c in child_collections().into_iter().chain([paths::PODS]) {
        for n in fake.names(c).into_iter().filter(|n| n.starts_with(DECODE)) {
            fake.remove(c, &n);
        }
    }
    reconcile_decode(&ctx).await;
    reconcile_decode(&ctx).await;
    let calls = fake.calls();
    assert_eq!(child_creates_or_applies(&calls), Vec::<String>::new());
    assert!(
        fake.names(paths::STS)
            .iter()
            .all(|n| !n.starts_with(DECODE))
    );
    assert!(
        fake.get(paths::DECODES, DECODE).is_none(),
        "finalizer removed once pods are gone"
    );
}

/// Negative control: a reconciler that ignores `deletionTimestamp` recreates what foreground
/// deletion removed, and the detector above catches it.
#[tokio::test]
async fn negative_control_reconciling_while_deleting_recreates_children() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client.clone());
    converge(&fake, &ctx).await;
    mark_deleting(&fake, paths::DECODES, DECODE);
    for c in child_collections() {
        for n in fake.names(c).into_iter().filter(|n| n.starts_with(DECODE)) {
            fake.remove(c, &n);
        }
    }
    let mut unsafe_ctx = Context::new(client, Metrics::new());
    unsafe_ctx.probe_reports = false;
    unsafe_ctx.unsafe_modes.reconcile_while_deleting = true;
    let unsafe_ctx = Arc::new(unsafe_ctx);
    fake.clear_calls();
    reconcile_decode(&unsafe_ctx).await;
    assert!(!child_creates_or_applies(&fake.calls()).is_empty());
}

#[tokio::test]
async fn a_hand_edited_group_is_restored_with_a_replica_drift_event() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client);
    converge(&fake, &ctx).await;
    fake.edit(paths::STS, "llama70b-decode-g0", |o| {
        o["spec"]["replicas"] = json!(3)
    });
    fake.clear_calls();
    reconcile_decode(&ctx).await;
    let writes = fake.writes();
    let applies: Vec<&Call> = writes.iter().filter(|c| c.is_apply()).collect();
    assert_eq!(applies.len(), 1, "{:?}", summary(&writes));
    assert_eq!(
        applies[0].path,
        format!("{}/llama70b-decode-g0", paths::STS)
    );
    assert_eq!(
        fake.get(paths::STS, "llama70b-decode-g0").unwrap()["spec"]["replicas"],
        json!(1)
    );
    let reasons = event_reasons(&writes);
    assert_eq!(reasons, vec!["ReplicaDrift".to_string()]);
    let ev = writes
        .iter()
        .find(|c| c.path.starts_with(paths::EVENTS))
        .unwrap();
    assert_eq!(ev.body.as_ref().unwrap()["type"], "Warning");
}

/// `restart.id` on the DecodePool rolls its PrefillPool first: the decode pool waits for its share
/// of Updated prefill groups of the new revision (sample stack P:D = 4:1: `required(0)` =
/// min(⌈4/1⌉, P−1) = 3, `rollout::PrefillGate`), then restarts one group.
#[tokio::test]
async fn a_restart_rolls_prefill_first_then_decode_one_group_at_a_time() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client);
    converge(&fake, &ctx).await;
    fake.edit(paths::DECODES, DECODE, |o| {
        o["spec"]["restart"]["id"] = json!("second");
        o["metadata"]["generation"] = json!(2);
    });
    fake.clear_calls();
    reconcile_decode(&ctx).await;
    let deleted_pods = |calls: &[Call]| -> Vec<String> {
        calls
            .iter()
            .filter(|c| c.method == "DELETE" && c.path.starts_with(paths::PODS))
            .map(|c| c.path.rsplit('/').next().unwrap().to_owned())
            .collect()
    };
    assert!(
        deleted_pods(&fake.calls()).is_empty(),
        "decode waits for prefill"
    );
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(d["status"]["rollout"]["phase"], "WaitingForPrefill");
    // The prefill reconcile writes the new templates; a pod deleted before the StatefulSet
    // controller has seen them would come back from the old one.
    reconcile_prefill(&ctx).await;
    assert!(
        deleted_pods(&fake.calls()).is_empty(),
        "no pod deleted before the StatefulSet controller observed the new template"
    );
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    assert_eq!(p["status"]["rollout"]["phase"], "WaitingForStatefulSet");
    fake.observe_statefulsets();
    reconcile_prefill(&ctx).await;
    assert_eq!(
        deleted_pods(&fake.calls()),
        vec!["llama70b-prefill-g0-0".to_string()]
    );
    reconcile_prefill(&ctx).await;
    assert_eq!(deleted_pods(&fake.calls()).len(), 1, "one group at a time");
    // Prefill g0, then g1 and g2, come back at the new revision, Ready: the decode pool waits
    // until the third.
    for updated in 1..=3 {
        fake.materialize_pods();
        fake.clear_calls();
        reconcile_decode(&ctx).await;
        if updated == 3 {
            break;
        }
        assert!(
            deleted_pods(&fake.calls()).is_empty(),
            "decode waits with {updated} Updated prefill group(s)"
        );
        let d = fake.get(paths::DECODES, DECODE).unwrap();
        assert_eq!(d["status"]["rollout"]["phase"], "WaitingForPrefill");
        let progressing = condition(&d, "Progressing");
        let message = progressing["message"].as_str().unwrap();
        assert!(
            message.ends_with(&format!(
                "needs 3 Updated prefill groups at the revision, {updated} present"
            )),
            "{message}"
        );
        fake.clear_calls();
        reconcile_prefill(&ctx).await;
        assert_eq!(
            deleted_pods(&fake.calls()),
            vec![format!("llama70b-prefill-g{updated}-0")]
        );
    }
    assert_eq!(
        deleted_pods(&fake.calls()),
        vec!["llama70b-decode-g0-0".to_string()]
    );
    let reasons = event_reasons(&fake.calls());
    assert!(
        reasons.contains(&"RollingRestart".to_string()),
        "{reasons:?}"
    );
}

/// A scale-up whose new pods stay unschedulable past the deadline is rolled back to the last
/// fully scheduled counts, with `InsufficientCapacity` and an event; the extra groups go.
/// The sample stack with `unschedulableDeadlineSeconds: deadline`, converged, then scaled from 1
/// to 2 decode groups (prefill 4 → 8) with the pods `pending` left unschedulable.
async fn scale_up_with_pending(deadline: i64, pending: &[String]) -> (FakeApi, Arc<Context>) {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    fake.edit(paths::DECODES, DECODE, |o| {
        // Admission needs ≥ 10 s; the fake has no admission.
        o["spec"]["unschedulableDeadlineSeconds"] = json!(deadline);
    });
    let ctx = context(client);
    converge(&fake, &ctx).await;
    fake.edit(paths::DECODES, DECODE, |o| {
        o["spec"]["replicas"] = json!(2);
        o["metadata"]["generation"] = json!(2);
    });
    reconcile_decode(&ctx).await; // step: decode 1 → 2, prefill 4 → 8
    reconcile_prefill(&ctx).await;
    fake.materialize_pods();
    for p in pending {
        fake.edit(paths::PODS, p, |o| {
            o["spec"]["nodeName"] = Value::Null;
            o["status"]["conditions"] = json!([
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]);
        });
    }
    (fake, ctx)
}

#[tokio::test]
async fn an_unschedulable_scale_up_is_rolled_back_with_insufficient_capacity() {
    // The test has no time to wait for a deadline: 0 s.
    let pending = [
        "llama70b-decode-g1-0".into(),
        "llama70b-prefill-g4-0".into(),
    ];
    let (fake, ctx) = scale_up_with_pending(0, &pending).await;
    fake.clear_calls();
    reconcile_decode(&ctx).await;
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(
        d["status"]["scaling"]["applied"],
        json!({"decode": 1, "prefill": 4})
    );
    let ic = condition(&d, "InsufficientCapacity");
    assert_eq!(
        (ic["status"].as_str(), ic["reason"].as_str()),
        (Some("True"), Some("Unschedulable"))
    );
    assert!(event_reasons(&fake.calls()).contains(&"InsufficientCapacity".to_string()));
    assert!(
        fake.get(paths::STS, "llama70b-decode-g1").is_none(),
        "the extra decode group is removed"
    );
    reconcile_prefill(&ctx).await;
    assert!(
        fake.get(paths::STS, "llama70b-prefill-g4").is_none(),
        "the extra prefill groups are removed"
    );
    // Scaling down still works while refused, and a new target is tried.
    fake.edit(paths::DECODES, DECODE, |o| o["spec"]["replicas"] = json!(0));
    reconcile_decode(&ctx).await;
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(
        d["status"]["scaling"]["applied"],
        json!({"decode": 0, "prefill": 0})
    );
}

/// A reconcile handed a DecodePool older than the operator's own last status write — the
/// reflector's copy, when a child's event triggers the reconcile before the watch delivers that
/// write — must not replay a finished scaling step. Before the fix it did: the stale status said
/// `applied: 1 decode / 4 prefill`, so the finished scale-up was stepped again and the new groups
/// were deleted and re-created (pods churned right after every `kubectl scale` in the demo).
async fn scale_up_then_reconcile_a_stale_copy(trust_cached_status: bool) -> Vec<String> {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let mut ctx = Context::new(client, Metrics::new());
    ctx.probe_reports = false;
    ctx.unsafe_modes.trust_cached_status = trust_cached_status;
    let ctx = Arc::new(ctx);
    converge(&fake, &ctx).await;
    fake.edit(paths::DECODES, DECODE, |o| {
        o["spec"]["replicas"] = json!(2);
        o["metadata"]["generation"] = json!(2);
    });
    let api: Api<DecodePool> = Api::namespaced(ctx.client.clone(), "default");
    let stale = api.get(DECODE).await.unwrap();
    converge(&fake, &ctx).await;
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(
        d["status"]["scaling"]["applied"],
        json!({"decode": 2, "prefill": 8}),
        "the scale-up finished"
    );
    fake.clear_calls();
    decode_pool::reconcile(Arc::new(stale), ctx.clone())
        .await
        .unwrap();
    reconcile_prefill(&ctx).await;
    summary(
        &fake
            .writes()
            .into_iter()
            .filter(|c| c.path.starts_with(paths::STS) && c.method == "DELETE")
            .collect::<Vec<_>>(),
    )
}

#[tokio::test]
async fn a_stale_copy_of_a_scaled_pool_never_deletes_its_new_groups() {
    let deletes = scale_up_then_reconcile_a_stale_copy(false).await;
    assert!(deletes.is_empty(), "{deletes:#?}");
}

#[tokio::test]
async fn negative_control_trusting_the_cached_status_deletes_new_groups() {
    let deletes = scale_up_then_reconcile_a_stale_copy(true).await;
    assert!(!deletes.is_empty(), "the stale step must show as deletes");
}

/// Two DecodePools naming one PrefillPool would run two ratio transactions on its groups: the
/// PrefillPool reports `PolicyConflict=True, MultipleDecodePools` (once, as an event too) and
/// changes no child until one of them points elsewhere.
#[tokio::test]
async fn two_decode_pools_on_one_prefill_pool_are_refused_with_a_reason() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client);
    converge(&fake, &ctx).await;
    let mut second = sample("decodepool.yaml");
    second["metadata"]["name"] = json!("llama70b-decode-b");
    fake.insert(paths::DECODES, second);
    fake.clear_calls();
    reconcile_prefill(&ctx).await;
    reconcile_prefill(&ctx).await;
    let calls = fake.calls();
    let prefill_children: Vec<String> = child_creates_or_applies(&calls)
        .into_iter()
        .filter(|c| c.contains("prefill"))
        .collect();
    assert_eq!(prefill_children, Vec::<String>::new());
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    let pc = condition(&p, "PolicyConflict");
    assert_eq!(
        (pc["status"].as_str(), pc["reason"].as_str()),
        (Some("True"), Some("MultipleDecodePools"))
    );
    assert!(
        pc["message"]
            .as_str()
            .unwrap()
            .contains("llama70b-decode-b"),
        "{pc}"
    );
    let reasons = event_reasons(&calls);
    assert_eq!(
        reasons
            .iter()
            .filter(|r| *r == "MultipleDecodePools")
            .count(),
        1,
        "{reasons:?}"
    );
    // The DecodePool says it too, rather than waiting forever for prefill groups.
    reconcile_decode(&ctx).await;
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    let dc = condition(&d, "PolicyConflict");
    assert_eq!(
        (dc["status"].as_str(), dc["reason"].as_str()),
        (Some("True"), Some("MultipleDecodePools")),
        "{dc}"
    );
    // Removing the second pairing lifts the conflict.
    fake.edit(paths::DECODES, "llama70b-decode-b", |o| {
        o["spec"]["prefill"]["poolRef"]["name"] = json!("another-prefill")
    });
    reconcile_prefill(&ctx).await;
    reconcile_decode(&ctx).await;
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert!(
        d["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["type"] == "PolicyConflict" && c["status"] == "False"),
        "{d}"
    );
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    let pc = condition(&p, "PolicyConflict");
    assert_eq!(pc["status"].as_str(), Some("False"), "{pc}");
}

fn prefill_writes(calls: &[Call]) -> Vec<String> {
    let writes: Vec<Call> = calls
        .iter()
        .filter(|c| c.is_write())
        .filter(|c| {
            (c.path.starts_with(paths::STS) || c.path.starts_with(paths::PODS))
                && c.path.contains(PREFILL)
        })
        .cloned()
        .collect();
    summary(&writes)
}

fn status_of(cond: &Value) -> (Option<&str>, Option<&str>) {
    (cond["status"].as_str(), cond["reason"].as_str())
}

/// Issue 19 item 3: while the scale-up's prefill groups are Pending, the DecodePool is neither
/// Ready nor Settled (its own decode groups all being Ready is not enough); after the rollback it
/// says what was admitted (`status.admittedReplicas`) and why.
#[tokio::test]
async fn a_pending_scale_up_is_progressing_and_a_rollback_says_what_was_admitted() {
    // Every new prefill group Pending; the new decode group scheduled and Ready.
    let pending_prefill: Vec<String> = (4..8).map(|g| format!("{PREFILL}-g{g}-0")).collect();
    let (fake, ctx) = scale_up_with_pending(3600, &pending_prefill).await;
    reconcile_decode(&ctx).await;
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(
        d["status"]["readyReplicas"],
        json!(2),
        "both decode groups Ready"
    );
    let ready = condition(&d, "Ready");
    assert_eq!(
        status_of(&ready),
        (Some("False"), Some("GroupsNotReady")),
        "{ready}"
    );
    assert!(
        ready["message"].as_str().unwrap().contains("4/8"),
        "{ready}"
    );
    let progressing = condition(&d, "Progressing");
    assert_eq!(
        status_of(&progressing),
        (Some("True"), Some("ScaleUpPending")),
        "{progressing}"
    );
    assert_eq!(
        status_of(&condition(&d, "InsufficientCapacity")),
        (Some("False"), Some("ScaleUpPending"))
    );
    assert_eq!(d["status"]["admittedReplicas"], json!(2));

    // Past the deadline: rolled back to 1 / 4; the extra groups and their pods go.
    fake.edit(paths::DECODES, DECODE, |o| {
        o["spec"]["unschedulableDeadlineSeconds"] = json!(0);
    });
    reconcile_decode(&ctx).await;
    reconcile_prefill(&ctx).await;
    for p in pending_prefill.iter().chain([&format!("{DECODE}-g1-0")]) {
        fake.remove(paths::PODS, p);
    }
    reconcile_decode(&ctx).await;
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(d["spec"]["replicas"], json!(2));
    assert_eq!(d["status"]["admittedReplicas"], json!(1));
    let ready = condition(&d, "Ready");
    assert_eq!(status_of(&ready), (Some("True"), Some("AllGroupsReady")));
    assert!(
        ready["message"]
            .as_str()
            .unwrap()
            .contains("1 of 2 decode groups admitted"),
        "{ready}"
    );
    let progressing = condition(&d, "Progressing");
    assert_eq!(
        status_of(&progressing),
        (Some("False"), Some("CapacityLimited")),
        "{progressing}"
    );
    let msg = progressing["message"].as_str().unwrap();
    assert!(
        msg.contains("decode 1 / prefill 4") && msg.contains("decode 2 / prefill 8"),
        "{msg}"
    );
    assert_eq!(
        status_of(&condition(&d, "InsufficientCapacity")),
        (Some("True"), Some("Unschedulable"))
    );
}

/// Issue 19 item 4: a PrefillPool whose count the ratio owns says that `spec.replicas` (and so an
/// autoscaler on `/scale`) is ignored — a condition, and one event — and `/scale`'s status
/// (`status.replicas`) reports the groups that exist.
#[tokio::test]
async fn a_ratio_owned_prefill_pool_says_spec_replicas_is_ignored() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client);
    reconcile_tier(&ctx).await;
    reconcile_decode(&ctx).await;
    reconcile_prefill(&ctx).await;
    reconcile_prefill(&ctx).await;
    let ignored_events = |calls: &[Call]| {
        event_reasons(calls)
            .iter()
            .filter(|r| *r == "ReplicasIgnored")
            .count()
    };
    assert_eq!(
        ignored_events(&fake.calls()),
        1,
        "one event, not one per reconcile"
    );
    converge(&fake, &ctx).await;
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    let ri = condition(&p, "ReplicasIgnored");
    assert_eq!(
        status_of(&ri),
        (Some("True"), Some("DecodePoolRatio")),
        "{ri}"
    );

    // `kubectl scale prefillpool --replicas=6`, or an HPA on /scale: nothing moves, status says so.
    fake.edit(paths::PREFILLS, PREFILL, |o| {
        o["spec"]["replicas"] = json!(6);
        o["metadata"]["generation"] = json!(2);
    });
    fake.clear_calls();
    reconcile_prefill(&ctx).await;
    assert_eq!(prefill_writes(&fake.calls()), Vec::<String>::new());
    assert_eq!(ignored_events(&fake.calls()), 0, "still the same decision");
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    let ri = condition(&p, "ReplicasIgnored");
    let msg = ri["message"].as_str().unwrap();
    assert!(
        msg.contains("spec.replicas (6)") && msg.contains("/scale") && msg.contains(DECODE),
        "{msg}"
    );
    assert_eq!(
        p["status"]["replicas"],
        json!(4),
        "/scale reports what runs"
    );
    assert_eq!(p["status"]["desiredReplicas"], json!(4));

    // An unpaired pool's count is its spec.
    let mut lone = sample("prefillpool.yaml");
    lone["metadata"]["name"] = json!("lone-prefill");
    fake.insert(paths::PREFILLS, lone);
    let api: Api<PrefillPool> = Api::namespaced(ctx.client.clone(), "default");
    let lone = api.get("lone-prefill").await.unwrap();
    prefill_pool::reconcile(Arc::new(lone), ctx.clone())
        .await
        .unwrap();
    let l = fake.get(paths::PREFILLS, "lone-prefill").unwrap();
    assert_eq!(
        status_of(&condition(&l, "ReplicasIgnored")),
        (Some("False"), Some("SpecReplicas"))
    );
}

/// Issue 19 item 5: deleting the DecodePool releases its PrefillPool, which keeps the count and
/// revision the ratio last set — no scale to its own `spec.replicas`, no rolling restart — until
/// its own spec changes.
#[tokio::test]
async fn a_released_prefill_pool_keeps_its_count_and_revision_until_its_spec_changes() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client);
    converge(&fake, &ctx).await;
    // An HPA (or `kubectl scale`) set spec.replicas while the ratio owned the count.
    fake.edit(paths::PREFILLS, PREFILL, |o| {
        o["spec"]["replicas"] = json!(6);
        o["metadata"]["generation"] = json!(2);
    });
    reconcile_prefill(&ctx).await;
    let before = fake.get(paths::PREFILLS, PREFILL).unwrap();
    let revision = before["status"]["updateRevision"].clone();
    assert_eq!(before["status"]["desiredReplicas"], json!(4));

    // Teardown of the DecodePool alone.
    mark_deleting(&fake, paths::DECODES, DECODE);
    for _ in 0..4 {
        reconcile_decode(&ctx).await;
        reconcile_prefill(&ctx).await; // it follows the draining DecodePool meanwhile
        fake.materialize_pods();
    }
    assert!(fake.get(paths::DECODES, DECODE).is_none(), "released");

    fake.clear_calls();
    reconcile_prefill(&ctx).await;
    reconcile_prefill(&ctx).await;
    assert_eq!(
        prefill_writes(&fake.calls()),
        Vec::<String>::new(),
        "the release alone scales and restarts nothing"
    );
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    assert_eq!(p["status"]["desiredReplicas"], json!(4));
    assert_eq!(p["status"]["updateRevision"], revision);
    assert_eq!(
        p["status"]["replicasOwner"],
        json!("held from DecodePool/llama70b-decode ratio 4:1")
    );
    let ri = condition(&p, "ReplicasIgnored");
    assert_eq!(
        status_of(&ri),
        (Some("True"), Some("ReleasedByDecodePool")),
        "{ri}"
    );
    assert!(
        ri["message"]
            .as_str()
            .unwrap()
            .contains("until its own spec changes"),
        "{ri}"
    );

    // The user changes the pool's own spec: now spec.replicas and its own revision apply.
    fake.edit(paths::PREFILLS, PREFILL, |o| {
        o["spec"]["replicas"] = json!(3);
        o["metadata"]["generation"] = json!(3);
    });
    reconcile_prefill(&ctx).await;
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    assert_eq!(p["status"]["desiredReplicas"], json!(3));
    assert_ne!(p["status"]["updateRevision"], revision);
    assert_eq!(p["status"]["replicasOwner"], json!("spec.replicas"));
    assert_eq!(
        status_of(&condition(&p, "ReplicasIgnored")),
        (Some("False"), Some("SpecReplicas"))
    );
    assert!(fake.get(paths::STS, &format!("{PREFILL}-g3")).is_none());
}

/// Issue 14: every engine kind rolls out. A converged stack whose DecodePool switches to vLLM
/// rolls its decode group to `vllm serve` with the Tandem tier's KV transfer config, the worker as
/// the engine's native sidecar, and the front-door Service to the engine's own API port; the
/// PrefillPool switching to SGLang rolls its group to `sglang.launch_server` with Tandem's HiCache
/// backend; neither pool is Degraded.
#[tokio::test]
async fn sglang_and_vllm_engines_roll_out_with_the_adapters_flags() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client);
    converge(&fake, &ctx).await;
    fake.edit(paths::DECODES, DECODE, |o| {
        // What admission refuses beside a real engine (CEL, crds/tests/cel_rules.rs) goes.
        if let Some(spec) = o["spec"].as_object_mut() {
            spec.remove("speculative");
        }
        if let Some(p) = o["spec"]["prefill"].as_object_mut() {
            p.remove("kvDeadline");
        }
        o["spec"]["engine"] = json!({"kind": "vLLM", "image": "vllm/vllm-openai:v0.33.0",
            "args": ["meta-llama/Llama-3.1-70B-Instruct"]});
        o["metadata"]["generation"] = json!(2);
    });
    fake.edit(paths::PREFILLS, PREFILL, |o| {
        o["spec"]["engine"] = json!({"kind": "SGLang", "image": "lmsysorg/sglang:v0.5.23",
            "args": ["--model-path", "meta-llama/Llama-3.1-70B-Instruct"]});
        o["metadata"]["generation"] = json!(2);
    });
    let container = |sts: &Value, key: &str, name: &str| -> Option<Value> {
        sts["spec"]["template"]["spec"][key]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["name"] == name)
            .cloned()
    };
    let words = |c: &Value, key: &str| -> Vec<String> {
        c[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|w| w.as_str().unwrap_or_default().to_owned())
            .collect()
    };
    let mut rolled = (false, false);
    for _ in 0..60 {
        round(&ctx).await;
        fake.materialize_pods();
        let d = fake.get(paths::STS, &format!("{DECODE}-g0")).unwrap();
        let p = fake.get(paths::STS, &format!("{PREFILL}-g0")).unwrap();
        let engine = |sts: &Value, cmd: &[&str]| {
            container(sts, "containers", "engine").is_some_and(|c| words(&c, "command") == cmd)
        };
        rolled = (
            engine(&d, &["vllm", "serve"]),
            engine(&p, &["python3", "-m", "sglang.launch_server"]),
        );
        if rolled == (true, true) {
            break;
        }
    }
    assert_eq!(
        rolled,
        (true, true),
        "(decode vLLM, prefill SGLang) rolled out"
    );

    let d = fake.get(paths::STS, &format!("{DECODE}-g0")).unwrap();
    let e = container(&d, "containers", "engine").unwrap();
    let args = words(&e, "args");
    let i = args
        .iter()
        .position(|a| a == "--kv-transfer-config")
        .unwrap();
    let transfer: Value = serde_json::from_str(&args[i + 1]).unwrap();
    let tier = &transfer["kv_connector_extra_config"]["secondary_tiers"][0];
    assert_eq!(tier["type"], "TandemSecondaryTier");
    assert_eq!(tier["socket_dir"], "/run/tandem/engine");
    assert_eq!(tier["model"]["name"], "llama-3-70b", "{tier}");
    assert_eq!(
        args.first().map(String::as_str),
        Some("meta-llama/Llama-3.1-70B-Instruct"),
        "the user's args come first (vllm serve <model>)"
    );
    assert_eq!(e["resources"]["limits"]["nvidia.com/gpu"], "1", "{e}");
    let worker = container(&d, "initContainers", "worker").unwrap();
    assert_eq!(
        worker["restartPolicy"], "Always",
        "the worker is the engine's native sidecar"
    );
    assert!(
        worker["resources"]["limits"]
            .get("nvidia.com/gpu")
            .is_none(),
        "the engine holds the pod's GPU: {worker}"
    );
    let svc = fake.get(paths::SVC, DECODE).unwrap();
    assert_eq!(
        svc["spec"]["ports"][0]["targetPort"], 8100,
        "the front door reaches vLLM's own API: {svc}"
    );

    let p = fake.get(paths::STS, &format!("{PREFILL}-g0")).unwrap();
    let args = words(&container(&p, "containers", "engine").unwrap(), "args");
    let i = args
        .iter()
        .position(|a| a == "--hicache-storage-backend-extra-config")
        .unwrap();
    let extra: Value = serde_json::from_str(&args[i + 1]).unwrap();
    assert_eq!(extra["module_path"], "tandem_kv.sglang");
    assert_eq!(extra["class_name"], "TandemHiCacheStorage");
    for pool in [
        fake.get(paths::DECODES, DECODE).unwrap(),
        fake.get(paths::PREFILLS, PREFILL).unwrap(),
    ] {
        assert_eq!(
            status_of(&condition(&pool, "Degraded")).0,
            Some("False"),
            "{pool}"
        );
    }
}

/// Marks every container of pod `name` as restarted `count` times in place (what a kubelet
/// reports after a crash).
fn restarted(fake: &FakeApi, name: &str, count: i64) {
    fake.edit(paths::PODS, name, |o| {
        o["status"]["containerStatuses"] = json!([{
            "name": "worker", "image": "w", "imageID": "w", "ready": false,
            "restartCount": count
        }]);
    });
}

fn deleted_pods(calls: &[Call]) -> Vec<String> {
    calls
        .iter()
        .filter(|c| c.method == "DELETE" && c.path.starts_with(paths::PODS))
        .map(|c| c.path.rsplit('/').next().unwrap().to_owned())
        .collect()
}

/// Issue 17 (bounded group recovery, kubernetes-sigs/lws KEP-820): a rank of a two-pod prefill
/// group restarts → the operator restarts the whole group (both pods deleted, counted in
/// `status.groupRestarts`, a `GroupRestarted` event); with `maxGroupRestarts: 1` spent, the next
/// failure halts the group — its StatefulSet held at 0 pods, `Degraded=True,
/// ReplicaRestartBudgetExceeded`, one event — and the halted pool then resyncs with zero writes.
#[tokio::test]
async fn a_failing_rank_restarts_its_group_whole_then_the_budget_halts_it() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    fake.edit(paths::PREFILLS, PREFILL, |o| {
        o["spec"]["parallelism"]["tensor"] = json!(2);
        o["spec"]["maxGroupRestarts"] = json!(1);
    });
    let ctx = context(client);
    converge(&fake, &ctx).await;
    let g0 = format!("{PREFILL}-g0");
    let pods = [format!("{g0}-0"), format!("{g0}-1")];
    assert!(fake.get(paths::PODS, &pods[1]).is_some());

    // First failure: the group restarts whole.
    restarted(&fake, &pods[1], 1);
    fake.clear_calls();
    reconcile_prefill(&ctx).await;
    assert_eq!(deleted_pods(&fake.calls()), pods.to_vec());
    assert_eq!(
        event_reasons(&fake.calls()),
        vec!["GroupRestarted".to_string()]
    );
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    assert_eq!(p["status"]["groupRestarts"][0]["restarts"], json!(1), "{p}");
    assert_eq!(p["status"]["groupRestarts"][0]["halted"], json!(false));
    assert_eq!(status_of(&condition(&p, "Degraded")).0, Some("False"));

    // The group comes back clean: nothing more to do.
    fake.materialize_pods();
    fake.clear_calls();
    reconcile_prefill(&ctx).await;
    assert!(deleted_pods(&fake.calls()).is_empty());

    // Second failure with the budget (1) spent: halted, never deleted by hand again.
    restarted(&fake, &pods[0], 1);
    fake.clear_calls();
    reconcile_prefill(&ctx).await;
    let calls = fake.calls();
    assert!(deleted_pods(&calls).is_empty(), "{:?}", summary(&calls));
    assert_eq!(
        fake.get(paths::STS, &g0).unwrap()["spec"]["replicas"],
        json!(0),
        "the halted group's StatefulSet holds no pod (GPUs released)"
    );
    assert_eq!(
        event_reasons(&calls),
        vec![
            "Updated".to_string(),
            "ReplicaRestartBudgetExceeded".to_string()
        ]
    );
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    let degraded = condition(&p, "Degraded");
    assert_eq!(
        status_of(&degraded),
        (Some("True"), Some("ReplicaRestartBudgetExceeded")),
        "{degraded}"
    );
    assert!(
        degraded["message"]
            .as_str()
            .unwrap()
            .contains("group(s) 0 kept failing past maxGroupRestarts 1"),
        "{degraded}"
    );
    assert_eq!(p["status"]["groupRestarts"][0]["halted"], json!(true));

    // Halted is a steady state: the pods go, and a resync writes nothing and raises no event.
    fake.materialize_pods();
    assert!(fake.get(paths::PODS, &pods[0]).is_none());
    reconcile_prefill(&ctx).await;
    fake.clear_calls();
    reconcile_prefill(&ctx).await;
    assert_eq!(summary(&fake.writes()), Vec::<String>::new());
}

/// A one-pod decode group is restarted in place by the kubelet, never by the operator; past
/// `maxGroupRestarts` it is halted. A new revision (`restart.id`) starts the count again and
/// brings the group back.
#[tokio::test]
async fn a_crash_looping_pod_is_halted_past_its_budget_and_a_new_revision_brings_it_back() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    fake.edit(paths::DECODES, DECODE, |o| {
        o["spec"]["maxGroupRestarts"] = json!(2);
    });
    let ctx = context(client);
    converge(&fake, &ctx).await;
    let g0 = format!("{DECODE}-g0");
    let pod = format!("{g0}-0");

    restarted(&fake, &pod, 2);
    fake.clear_calls();
    reconcile_decode(&ctx).await;
    assert!(deleted_pods(&fake.calls()).is_empty());
    assert_eq!(
        fake.get(paths::STS, &g0).unwrap()["spec"]["replicas"],
        json!(1)
    );
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(d["status"]["groupRestarts"][0]["restarts"], json!(2), "{d}");
    assert_eq!(status_of(&condition(&d, "Degraded")).0, Some("False"));

    restarted(&fake, &pod, 3);
    fake.clear_calls();
    reconcile_decode(&ctx).await;
    assert!(deleted_pods(&fake.calls()).is_empty());
    assert_eq!(
        fake.get(paths::STS, &g0).unwrap()["spec"]["replicas"],
        json!(0)
    );
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(
        status_of(&condition(&d, "Degraded")),
        (Some("True"), Some("ReplicaRestartBudgetExceeded"))
    );

    fake.materialize_pods();
    fake.edit(paths::DECODES, DECODE, |o| {
        o["spec"]["restart"]["id"] = json!("fixed");
        o["metadata"]["generation"] = json!(2);
    });
    reconcile_decode(&ctx).await;
    assert_eq!(
        fake.get(paths::STS, &g0).unwrap()["spec"]["replicas"],
        json!(1),
        "a new revision brings the halted group back"
    );
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(d["status"].get("groupRestarts"), None, "{d}");
    assert_eq!(status_of(&condition(&d, "Degraded")).0, Some("False"));
}

/// The `pods/status` writes among `calls` (the gang gate), as `pod condition-status reason`.
fn gate_writes(calls: &[Call]) -> Vec<String> {
    calls
        .iter()
        .filter(|c| c.method == "PATCH" && c.path.starts_with(paths::PODS))
        .filter(|c| c.path.ends_with("/status"))
        .map(|c| {
            let pod = c.path[paths::PODS.len() + 1..].trim_end_matches("/status");
            let cond = &c.body.as_ref().unwrap()["status"]["conditions"][0];
            assert_eq!(cond["type"], "serving.tandem.dev/group-ready", "{cond}");
            assert_eq!(
                c.content_type.as_deref(),
                Some("application/strategic-merge-patch+json"),
                "conditions must merge by type"
            );
            format!(
                "{pod} {} {}",
                cond["status"].as_str().unwrap(),
                cond["reason"].as_str().unwrap()
            )
        })
        .collect()
}

fn pod_condition(fake: &FakeApi, pod: &str, type_: &str) -> Option<String> {
    let p = fake.get(paths::PODS, pod)?;
    p["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .and_then(|c| c["status"].as_str().map(str::to_owned))
}

/// The kubelet's side of a rank going (un)ready: `ContainersReady`, then `Ready` from it and the
/// readiness gates.
fn set_containers_ready(fake: &FakeApi, pod: &str, ready: bool) {
    fake.edit(paths::PODS, pod, |p| {
        let status = if ready { "True" } else { "False" };
        support::set_condition(p, json!({"type": "ContainersReady", "status": status}));
        support::kubelet_ready(p);
    });
}

/// Issue 17: a decode group of two pods (tensor 2) carries the group-ready readiness gate; the
/// operator opens it on both pods once both are `ContainersReady`, closes it on both when one
/// rank drops (so neither is `Ready`, and the pool's `Ready` turns False), reopens it when the
/// rank is back, and a steady resync writes nothing. Single-pod prefill groups carry no gate.
#[tokio::test]
async fn a_two_pod_group_is_ready_only_whole_through_its_readiness_gate() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    fake.edit(paths::DECODES, DECODE, |d| {
        d["spec"]["parallelism"]["tensor"] = json!(2);
    });
    let ctx = context(client);
    converge(&fake, &ctx).await;
    let gate = "serving.tandem.dev/group-ready";
    let ranks = [format!("{DECODE}-g0-0"), format!("{DECODE}-g0-1")];
    let sts = fake.get(paths::STS, &format!("{DECODE}-g0")).unwrap();
    assert_eq!(
        sts["spec"]["template"]["spec"]["readinessGates"],
        json!([{"conditionType": gate}])
    );
    let psts = fake.get(paths::STS, &format!("{PREFILL}-g0")).unwrap();
    assert!(
        psts["spec"]["template"]["spec"]["readinessGates"].is_null(),
        "single-pod groups carry no gate"
    );
    for r in &ranks {
        assert_eq!(
            pod_condition(&fake, r, gate).as_deref(),
            Some("True"),
            "{r}"
        );
        assert_eq!(
            pod_condition(&fake, r, "Ready").as_deref(),
            Some("True"),
            "{r}"
        );
    }
    assert_eq!(pod_condition(&fake, &format!("{PREFILL}-g0-0"), gate), None);
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(condition(&d, "Ready")["status"], "True");

    // Steady state: no write.
    fake.clear_calls();
    round(&ctx).await;
    assert_eq!(summary(&fake.writes()), Vec::<String>::new());

    // Rank 1 drops: the gate closes on both, so neither is Ready.
    set_containers_ready(&fake, &ranks[1], false);
    assert_eq!(
        pod_condition(&fake, &ranks[0], "Ready").as_deref(),
        Some("True"),
        "rank 0 alone still looks Ready before the operator acts"
    );
    fake.clear_calls();
    round(&ctx).await;
    assert_eq!(
        gate_writes(&fake.calls()),
        vec![
            format!("{} False GroupMemberNotReady", ranks[0]),
            format!("{} False GroupMemberNotReady", ranks[1]),
        ]
    );
    for r in &ranks {
        assert_eq!(
            pod_condition(&fake, r, gate).as_deref(),
            Some("False"),
            "{r}"
        );
        assert_eq!(
            pod_condition(&fake, r, "Ready").as_deref(),
            Some("False"),
            "{r}"
        );
        // The kubelet's own conditions are untouched by the merge.
        assert!(pod_condition(&fake, r, "PodScheduled").is_some(), "{r}");
    }
    let msg = fake.get(paths::PODS, &ranks[0]).unwrap()["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == gate)
        .unwrap()["message"]
        .clone();
    assert!(
        msg.as_str()
            .unwrap()
            .contains(&format!("not ready: {}", ranks[1])),
        "{msg}"
    );
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(condition(&d, "Ready")["status"], "False");
    fake.clear_calls();
    round(&ctx).await;
    assert_eq!(gate_writes(&fake.calls()), Vec::<String>::new());

    // Rank 1 is back: the gate reopens on both.
    set_containers_ready(&fake, &ranks[1], true);
    fake.clear_calls();
    round(&ctx).await;
    assert_eq!(
        gate_writes(&fake.calls()),
        vec![
            format!("{} True GroupReady", ranks[0]),
            format!("{} True GroupReady", ranks[1]),
        ]
    );
    converge(&fake, &ctx).await;
    for r in &ranks {
        assert_eq!(
            pod_condition(&fake, r, "Ready").as_deref(),
            Some("True"),
            "{r}"
        );
    }
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(condition(&d, "Ready")["status"], "True");
    fake.clear_calls();
    round(&ctx).await;
    assert_eq!(summary(&fake.writes()), Vec::<String>::new());

    // A rolling restart of the group goes through the gate (the rollout waits for Ready, which
    // now needs the gate): the new pods open it once both are ContainersReady, and it completes.
    let revision = |pod: &str| {
        fake.get(paths::PODS, pod).unwrap()["metadata"]["labels"]["serving.tandem.dev/revision"]
            .clone()
    };
    let old = revision(&ranks[0]);
    fake.edit(paths::DECODES, DECODE, |o| {
        o["spec"]["restart"]["id"] = json!("second");
        o["metadata"]["generation"] = json!(2);
    });
    let mut settled = false;
    for _ in 0..24 {
        fake.clear_calls();
        round(&ctx).await;
        fake.materialize_pods();
        if fake.writes().is_empty() {
            settled = true;
            break;
        }
    }
    assert!(settled, "{:#?}", summary(&fake.writes()));
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(d["status"]["rollout"]["phase"], "Idle");
    assert_eq!(condition(&d, "Ready")["status"], "True");
    for r in &ranks {
        assert_ne!(revision(r), old, "{r} restarted");
        assert_eq!(revision(r), d["status"]["updateRevision"], "{r}");
        assert_eq!(
            pod_condition(&fake, r, gate).as_deref(),
            Some("True"),
            "{r}"
        );
        assert_eq!(
            pod_condition(&fake, r, "Ready").as_deref(),
            Some("True"),
            "{r}"
        );
    }
}

/// A refused pool (here a tier that contradicts the model: `PolicyConflict`) touches no child,
/// but its running two-pod group keeps gang readiness: a rank dropping still closes the gate on
/// both pods.
#[tokio::test]
async fn a_refused_pool_still_closes_the_gate_of_a_partial_group() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    fake.edit(paths::DECODES, DECODE, |d| {
        d["spec"]["parallelism"]["tensor"] = json!(2);
    });
    let ctx = context(client);
    converge(&fake, &ctx).await;
    fake.edit(paths::TIERS, TIER, |t| {
        t["spec"]["model"]["headDim"] = json!(64);
    });
    let ranks = [format!("{DECODE}-g0-0"), format!("{DECODE}-g0-1")];
    set_containers_ready(&fake, &ranks[0], false);
    fake.clear_calls();
    reconcile_decode(&ctx).await;
    let calls = fake.calls();
    let d = fake.get(paths::DECODES, DECODE).unwrap();
    assert_eq!(condition(&d, "PolicyConflict")["status"], "True");
    assert_eq!(child_creates_or_applies(&calls), Vec::<String>::new());
    assert_eq!(
        gate_writes(&calls),
        vec![
            format!("{} False GroupMemberNotReady", ranks[0]),
            format!("{} False GroupMemberNotReady", ranks[1]),
        ]
    );
    assert_eq!(
        pod_condition(&fake, &ranks[1], "Ready").as_deref(),
        Some("False")
    );
}

/// A store holding `items` as a watch's first list would, trimmed as the operator's caches trim
/// them (a reconcile reading a trimmed field would then decide differently here).
fn store_of<K>(items: Vec<Value>) -> Store<K>
where
    K: kube::Resource<DynamicType = ()> + Trim + Clone + serde::de::DeserializeOwned + 'static,
{
    let (store, mut writer) = reflector::store::<K>();
    writer.apply_watcher_event(&watcher::Event::Init);
    for o in items {
        let mut obj: K = serde_json::from_value(o).unwrap();
        obj.trim();
        writer.apply_watcher_event(&watcher::Event::InitApply(obj));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    store
}

/// The fake's objects of a collection.
fn all(fake: &FakeApi, collection: &str) -> Vec<Value> {
    fake.names(collection)
        .iter()
        .filter_map(|n| fake.get(collection, n))
        .collect()
}

/// Hands `ctx` caches holding the fake's objects now, with `pods` instead of the fake's pods when
/// given (a pod watch lagging behind).
fn set_cache(fake: &FakeApi, ctx: &Context, pods: Option<Vec<Value>>) {
    let caches = Caches {
        statefulsets: store_of(all(fake, paths::STS)),
        services: store_of(all(fake, paths::SVC)),
        config_maps: store_of(all(fake, paths::CM)),
        pods: store_of(pods.unwrap_or_else(|| all(fake, paths::PODS))),
        tiers: store_of(all(fake, paths::TIERS)),
        prefills: store_of(all(fake, paths::PREFILLS)),
        decodes: store_of(all(fake, paths::DECODES)),
    };
    *ctx.caches.write().unwrap() = Some(caches);
}

/// Reads (GET) other than of `own` (a reconcile's fresh read of its own object, and the test
/// helper's read that hands it the object): children's LISTs, tiers, the pair.
fn reads_besides_own(calls: &[Call], own: &str) -> Vec<String> {
    calls
        .iter()
        .filter(|c| c.method == "GET" && c.path != own)
        .map(|c| c.path.clone())
        .collect()
}

/// Issue 17 (reconcile latency flat in N): with the caches, a steady resync of each kind reads
/// only its own object from the API server (before: four LISTs of its children, the tiers, the
/// pair, a LIST of DecodePools; the DecodePool four more LISTs of its PrefillPool's children)
/// and still writes nothing.
#[tokio::test]
async fn with_the_caches_a_steady_resync_reads_only_its_own_object_and_writes_nothing() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    let ctx = context(client);
    converge(&fake, &ctx).await;
    let own = [
        format!("{}/{TIER}", paths::TIERS),
        format!("{}/{PREFILL}", paths::PREFILLS),
        format!("{}/{DECODE}", paths::DECODES),
    ];
    let reconcile = |i: usize| {
        let ctx = ctx.clone();
        async move {
            match i {
                0 => reconcile_tier(&ctx).await,
                1 => reconcile_prefill(&ctx).await,
                _ => reconcile_decode(&ctx).await,
            }
        }
    };
    let mut without = 0;
    for (i, own) in own.iter().enumerate() {
        fake.clear_calls();
        reconcile(i).await;
        without += reads_besides_own(&fake.calls(), own).len();
    }
    assert!(
        without >= 20,
        "without caches a round reads more: {without}"
    );

    set_cache(&fake, &ctx, None);
    for (i, own) in own.iter().enumerate() {
        fake.clear_calls();
        reconcile(i).await;
        assert_eq!(
            reads_besides_own(&fake.calls(), own),
            Vec::<String>::new(),
            "{own}"
        );
        assert_eq!(summary(&fake.writes()), Vec::<String>::new(), "{own}");
    }
}

/// Restarts a two-pod prefill group once (a rank's container restarted) and returns the pods as
/// they were at that decision, a stale cache's view after the group came back.
async fn restart_once(fake: &FakeApi, ctx: &Arc<Context>) -> (Vec<Value>, [String; 2]) {
    converge(fake, ctx).await;
    let g0 = format!("{PREFILL}-g0");
    let pods = [format!("{g0}-0"), format!("{g0}-1")];
    restarted(fake, &pods[1], 1);
    let stale = all(fake, paths::PODS);
    fake.clear_calls();
    reconcile_prefill(ctx).await;
    assert_eq!(deleted_pods(&fake.calls()), pods.to_vec());
    fake.materialize_pods();
    (stale, pods)
}

/// A reconcile that sees, in a lagging pod cache, the restarted rank that already made its group
/// restart decides the same restart again — and confirms it on pods listed now, which are the
/// group's new, clean pods: it deletes nothing, raises no event, and the restart stays counted
/// once. (The pods of a StatefulSet keep their names: acting on the stale copy would delete the
/// freshly recreated namesakes.)
#[tokio::test]
async fn a_stale_pod_cache_never_restarts_a_group_twice() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    fake.edit(paths::PREFILLS, PREFILL, |o| {
        o["spec"]["parallelism"]["tensor"] = json!(2);
    });
    let ctx = context(client);
    let (stale, _) = restart_once(&fake, &ctx).await;

    set_cache(&fake, &ctx, Some(stale));
    fake.clear_calls();
    reconcile_prefill(&ctx).await;
    let calls = fake.calls();
    assert_eq!(deleted_pods(&calls), Vec::<String>::new());
    assert_eq!(event_reasons(&calls), Vec::<String>::new());
    assert!(
        calls
            .iter()
            .any(|c| c.method == "GET" && c.path == paths::PODS),
        "the delete was confirmed on listed pods"
    );
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    assert_eq!(p["status"]["groupRestarts"][0]["restarts"], json!(1), "{p}");
    assert_eq!(
        ctx.metrics
            .fresh_reads
            .get_or_create(&tandem_operator::metrics::KindLabels {
                kind: "PrefillPool".into()
            })
            .get(),
        1
    );
}

/// Negative control: acting on the cached pods' word deletes the group's new pods and counts a
/// second restart that never happened.
#[tokio::test]
async fn negative_control_acting_on_a_stale_pod_cache_restarts_the_group_twice() {
    let (fake, client) = FakeApi::start();
    seed(&fake);
    fake.edit(paths::PREFILLS, PREFILL, |o| {
        o["spec"]["parallelism"]["tensor"] = json!(2);
    });
    let mut ctx = Context::new(client, Metrics::new());
    ctx.probe_reports = false;
    ctx.unsafe_modes.act_on_cached_children = true;
    let ctx = Arc::new(ctx);
    let (stale, pods) = restart_once(&fake, &ctx).await;

    set_cache(&fake, &ctx, Some(stale));
    fake.clear_calls();
    reconcile_prefill(&ctx).await;
    let calls = fake.calls();
    assert_eq!(deleted_pods(&calls), pods.to_vec());
    let p = fake.get(paths::PREFILLS, PREFILL).unwrap();
    assert_eq!(p["status"]["groupRestarts"][0]["restarts"], json!(2), "{p}");
}
