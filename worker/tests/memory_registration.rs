//! Transactional registration (DESIGN contracts 1 and 2; seed 000; reference/dataplane.md TC-REG-*).
//!
//! Every test injects faults at the external calls (allocate, free, register, unregister) through
//! `FaultInjector` and checks the invariants: no partial state visible, undo in reverse order, the pool
//! destroyed exactly once, nothing leaked.

use std::path::PathBuf;
use std::sync::Arc;

use tandem_worker::health::Health;
use tandem_worker::memory::capacity::{CapacityError, CapacityPlan};
use tandem_worker::memory::mmap::MmapBackend;
use tandem_worker::memory::pool::{PoolLayout, PoolRole, PoolSpec};
use tandem_worker::memory::segment::SegmentBackend;
use tandem_worker::memory::{Allocator, AllocatorDomain};
use tandem_worker::model::{Attention, ModelIdentity};
use tandem_worker::registration::fault::{Call, FaultInjector, FaultPlan, FaultyClient};
use tandem_worker::registration::metrics::RegistrationMetrics;
use tandem_worker::registration::registry::{DeregisterError, RegisterError};
use tandem_worker::registration::txn::FailureCause;
use tandem_worker::registration::{
    AttachOutcome, FailurePolicy, Phase, Registrar, RegistrarConfig, TxnOrder, TxnState,
};
use tandem_worker::store_client::embedded::EmbeddedClient;
use tandem_worker::store_client::server::{ServerConfig, StoreClientServer};
use tandem_worker::store_client::standalone::StandaloneClient;
use tandem_worker::store_client::{BufferRef, ClientMode, StoreClient, StoreError};

const PAGE: usize = 4096;

fn model(name: &str, layers: u32) -> ModelIdentity {
    ModelIdentity {
        name: name.into(),
        layers,
        attention: Attention::Gqa {
            kv_heads: 1,
            head_dim: 64,
        },
        dtype_bytes: 2,
        row_extra_bytes: 0,
    }
}

/// 256 B per token per layer × 16 tokens = one 4 KiB chunk; `pages × layers` chunks.
fn spec(role: PoolRole, pages: u32) -> PoolSpec {
    PoolSpec {
        role,
        model: model(
            if role == PoolRole::Draft {
                "draft"
            } else {
                "target"
            },
            4,
        ),
        page_tokens: 16,
        pages,
        layout: PoolLayout::LayerFirst,
    }
}

struct Rig {
    inner: Arc<EmbeddedClient>,
    faults: Arc<FaultInjector>,
    registrar: Registrar,
    health: Arc<Health>,
    metrics: RegistrationMetrics,
}

/// Embedded client with 1 MiB of segments, wrapped in a fault injector; registrations cut at 4 KiB
/// so a pool of `pages` pages × 4 layers registers as `4 × pages` ranges.
fn rig(policy: FailurePolicy, plan: FaultPlan, order: TxnOrder) -> Rig {
    let inner = Arc::new(EmbeddedClient::new(SegmentBackend::Memfd));
    inner.reserve(1 << 20).unwrap();
    let faults = FaultInjector::new(plan);
    let client: Arc<dyn StoreClient> = Arc::new(FaultyClient::new(inner.clone(), faults.clone()));
    let health = Arc::new(Health::new());
    health.set_ready(true);
    let metrics = RegistrationMetrics::default();
    let registrar = Registrar::new(
        client,
        health.clone(),
        metrics.clone(),
        RegistrarConfig {
            policy,
            max_registration_bytes: PAGE,
            order,
        },
    );
    Rig {
        inner,
        faults,
        registrar,
        health,
        metrics,
    }
}

impl Rig {
    fn tier_allocator(&self) -> Allocator {
        self.faults.hook_allocator(self.inner.host_allocator())
    }
    fn registers(&self) -> Vec<usize> {
        self.faults
            .log()
            .iter()
            .filter_map(|c| match c {
                Call::Register { addr, .. } => Some(*addr),
                _ => None,
            })
            .collect()
    }
    fn unregisters(&self) -> Vec<usize> {
        self.faults
            .log()
            .iter()
            .filter_map(|c| match c {
                Call::Unregister { addr, .. } => Some(*addr),
                _ => None,
            })
            .collect()
    }
    fn frees(&self) -> usize {
        self.faults
            .log()
            .iter()
            .filter(|c| matches!(c, Call::Free { .. }))
            .count()
    }
    /// Nothing of the draft pool is visible: not in the pool map, no registration in the table or in
    /// the store client.
    fn assert_nothing_visible(&self) {
        assert!(
            self.registrar.pools().get(PoolRole::Draft).is_none(),
            "draft visible in pool map"
        );
        assert_eq!(self.registrar.registry().active_count(), 0);
        assert_eq!(self.inner.registered_count(), 0);
    }
}

