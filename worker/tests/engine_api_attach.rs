//! Engine API Attach (DESIGN §3.1, contracts 1 and 2): pools mapped by both sides, identity
//! mismatches refused typed with nothing allocated, a pool outside the configured domain refused
//! before any side effect, fds passed once, and the attach bound to its pools connection.

mod engine_api_support;

use std::sync::Arc;
use std::time::Duration;

use engine_api_support::*;
use tandem_worker::config::WorkerRole;
use tandem_worker::engine_api::client::EngineClient;
use tandem_worker::engine_api::fd_pass;
use tandem_worker::engine_api::identity::model_to_proto;
use tandem_worker::engine_api::pools::{PoolSet, PoolSetError};
use tandem_worker::engine_api::service::Backend;
use tandem_worker::engine_api::{EngineApiConfig, pb};
use tandem_worker::memory::AllocatorDomain;
use tandem_worker::memory::pool::{PageId, PoolRole};
use tandem_worker::registration::FailurePolicy;
use tandem_worker::registration::fault::{FaultInjector, FaultPlan};
use tandem_worker::store_client::ClientMode;
use tonic::Code;

fn decode_worker(shape: Shape) -> Worker {
    start_worker(
        worker_config(WorkerRole::Decode, shape),
        Backend::Decode(Arc::new(ManualSource::default())),
        Options::default(),
    )
}

fn full_shape() -> Shape {
    Shape {
        pages: 8,
        draft: true,
        indexer: true,
        ..Shape::default()
    }
}

/// Reads the worker's own view of a chunk, by address (the page table is not involved).
fn worker_chunk(w: &Worker, role: PoolRole, page: u32, layer: u32) -> Vec<u8> {
    let pool = w.api.pools().pool(role).unwrap();
    let region = pool.chunk_region(PageId(page), layer).unwrap();
    let base = pool.buffer().host_ptr().unwrap();
    // SAFETY: the region lies inside the pool's live mapping; the test is the only writer now.
    unsafe { std::slice::from_raw_parts(base.add(region.offset), region.len).to_vec() }
}