fn fallback_count(metrics: &RegistrationMetrics, role: PoolRole) -> u64 {
    metrics
        .fallback
        .get_or_create(&RegistrationMetrics::label(role))
        .get()
}

// ---- fault injection: first, Nth of M, undo fails ----

#[test]
fn first_buffer_fails_nothing_registered_pool_destroyed_once() {
    let rig = rig(
        FailurePolicy::FailClosed,
        FaultPlan {
            register: Some(1),
            ..FaultPlan::default()
        },
        TxnOrder::Transactional,
    );
    let alloc = rig.tier_allocator();
    let err = rig
        .registrar
        .attach(spec(PoolRole::Draft, 2), &alloc)
        .unwrap_err();
    assert_eq!(err.phase, Phase::Register);
    assert!(err.undo.undone.is_empty());
    assert!(err.undo.pool_freed);
    assert_eq!(rig.registers().len(), 1);
    assert!(rig.unregisters().is_empty());
    assert_eq!(rig.frees(), 1, "destroy exactly once");
    rig.assert_nothing_visible();
    assert_eq!(alloc.stats().live_buffers, 0, "no leak");
}

#[test]
fn nth_of_m_fails_undo_is_reverse_and_complete() {
    // 2 pages × 4 layers = 8 ranges; the 5th registration fails.
    let rig = rig(
        FailurePolicy::FailClosed,
        FaultPlan {
            register: Some(5),
            ..FaultPlan::default()
        },
        TxnOrder::Transactional,
    );
    let alloc = rig.tier_allocator();
    let err = rig
        .registrar
        .attach(spec(PoolRole::Draft, 2), &alloc)
        .unwrap_err();
    assert_eq!(err.phase, Phase::Register);
    let registered = rig.registers();
    assert_eq!(registered.len(), 5);
    let mut expected_undo = registered[..4].to_vec();
    expected_undo.reverse();
    assert_eq!(rig.unregisters(), expected_undo, "undo in reverse order");
    assert_eq!(err.undo.undone.len(), 4);
    assert!(err.undo.quarantined.is_empty());
    assert_eq!(rig.frees(), 1, "destroy exactly once");
    let last_unregister = rig
        .faults
        .log()
        .iter()
        .rposition(|c| matches!(c, Call::Unregister { .. }))
        .unwrap();
    let free_at = rig
        .faults
        .log()
        .iter()
        .position(|c| matches!(c, Call::Free { .. }))
        .unwrap();
    assert!(
        free_at > last_unregister,
        "memory freed only after every undo"
    );
    rig.assert_nothing_visible();
    assert_eq!(alloc.stats().live_buffers, 0);
}

#[test]
fn every_failure_point_leaves_zero_registrations_one_destroy_no_leak() {
    // DESIGN §7: "every failure point leaves zero registrations, one destroy, no leak".
    for n in 1..=8 {
        let rig = rig(
            FailurePolicy::FailClosed,
            FaultPlan {
                register: Some(n),
                ..FaultPlan::default()
            },
            TxnOrder::Transactional,
        );
        let alloc = rig.tier_allocator();
        assert!(
            rig.registrar
                .attach(spec(PoolRole::Draft, 2), &alloc)
                .is_err()
        );
        assert_eq!(rig.unregisters().len(), n - 1, "n={n}");
        assert_eq!(rig.frees(), 1, "n={n}");
        rig.assert_nothing_visible();
        assert_eq!(alloc.stats().live_buffers, 0, "n={n}");
    }
}

#[test]
fn failing_undo_quarantines_registration_and_memory() {
    // TC-REG-03: the 4th registration fails; the first undo (of the 3rd) fails too.
    let rig = rig(
        FailurePolicy::FailClosed,
        FaultPlan {
            register: Some(4),
            unregister: Some(1),
            ..FaultPlan::default()
        },
        TxnOrder::Transactional,
    );
    let alloc = rig.tier_allocator();
    let err = rig
        .registrar
        .attach(spec(PoolRole::Draft, 2), &alloc)
        .unwrap_err();
    let registered = rig.registers();
    assert_eq!(
        rig.unregisters(),
        vec![registered[2], registered[1], registered[0]],
        "undo keeps going in reverse order after a failing undo"
    );
    assert_eq!(err.undo.quarantined.len(), 1);
    assert_eq!(err.undo.undone.len(), 2);
    assert!(!err.undo.pool_freed);
    assert_eq!(rig.frees(), 0, "quarantined memory is never freed");
    let stats = alloc.stats();
    assert_eq!((stats.live_buffers, stats.quarantined_buffers), (0, 1));
    // Not visible as a committed pool; the quarantined registration is reported, not active.
    assert!(rig.registrar.pools().get(PoolRole::Draft).is_none());
    assert_eq!(rig.registrar.registry().active_count(), 0);
    assert_eq!(rig.registrar.registry().quarantined_count(), 1);
    let report = rig.registrar.health_report();
    assert_eq!(report.quarantined_registrations, 1);
    assert_eq!(
        rig.metrics
            .quarantined
            .get_or_create(&RegistrationMetrics::label(PoolRole::Draft))
            .get(),
        1
    );
    // The quarantined range cannot be registered again.
    let range = rig.registrar.registry().list()[0].clone();
    let overlapping = BufferRef {
        buffer: range.buffer,
        addr: range.addr,
        len: range.len,
        domain: AllocatorDomain::SharedMemory,
        owner: "x".into(),
        allocator: "x".into(),
    };
    assert!(matches!(
        rig.registrar.registry().register(&overlapping),
        Err(RegisterError::Overlap { .. })
    ));
}

#[test]
fn allocation_failure_is_reported_in_the_allocate_phase() {
    let rig = rig(
        FailurePolicy::FailClosed,
        FaultPlan {
            allocate: Some(1),
            ..FaultPlan::default()
        },
        TxnOrder::Transactional,
    );
    let err = rig
        .registrar
        .attach(spec(PoolRole::Draft, 2), &rig.tier_allocator())
        .unwrap_err();
    assert_eq!(err.phase, Phase::Allocate);
    assert!(rig.registers().is_empty());
    assert_eq!(rig.frees(), 0);
    rig.assert_nothing_visible();
}

// ---- policies ----

#[test]
fn fallback_policy_continues_on_l2_with_log_metric_and_health_reason() {
    let rig = rig(
        FailurePolicy::FallbackToL2,
        FaultPlan::default(),
        TxnOrder::Transactional,
    );
    let alloc = rig.tier_allocator();
    let target = rig
        .registrar
        .attach(spec(PoolRole::Target, 2), &alloc)
        .unwrap();
    assert_eq!(target.state(), TxnState::Committed);
    rig.faults.set_plan(FaultPlan {
        register: Some(2),
        ..FaultPlan::default()
    });
    let draft = rig
        .registrar
        .attach(spec(PoolRole::Draft, 2), &alloc)
        .unwrap();
    assert_eq!(draft.state(), TxnState::FallbackL2);
    assert_eq!(fallback_count(&rig.metrics, PoolRole::Draft), 1);
    assert_eq!(fallback_count(&rig.metrics, PoolRole::Target), 0);
    let report = rig.registrar.health_report();
    assert!(report.ready, "service continues");
    assert_eq!(report.degraded.len(), 1);
    assert_eq!(report.degraded[0].component, "l3/draft");
    assert_eq!(report.degraded[0].code, "RegistrationFallbackToL2");
    assert!(report.degraded[0].message.contains("register"));
    // The target pool is untouched and still registered.
    assert!(rig.registrar.pools().get(PoolRole::Target).is_some());
    assert!(rig.registrar.pools().get(PoolRole::Draft).is_none());
    assert_eq!(rig.registrar.registry().active_count(), 8);
    assert_eq!(rig.health.report().degraded.len(), 1);
}