fn worker_write(w: &Worker, role: PoolRole, page: u32, layer: u32, byte: u8) {
    let pool = w.api.pools().pool(role).unwrap();
    let region = pool.chunk_region(PageId(page), layer).unwrap();
    let base = pool.buffer().host_ptr().unwrap();
    // SAFETY: as above.
    unsafe { std::ptr::write_bytes(base.add(region.offset), byte, region.len) };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sides_map_the_same_bytes_at_the_same_page_index() {
    let _serial = serial().await;
    let w = decode_worker(full_shape());
    let mut c = w.client().await;
    let mut att = c.attach(identity(&w.cfg)).await.unwrap();
    assert_eq!(att.pools.len(), 3, "target, draft and indexer");
    for (i, p) in att.pools.iter().enumerate() {
        let d = &p.descriptor;
        assert_eq!(d.fd_index as usize, i);
        assert_eq!(d.page_count, 8);
        assert_eq!(d.page_tokens, PAGE_TOKENS);
        assert_eq!(d.domain, pb::Domain::SharedMemory as i32);
        assert_eq!(d.registration, pb::RegistrationState::None as i32);
        assert_eq!(d.map_offset % 4096, 0);
        assert_eq!(d.page_bytes, d.chunk_bytes * u64::from(d.layers));
    }
    for role in [PoolRole::Target, PoolRole::Draft, PoolRole::Indexer] {
        let pool = att.pool(role).unwrap();
        let layers = pool.geometry().layers;
        let chunk = pool.geometry().chunk_bytes() as usize;
        // Engine writes, worker reads at the same (page, layer).
        let pattern: Vec<u8> = (0..chunk).map(|i| (i * 7 + role as usize) as u8).collect();
        pool.write(5, layers - 1, 0, &pattern).unwrap();
        assert_eq!(worker_chunk(&w, role, 5, layers - 1), pattern, "{role}");
        // A neighbouring chunk is untouched.
        assert!(
            worker_chunk(&w, role, 4, layers - 1)
                .iter()
                .all(|b| *b == 0)
        );
        // Worker writes, engine reads.
        worker_write(&w, role, 2, 0, 0xA5);
        let mut got = vec![0u8; chunk];
        pool.read(2, 0, 0, &mut got).unwrap();
        assert!(got.iter().all(|b| *b == 0xA5), "{role}");
        // Out-of-range pages and layers are refused by the client, not written.
        assert!(pool.write(8, 0, 0, &[1]).is_err());
        assert!(pool.write(0, layers, 0, &[1]).is_err());
    }
    let h = c.health().await.unwrap();
    assert_eq!(h.attach_id, att.id());
    assert_eq!(h.pools.len(), 3);
    assert_eq!(h.pages_free, 8);

    // The fds are passed once.
    let again = fd_pass::claim(
        std::path::Path::new(&att.reply.pools_socket),
        att.id(),
        att.reply.claim_token,
    )
    .unwrap_err();
    assert!(again.to_string().contains("ALREADY_CLAIMED"), "{again}");

    // Closing the pools connection ends the attach; a new attach maps the same pools.
    let first = att.id();
    att.close();
    until("the attach ends", Duration::from_secs(5), || {
        w.api.current_attach().is_none()
    })
    .await;
    let att2 = c.attach(identity(&w.cfg)).await.unwrap();
    assert_ne!(att2.id(), first);
    let mut got = vec![0u8; 4];
    att2.pool(PoolRole::Target)
        .unwrap()
        .read(2, 0, 0, &mut got)
        .unwrap();
    assert_eq!(got, [0xA5; 4], "the re-attach maps the same memory");
    assert_eq!(w.live_buffers(), 3, "pools are allocated once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_engine_is_refused_while_one_is_attached() {
    let _serial = serial().await;
    let w = decode_worker(Shape {
        pages: 4,
        ..Shape::default()
    });
    let mut c = w.client().await;
    let _att = c.attach(identity(&w.cfg)).await.unwrap();
    let e = client_err(c.attach_only(identity(&w.cfg)).await);
    assert_eq!(
        (e.code, e.reason),
        (Code::AlreadyExists, pb::ErrorReason::AlreadyAttached)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_mismatches_are_refused_typed_and_allocate_nothing() {
    let _serial = serial().await;
    let w = decode_worker(full_shape());
    let mut c = w.client().await;
    let memfds = memfd_count();
    let good = identity(&w.cfg);
    type Edit = Box<dyn Fn(&mut pb::EngineIdentity)>;
    let cases: Vec<(&str, &str, &str, Edit)> = vec![
        (
            "model.layers",
            "4",
            "5",
            Box::new(|i| i.model.as_mut().unwrap().layers = 5),
        ),
        (
            "model.name",
            "tiny",
            "other",
            Box::new(|i| i.model.as_mut().unwrap().name = "other".into()),
        ),
        (
            "model.attention.head_dim",
            "8",
            "16",
            Box::new(|i| {
                let mut m = model("tiny");
                m.attention = tandem_worker::model::Attention::Gqa {
                    kv_heads: 1,
                    head_dim: 16,
                };
                i.model = Some(model_to_proto(&m));
            }),
        ),
        (
            "model.dtype_bytes",
            "2",
            "1",
            Box::new(|i| i.model.as_mut().unwrap().dtype_bytes = 1),
        ),
        ("page_tokens", "16", "32", Box::new(|i| i.page_tokens = 32)),
        (
            "layout",
            "POOL_LAYOUT_PAGE_FIRST",
            "POOL_LAYOUT_LAYER_FIRST",
            Box::new(|i| i.layout = pb::PoolLayout::LayerFirst as i32),
        ),
        ("tp_size", "1", "2", Box::new(|i| i.tp_size = 2)),
        (
            "model_fingerprint",
            "",
            "0000000000000000",
            Box::new(|i| i.model_fingerprint = "0000000000000000".into()),
        ),
        (
            "speculative.draft_model.layers",
            "2",
            "3",
            Box::new(|i| {
                let mut d = draft_model();
                d.layers = 3;
                i.pools[1].draft_model = Some(model_to_proto(&d));
            }),
        ),
        (
            "indexer.head_dim",
            "16",
            "8",
            Box::new(|i| i.pools[2].indexer.as_mut().unwrap().head_dim = 8),
        ),
    ];
    for (field, ours, theirs, edit) in cases {
        let mut id = good.clone();
        edit(&mut id);
        let e = client_err(c.attach_only(id).await);
        assert_eq!(
            (e.code, e.reason),
            (Code::FailedPrecondition, pb::ErrorReason::IdentityMismatch),
            "{field}: {e}"
        );
        assert_eq!(e.field, field);
        if !ours.is_empty() {
            assert_eq!(
                (e.ours.as_str(), e.theirs.as_str()),
                (ours, theirs),
                "{field}"
            );
        }
        // Nothing happened: no buffer, no memfd, no attach.
        assert_eq!(w.live_buffers(), 0, "{field}");
        assert_eq!(memfd_count(), memfds, "{field}");
        assert!(w.api.pools().attached().is_empty(), "{field}");
        assert_eq!(w.api.current_attach(), None, "{field}");
    }
    // Positive control: the counters do see an allocation.
    let _att = c.attach(good).await.unwrap();
    assert_eq!(w.live_buffers(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_outside_the_domain_is_refused_before_any_side_effect() {
    let _serial = serial().await;
    // Seed 000: a speculative DecodePool whose draft pool is on plain mmap, with an L3 tier.
    let w = decode_worker(Shape {
        pages: 4,
        draft: true,
        cache: Some(ClientMode::Embedded),
        ..Shape::default()
    });
    let mut c = w.client().await;
    let memfds = memfd_count();
    let mut id = identity(&w.cfg);
    id.pools[1].source = pb::PoolSource::Engine as i32;
    id.pools[1].engine_domain = pb::Domain::Mmap as i32;
    let e = client_err(c.attach_only(id.clone()).await);
    assert_eq!(
        (e.code, e.reason),
        (
            Code::FailedPrecondition,
            pb::ErrorReason::PoolDomainMismatch
        ),
        "{e}"
    );
    assert_eq!(e.field, "pools.draft.engine_domain");
    assert_eq!(
        (e.ours.as_str(), e.theirs.as_str()),
        ("SharedMemory", "Mmap")
    );
    // Before any side effect: no allocation, no registration (not even of the target pool), no
    // rollback, no memfd.
    assert_eq!(w.live_buffers(), 0);
    assert_eq!(w.registrations(), 0);
    let label = tandem_worker::registration::metrics::RegistrationMetrics::label;
    assert_eq!(
        w.metrics
            .rollbacks
            .get_or_create(&label(PoolRole::Target))
            .get(),
        0
    );
    assert_eq!(
        w.metrics
            .commits
            .get_or_create(&label(PoolRole::Target))
            .get(),
        0
    );
    assert_eq!(memfd_count(), memfds);
    // The same memory offered in the right domain is still not adopted (typed), also without effect.
    id.pools[1].engine_domain = pb::Domain::SharedMemory as i32;
    let e = client_err(c.attach_only(id).await);
    assert_eq!(e.reason, pb::ErrorReason::AdoptionUnsupported);
    assert_eq!((w.live_buffers(), w.registrations()), (0, 0));
    // Positive control: the worker allocates the draft pool in its domain and registers both.
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    assert_eq!((w.live_buffers(), w.registrations()), (2, 2));
    for p in &att.pools {
        assert_eq!(
            p.descriptor.registration,
            pb::RegistrationState::Committed as i32
        );
        assert_eq!(p.descriptor.domain, pb::Domain::SharedMemory as i32);
    }
    assert_eq!(
        w.metrics
            .commits
            .get_or_create(&label(PoolRole::Draft))
            .get(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_that_are_not_configured_are_refused() {
    let _serial = serial().await;
    let w = decode_worker(Shape {
        pages: 4,
        ..Shape::default()
    });
    let mut c = w.client().await;
    let mut id = identity(&w.cfg);
    id.pools.push(pb::PoolRequest {
        kind: pb::PoolKind::Draft as i32,
        draft_model: Some(model_to_proto(&draft_model())),
        ..pb::PoolRequest::default()
    });
    let e = client_err(c.attach_only(id).await);
    assert_eq!(e.reason, pb::ErrorReason::PoolNotConfigured);
    assert_eq!(e.field, "pools.draft");
    assert_eq!(w.live_buffers(), 0);
}

#[test]
fn a_process_private_domain_cannot_serve_the_engine_api() {
    for domain in [AllocatorDomain::Mmap, AllocatorDomain::Pinned] {
        let mut cfg = worker_config(
            WorkerRole::Decode,
            Shape {
                pages: 2,
                ..Shape::default()
            },
        );
        cfg.memory.allocator = domain;
        let dir = tempfile::tempdir().unwrap();
        let api = EngineApiConfig::for_worker(&cfg, dir.path());
        assert!(
            matches!(
                PoolSet::unregistered(&cfg, &api),
                Err(PoolSetError::DomainNotShareable(d)) if d == domain
            ),
            "{domain}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unclaimed_attach_ends_at_its_claim_deadline() {
    let _serial = serial().await;
    let w = start_worker(
        worker_config(
            WorkerRole::Decode,
            Shape {
                pages: 2,
                ..Shape::default()
            },
        ),
        Backend::Decode(Arc::new(ManualSource::default())),
        Options {
            tweak: Box::new(|a| a.claim_deadline = Duration::from_millis(200)),
            ..Options::default()
        },
    );
    let mut c: EngineClient = w.client().await;
    let reply = c.attach_only(identity(&w.cfg)).await.unwrap();
    assert_eq!(w.api.current_attach(), Some(reply.attach_id));
    until("the unclaimed attach ends", Duration::from_secs(5), || {
        w.api.current_attach().is_none()
    })
    .await;
    let e = fd_pass::claim(
        std::path::Path::new(&reply.pools_socket),
        reply.attach_id,
        reply.claim_token,
    )
    .unwrap_err();
    assert!(e.to_string().contains("NOT_ATTACHED"), "{e}");
    // A new engine may attach now.
    c.attach(identity(&w.cfg)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_paths_longer_than_sun_path_work() {
    let _serial = serial().await;
    // A socket directory as deep as a kubelet pod volume under the e2e runner's $TANDEM_ROOT.
    let root = tempfile::tempdir().unwrap();
    let deep = root
        .path()
        .join("var/lib/kubelet/pods/0123456789abcdef-0123-4567-89ab-cdef01234567")
        .join("volumes/kubernetes.io~empty-dir/engine-socket");
    assert!(deep.join("engine.sock").as_os_str().len() > 107);
    let w = start_worker(
        worker_config(
            WorkerRole::Decode,
            Shape {
                pages: 2,
                ..Shape::default()
            },
        ),
        Backend::Decode(Arc::new(ManualSource::default())),
        Options {
            tweak: Box::new(move |a| a.socket_dir = deep),
            ..Options::default()
        },
    );
    let dir = w.api.settings().socket_dir.clone();
    let mut c = EngineClient::connect(&dir, Duration::from_secs(10))
        .await
        .unwrap();
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    assert_eq!(att.pools.len(), 1);
    assert_eq!(c.health().await.unwrap().attach_id, att.id());
}

fn registered_worker(policy: FailurePolicy, faults: Arc<FaultInjector>) -> Worker {
    let mut cfg = worker_config(
        WorkerRole::Decode,
        Shape {
            pages: 4,
            draft: true,
            cache: Some(ClientMode::Embedded),
            ..Shape::default()
        },
    );
    cfg.memory.registration_failure = policy;
    start_worker(
        cfg,
        Backend::Decode(Arc::new(ManualSource::default())),
        Options {
            faults: Some(faults),
            ..Options::default()
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_registration_rolls_back_every_pool_of_the_attach() {
    let _serial = serial().await;
    // The second registration (the draft pool's) fails.
    let faults = FaultInjector::new(FaultPlan {
        register: Some(2),
        ..FaultPlan::default()
    });
    let w = registered_worker(FailurePolicy::FailClosed, faults.clone());
    let mut c = w.client().await;
    let e = client_err(c.attach_only(identity(&w.cfg)).await);
    assert_eq!(
        (e.code, e.reason),
        (
            Code::FailedPrecondition,
            pb::ErrorReason::PoolRegistrationFailed
        ),
        "{e}"
    );
    assert_eq!(e.field, "pools.draft");
    assert!(e.message.contains("phase register"), "{e}");
    // The committed target pool was rolled back with it: nothing registered, nothing allocated.
    assert_eq!((w.registrations(), w.live_buffers()), (0, 0));
    assert!(w.api.pools().attached().is_empty());
    assert_eq!(w.api.current_attach(), None);
    // Without the fault the same attach commits both pools.
    faults.set_plan(FaultPlan::default());
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    assert_eq!((w.registrations(), w.live_buffers()), (2, 2));
    assert!(
        att.pools
            .iter()
            .all(|p| p.descriptor.registration == pb::RegistrationState::Committed as i32)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_to_l2_serves_the_pool_unregistered_and_says_so() {
    let _serial = serial().await;
    let faults = FaultInjector::new(FaultPlan {
        register: Some(2),
        ..FaultPlan::default()
    });
    let w = registered_worker(FailurePolicy::FallbackToL2, faults);
    let mut c = w.client().await;
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    let target = &att.pool(PoolRole::Target).unwrap().descriptor;
    let draft = &att.pool(PoolRole::Draft).unwrap().descriptor;
    assert_eq!(target.registration, pb::RegistrationState::Committed as i32);
    assert_eq!(draft.registration, pb::RegistrationState::FallbackL2 as i32);
    assert!(draft.registration_reason.contains("injected"), "{draft:?}");
    // Both pools serve; only the target is registered.
    assert_eq!((w.registrations(), w.live_buffers()), (1, 2));
    let h = c.health().await.unwrap();
    assert!(
        h.degraded
            .iter()
            .any(|d| d.starts_with("l3/draft: RegistrationFallbackToL2")),
        "{:?}",
        h.degraded
    );
    let label = tandem_worker::registration::metrics::RegistrationMetrics::label;
    assert_eq!(
        w.metrics
            .fallback
            .get_or_create(&label(PoolRole::Draft))
            .get(),
        1
    );
}

#[test]
fn scaled_target_rows_scale_the_draft_rows_so_the_draft_does_not_cap_the_page_count() {
    // Target and draft pools sized for the same token capacity at their real rows (4 pages of
    // 32 B per token and layer), as the operator sizes them.
    let cfg = worker_config(
        WorkerRole::Decode,
        Shape {
            pages: 4,
            draft: true,
            ..Shape::default()
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let mut api = api_config(dir.path(), &cfg);
    assert_eq!(PoolSet::page_count(&cfg, &api).unwrap(), 4);
    // `TANDEM_SIM_KV_BYTES_PER_TOKEN` halves the target's rows (16 B): the target holds 8 pages,
    // and the draft's rows shrink by the same ratio, so it holds 8 as well (unscaled, it kept the
    // shared count at 4 — the demo's decode engine held 6 pages, 3,072 tokens, and 149 of 200
    // trace requests failed).
    api.target_token_bytes = Some(16);
    assert_eq!(PoolSet::page_count(&cfg, &api).unwrap(), 8);
}