#[test]
fn fail_closed_error_names_allocator_client_mode_size_and_phase() {
    let rig = rig(
        FailurePolicy::FailClosed,
        FaultPlan {
            register: Some(3),
            ..FaultPlan::default()
        },
        TxnOrder::Transactional,
    );
    let err = rig
        .registrar
        .attach(spec(PoolRole::Draft, 2), &rig.tier_allocator())
        .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("tier shared memory"), "{msg}");
    assert!(msg.contains("SharedMemory"), "{msg}");
    assert!(msg.contains("Embedded"), "{msg}");
    assert!(msg.contains(&format!("{} B", 8 * PAGE)), "{msg}");
    assert!(msg.contains("phase register"), "{msg}");
    assert_eq!(err.client_mode, ClientMode::Embedded);
    assert_eq!(err.buffer_bytes, 8 * PAGE);
    assert_eq!(fallback_count(&rig.metrics, PoolRole::Draft), 0);
    assert!(rig.health.report().degraded.is_empty());
}

// ---- negative control: the seed's order ----

#[test]
fn negative_control_legacy_order_leaves_partial_state_visible() {
    // With the seed's order (publish, then register, no rollback) the same fault leaves the draft pool
    // visible and registrations leaked: the checks above would fail on it.
    let rig = rig(
        FailurePolicy::FailClosed,
        FaultPlan {
            register: Some(3),
            ..FaultPlan::default()
        },
        TxnOrder::UnsafeLegacy,
    );
    let alloc = rig.tier_allocator();
    assert!(
        rig.registrar
            .attach(spec(PoolRole::Draft, 2), &alloc)
            .is_err()
    );
    assert!(rig.registrar.pools().get(PoolRole::Draft).is_some());
    assert_eq!(rig.inner.registered_count(), 2);
    assert!(rig.unregisters().is_empty());
    assert_eq!(rig.frees(), 0);
    let visible = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rig.assert_nothing_visible()
    }));
    assert!(
        visible.is_err(),
        "the invariant check detects the seed's bug"
    );
}

// ---- seed 000 regression: standalone client, draft pool on the wrong allocator ----

struct InProcessStoreClient {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
    socket: PathBuf,
}

impl InProcessStoreClient {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("store-client.sock");
        let mut config = ServerConfig::new(socket.clone(), SegmentBackend::Memfd, 64 << 20);
        config.name_prefix = format!("tandem-test-reg-{}", std::process::id());
        let server = StoreClientServer::bind(config).unwrap();
        let stop = server.stop_flag();
        let thread = std::thread::spawn(move || {
            server.serve().unwrap();
        });
        Self {
            stop,
            thread: Some(thread),
            _dir: dir,
            socket,
        }
    }
}

impl Drop for InProcessStoreClient {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn standalone_rig(policy: FailurePolicy) -> (InProcessStoreClient, Rig, Arc<StandaloneClient>) {
    let server = InProcessStoreClient::start();
    let client = Arc::new(StandaloneClient::connect(&server.socket, "test-worker").unwrap());
    // Capacity planned for target + draft before anything is allocated.
    let plan = CapacityPlan::new(
        1 << 20,
        &[spec(PoolRole::Target, 2), spec(PoolRole::Draft, 2)],
    )
    .unwrap();
    client.reserve(plan.required()).unwrap();
    let faults = FaultInjector::new(FaultPlan::default());
    let wrapped: Arc<dyn StoreClient> = Arc::new(FaultyClient::new(client.clone(), faults.clone()));
    let health = Arc::new(Health::new());
    let metrics = RegistrationMetrics::default();
    let registrar = Registrar::new(
        wrapped,
        health.clone(),
        metrics.clone(),
        RegistrarConfig {
            policy,
            ..RegistrarConfig::default()
        },
    );
    let rig = Rig {
        inner: Arc::new(EmbeddedClient::new(SegmentBackend::Memfd)), // unused by these tests
        faults,
        registrar,
        health,
        metrics,
    };
    (server, rig, client)
}

#[test]
fn seed_000_draft_on_mmap_is_a_domain_error_at_preflight_before_any_registration() {
    let (_server, rig, client) = standalone_rig(FailurePolicy::FailClosed);
    let tier = rig.faults.hook_allocator(client.host_allocator());
    let target = rig
        .registrar
        .attach(spec(PoolRole::Target, 2), &tier)
        .unwrap();
    assert_eq!(target.state(), TxnState::Committed);
    let registers_before = rig.registers().len();

    // The draft pool copied the sizing but fell back to plain mmap (seed 000 root cause 1).
    let mmap = rig.faults.hook_allocator(&Allocator::new(
        "default host allocator",
        MmapBackend::new(),
    ));
    let err = rig
        .registrar
        .attach(spec(PoolRole::Draft, 2), &mmap)
        .unwrap_err();
    assert_eq!(err.phase, Phase::Preflight);
    assert!(matches!(
        err.cause,
        FailureCause::Register(RegisterError::Store(StoreError::DomainMismatch {
            domain: AllocatorDomain::Mmap,
            mode: ClientMode::Standalone,
            ..
        }))
    ));
    assert_eq!(rig.registers().len(), registers_before, "no external call");
    assert_eq!(mmap.stats().live_buffers, 0, "draft pool destroyed");
    assert_eq!(rig.frees(), 1);
    assert!(rig.registrar.pools().get(PoolRole::Draft).is_none());
    assert!(
        rig.registrar.pools().get(PoolRole::Target).is_some(),
        "target unaffected"
    );
    let msg = err.to_string();
    for needle in [
        "Mmap",
        "Standalone",
        "preflight",
        &format!("{} B", 8 * PAGE),
    ] {
        assert!(msg.contains(needle), "{needle:?} missing from {msg}");
    }
    assert_eq!(
        client.remote_stats().unwrap(),
        (1, 1),
        "only the target is registered remotely"
    );
}

#[test]
fn seed_000_fixed_draft_inheriting_the_tier_allocator_commits() {
    let (_server, rig, client) = standalone_rig(FailurePolicy::FailClosed);
    let tier = client.host_allocator().clone();
    rig.registrar
        .attach(spec(PoolRole::Target, 2), &tier)
        .unwrap();
    let draft = rig
        .registrar
        .attach(spec(PoolRole::Draft, 2), &tier)
        .unwrap();
    let AttachOutcome::Committed(committed) = draft else {
        panic!("draft did not commit")
    };
    assert_eq!(committed.pool.domain(), AllocatorDomain::SharedMemory);
    assert!(
        committed.pool.buffer().placement().is_some(),
        "inside a store-client segment"
    );
    assert_eq!(rig.registrar.pools().len(), 2);
    assert_eq!(client.remote_stats().unwrap(), (1, 2));
    drop(committed);
    // Teardown order: detach (deregister, destroy), then the client.
    assert!(rig.registrar.detach_all().is_empty());
    assert_eq!(client.remote_stats().unwrap(), (1, 0));
    assert_eq!(tier.stats().live_buffers, 0);
    client.shutdown().unwrap();
}

#[test]
fn seed_000_fallback_keeps_serving_with_draft_l3_off() {
    let (_server, rig, client) = standalone_rig(FailurePolicy::FallbackToL2);
    let tier = client.host_allocator().clone();
    rig.registrar
        .attach(spec(PoolRole::Target, 2), &tier)
        .unwrap();
    let mmap = Allocator::new("default host allocator", MmapBackend::new());
    let out = rig
        .registrar
        .attach(spec(PoolRole::Draft, 2), &mmap)
        .unwrap();
    assert_eq!(out.state(), TxnState::FallbackL2);
    assert_eq!(fallback_count(&rig.metrics, PoolRole::Draft), 1);
    let report = rig.registrar.health_report();
    assert_eq!(report.degraded[0].component, "l3/draft");
    assert!(report.degraded[0].message.contains("Mmap"));
    assert_eq!(report.registrations, 1);
}

#[test]
fn shared_memory_of_another_tier_is_not_in_segment() {
    // Right domain, wrong owner: a SharedMemory buffer from an embedded client's segment is still
    // foreign to the standalone store client (TC-REG-05 class: a typed error, never -1).
    let (_server, rig, _client) = standalone_rig(FailurePolicy::FailClosed);
    let other = EmbeddedClient::new(SegmentBackend::Memfd);
    other.reserve(1 << 20).unwrap();
    let err = rig
        .registrar
        .attach(spec(PoolRole::Draft, 2), other.host_allocator())
        .unwrap_err();
    assert_eq!(err.phase, Phase::Preflight);
    assert!(matches!(
        err.cause,
        FailureCause::Register(RegisterError::Store(StoreError::NotInSegment { .. }))
    ));
}

// ---- duplicates, overlaps, zero size, unknown and busy deregistration (TC-REG-06, TC-REG-07) ----

#[test]
fn duplicate_overlap_zero_unknown_and_busy_have_defined_results() {
    let rig = rig(
        FailurePolicy::FailClosed,
        FaultPlan::default(),
        TxnOrder::Transactional,
    );
    let alloc = rig.inner.host_allocator().clone();
    let buf = alloc.allocate(4 * PAGE, "test").unwrap();
    let reg = rig.registrar.registry();
    let whole = BufferRef::whole(&buf);

    let a = reg.register(&whole).unwrap();
    let b = reg.register(&whole).unwrap();
    assert_eq!(a, b, "exact duplicate is the same registration");
    assert_eq!(reg.get(a).unwrap().refcount, 2);
    assert_eq!(rig.registers().len(), 1, "no second external call");

    let partial = BufferRef::sub_range(&buf, PAGE, PAGE).unwrap();
    assert!(
        matches!(reg.register(&partial), Err(RegisterError::Overlap { existing, .. }) if existing == a)
    );
    let zero = BufferRef::sub_range(&buf, 0, 0).unwrap();
    assert!(matches!(
        reg.register(&zero),
        Err(RegisterError::ZeroSize(_))
    ));

    let unknown = tandem_worker::registration::RegistrationId(999_999);
    assert!(matches!(
        reg.deregister(&[a, unknown]),
        Err(DeregisterError::Unknown(_))
    ));
    assert_eq!(reg.get(a).unwrap().refcount, 2, "nothing changed");
    assert!(matches!(
        reg.deregister(&[a, a]),
        Err(DeregisterError::Duplicate(_))
    ));

    let in_flight = reg.acquire(a).unwrap();
    assert!(matches!(
        reg.deregister(&[a]),
        Err(DeregisterError::Busy { in_flight: 1, .. })
    ));
    assert_eq!(reg.get(a).unwrap().refcount, 2, "nothing changed");
    drop(in_flight);

    reg.deregister(&[a]).unwrap();
    assert_eq!(reg.get(a).unwrap().refcount, 1);
    assert!(rig.unregisters().is_empty());
    reg.deregister(&[a]).unwrap();
    assert!(reg.get(a).is_none());
    assert_eq!(rig.unregisters().len(), 1);
    assert_eq!(rig.inner.registered_count(), 0);
    assert!(matches!(
        reg.deregister(&[a]),
        Err(DeregisterError::Unknown(_))
    ));
    buf.free().unwrap();
}

#[test]
fn detach_refuses_while_a_transfer_references_the_pool() {
    let rig = rig(
        FailurePolicy::FailClosed,
        FaultPlan::default(),
        TxnOrder::Transactional,
    );
    let alloc = rig.tier_allocator();
    let AttachOutcome::Committed(c) = rig
        .registrar
        .attach(spec(PoolRole::Target, 1), &alloc)
        .unwrap()
    else {
        panic!()
    };
    let guard = rig
        .registrar
        .registry()
        .acquire(c.registrations[0])
        .unwrap();
    assert!(rig.registrar.detach(PoolRole::Target).is_err());
    assert!(
        rig.registrar.pools().get(PoolRole::Target).is_some(),
        "still committed"
    );
    drop(guard);
    drop(c);
    rig.registrar.detach(PoolRole::Target).unwrap();
    assert!(rig.registrar.pools().is_empty());
    assert_eq!(rig.inner.registered_count(), 0);
    assert_eq!(alloc.stats().live_buffers, 0);
    assert_eq!(rig.frees(), 1);
}

// ---- capacity planning (TC-REG-08) ----

#[test]
fn capacity_too_small_lists_every_pool() {
    let specs = [
        spec(PoolRole::Target, 8),
        spec(PoolRole::Draft, 2),
        spec(PoolRole::Indexer, 1),
    ];
    let err = CapacityPlan::new(10 * 4 * PAGE, &specs).unwrap_err();
    let CapacityError::TooSmall {
        required, pools, ..
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(*required, 11 * 4 * PAGE);
    assert_eq!(pools.len(), 3);
    let msg = err.to_string();
    for needle in ["target 131072 B", "draft 32768 B", "indexer 16384 B"] {
        assert!(msg.contains(needle), "{msg}");
    }
    assert!(CapacityPlan::new(11 * 4 * PAGE, &specs).is_ok());
}
