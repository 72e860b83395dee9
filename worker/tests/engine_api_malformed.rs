//! Malformed input is refused with a typed error and never takes the worker down: missing fields,
//! unknown enum values, out-of-range page indices and layers, wrong attach ids, calls of the other
//! role, garbage on both sockets. After all of it the worker still answers.

mod engine_api_support;

use std::io::Write;
use std::os::fd::AsFd;
use std::sync::Arc;

use engine_api_support::*;
use tandem_worker::config::WorkerRole;
use tandem_worker::engine_api::local::LocalLink;
use tandem_worker::engine_api::pb;
use tandem_worker::engine_api::service::Backend;
use tandem_worker::store_client::protocol;
use tonic::Code;

fn check(e: tandem_worker::engine_api::ApiError, code: Code, reason: pb::ErrorReason, field: &str) {
    assert_eq!((e.code, e.reason), (code, reason), "{e}");
    if !field.is_empty() {
        assert_eq!(e.field, field, "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_identities_are_refused_without_side_effects() {
    let w = start_worker(
        worker_config(
            WorkerRole::Decode,
            Shape {
                pages: 4,
                ..Shape::default()
            },
        ),
        Backend::Decode(Arc::new(ManualSource::default())),
        Options::default(),
    );
    let mut c = w.client().await;
    let good = identity(&w.cfg);
    type Edit = Box<dyn Fn(&mut pb::EngineIdentity)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("identity.model", Box::new(|i| i.model = None)),
        (
            "identity.model.attention",
            Box::new(|i| i.model.as_mut().unwrap().attention = None),
        ),
        (
            "identity.model.name",
            Box::new(|i| i.model.as_mut().unwrap().name.clear()),
        ),
        (
            "identity.model.layers",
            Box::new(|i| i.model.as_mut().unwrap().layers = 0),
        ),
        ("identity.page_tokens", Box::new(|i| i.page_tokens = 0)),
        ("identity.layout", Box::new(|i| i.layout = 99)),
        ("identity.layout", Box::new(|i| i.layout = 0)),
        ("identity.tp_rank", Box::new(|i| i.tp_rank = 1)),
        ("identity.pools[0].kind", Box::new(|i| i.pools[0].kind = 7)),
        (
            "identity.pools[1].kind",
            Box::new(|i| i.pools.push(i.pools[0].clone())),
        ),
        ("identity.pools", Box::new(|i| i.pools.clear())),
        (
            "identity.pools[0].source",
            Box::new(|i| i.pools[0].source = 5),
        ),
        (
            "identity.pools[0].engine_domain",
            Box::new(|i| {
                i.pools[0].source = pb::PoolSource::Engine as i32;
                i.pools[0].engine_domain = 0;
            }),
        ),
    ];
    for (field, edit) in cases {
        let mut id = good.clone();
        edit(&mut id);
        let e = client_err(c.attach_only(id).await);
        check(e, Code::InvalidArgument, pb::ErrorReason::Malformed, field);
        assert_eq!(w.live_buffers(), 0, "{field}");
    }
    let e = api_err(
        c.session
            .attach(c.req(pb::AttachRequest { identity: None }))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "identity",
    );
    assert!(c.health().await.unwrap().ready);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_decode_calls_are_refused_typed() {
    let w = start_worker(
        worker_config(
            WorkerRole::Decode,
            Shape {
                pages: 4,
                draft: true,
                spec_guard: Some(8),
                ..Shape::default()
            },
        ),
        Backend::Decode(Arc::new(ManualSource::default())),
        Options::default(),
    );
    let mut c = w.client().await;
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    let id = att.id();
    let reserve = |attach_id, tokens, kv_deadline_ms| pb::ReserveRequest {
        attach_id,
        request_id: 1,
        tokens,
        kv_deadline_ms,
        hand_off_token: 0,
    };
    let e = api_err(c.decode.reserve(c.req(reserve(id + 1, 4, 1000))).await);
    check(
        e,
        Code::FailedPrecondition,
        pb::ErrorReason::NotAttached,
        "attach_id",
    );
    let e = api_err(c.decode.reserve(c.req(reserve(0, 4, 1000))).await);
    check(
        e,
        Code::FailedPrecondition,
        pb::ErrorReason::NotAttached,
        "attach_id",
    );
    let e = api_err(c.decode.reserve(c.req(reserve(id, 0, 1000))).await);
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "tokens",
    );
    let e = api_err(c.decode.reserve(c.req(reserve(id, 4, 0))).await);
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "kv_deadline_ms",
    );
    let e = api_err(
        c.decode
            .reserve(c.req(reserve(id, 5 * PAGE_TOKENS, 1000)))
            .await,
    );
    check(e, Code::OutOfRange, pb::ErrorReason::ExceedsPool, "tokens");
    let e = api_err(c.decode.reserve(c.req(reserve(id, u32::MAX, 1000))).await);
    check(e, Code::OutOfRange, pb::ErrorReason::ExceedsPool, "tokens");
    // Room-scoped calls without a room, with an unknown room, with an unknown reason.
    let e = api_err(
        c.decode
            .await_kv(c.req(pb::AwaitKvRequest {
                attach_id: id,
                room: None,
            }))
            .await,
    );
    check(e, Code::InvalidArgument, pb::ErrorReason::Malformed, "room");
    let ghost = Some(pb::RoomRef {
        room_id: 12345,
        generation: 1,
    });
    let e = api_err(
        c.decode
            .await_kv(c.req(pb::AwaitKvRequest {
                attach_id: id,
                room: ghost,
            }))
            .await,
    );
    check(e, Code::NotFound, pb::ErrorReason::UnknownRoom, "room");
    let e = api_err(
        c.decode
            .finish(c.req(pb::FinishRequest {
                attach_id: id,
                room: ghost,
            }))
            .await,
    );
    check(e, Code::NotFound, pb::ErrorReason::UnknownRoom, "room");
    let r = c
        .decode
        .reserve(c.req(reserve(id, 4, 60_000)))
        .await
        .unwrap()
        .into_inner();
    let e = api_err(
        c.decode
            .abort(c.req(pb::AbortRequest {
                attach_id: id,
                room: r.room,
                reason: 99,
            }))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "reason",
    );
    let e = api_err(
        c.spec
            .report_steps(c.req(pb::SpecStepsRequest {
                attach_id: id,
                room: r.room,
                steps: vec![pb::SpecStep {
                    proposed: 0,
                    accepted: 0,
                }],
            }))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::SpecStepInvalid,
        "steps[0]",
    );
    let e = api_err(
        c.spec
            .report_steps(c.req(pb::SpecStepsRequest {
                attach_id: id,
                room: r.room,
                steps: vec![pb::SpecStep {
                    proposed: 2,
                    accepted: 1,
                }],
            }))
            .await,
    );
    check(
        e,
        Code::FailedPrecondition,
        pb::ErrorReason::RoomState,
        "room",
    );
    let e = api_err(
        c.decode
            .finish(c.req(pb::FinishRequest {
                attach_id: id,
                room: r.room,
            }))
            .await,
    );
    check(
        e,
        Code::FailedPrecondition,
        pb::ErrorReason::RoomState,
        "room",
    );
    // Prefill calls on a decode worker.
    let e = api_err(
        c.prefill
            .pages_ready(c.req(pb::PagesReadyRequest {
                attach_id: id,
                room: r.room,
                pages: vec![0],
                ..Default::default()
            }))
            .await,
    );
    check(e, Code::FailedPrecondition, pb::ErrorReason::WrongRole, "");
    // Tiers: validated first, then refused as not wired.
    let e = api_err(
        c.tiers
            .lookup(c.req(pb::LookupRequest {
                attach_id: id,
                prefix_hashes: vec![],
            }))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "prefix_hashes",
    );
    let e = api_err(
        c.tiers
            .lookup(c.req(pb::LookupRequest {
                attach_id: id,
                prefix_hashes: vec![vec![]],
            }))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "prefix_hashes",
    );
    let e = api_err(
        c.tiers
            .load(c.req(pb::LoadRequest {
                attach_id: id,
                prefix_hashes: vec![vec![1]],
                pages: vec![],
                pools: vec![],
            }))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "pages",
    );
    let e = api_err(
        c.tiers
            .load(c.req(pb::LoadRequest {
                attach_id: id,
                prefix_hashes: vec![vec![1]],
                pages: vec![4],
                pools: vec![],
            }))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::PageOutOfRange,
        "pages",
    );
    let e = api_err(
        c.tiers
            .load(c.req(pb::LoadRequest {
                attach_id: id,
                prefix_hashes: vec![vec![1]],
                pages: vec![0],
                pools: vec![3],
            }))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "pools[0]",
    );
    let e = api_err(
        c.tiers
            .lookup(c.req(pb::LookupRequest {
                attach_id: id,
                prefix_hashes: vec![vec![1]],
            }))
            .await,
    );
    check(
        e,
        Code::FailedPrecondition,
        pb::ErrorReason::TierUnavailable,
        "",
    );
    // EmitTokens: no request id is malformed; a source that hands out no DecodeWork refuses.
    let e = api_err(
        c.decode
            .emit_tokens(c.req(pb::EmitTokensRequest {
                attach_id: id,
                ..Default::default()
            }))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "request_id",
    );
    let e = api_err(
        c.decode
            .emit_tokens(c.req(pb::EmitTokensRequest {
                attach_id: id,
                request_id: 5,
                tokens: vec![1, 2],
                ..Default::default()
            }))
            .await,
    );
    check(e, Code::FailedPrecondition, pb::ErrorReason::WrongRole, "");
    let e = api_err(
        c.decode
            .emit_tokens(c.req(pb::EmitTokensRequest {
                attach_id: id + 7,
                request_id: 5,
                ..Default::default()
            }))
            .await,
    );
    check(
        e,
        Code::FailedPrecondition,
        pb::ErrorReason::NotAttached,
        "",
    );
    // SyncSession: no request id or no room is malformed; a room never reserved is unknown.
    let e = api_err(
        c.decode
            .sync_session(c.req(pb::SyncSessionRequest {
                attach_id: id,
                room: Some(pb::RoomRef {
                    room_id: 1,
                    generation: 1,
                }),
                pages: vec![0],
                ..Default::default()
            }))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "request_id",
    );
    let e = api_err(
        c.decode
            .sync_session(c.req(pb::SyncSessionRequest {
                attach_id: id,
                request_id: 5,
                pages: vec![0],
                ..Default::default()
            }))
            .await,
    );
    check(e, Code::InvalidArgument, pb::ErrorReason::Malformed, "room");
    let e = api_err(
        c.decode
            .sync_session(c.req(pb::SyncSessionRequest {
                attach_id: id,
                request_id: 5,
                room: Some(pb::RoomRef {
                    room_id: 999_999,
                    generation: 1,
                }),
                pages: vec![0],
                last: true,
                ..Default::default()
            }))
            .await,
    );
    check(e, Code::NotFound, pb::ErrorReason::UnknownRoom, "room");
    // The room is still there and the worker healthy.
    let h = c.health().await.unwrap();
    assert_eq!((h.pages_held, h.ready), (1, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_prefill_calls_and_out_of_range_pages_are_refused_typed() {
    let link = LocalLink::new(0, 0);
    let w = start_worker(
        worker_config(
            WorkerRole::Prefill,
            Shape {
                pages: 4,
                ..Shape::default()
            },
        ),
        Backend::Prefill(link.clone()),
        Options::default(),
    );
    let mut c = w.client().await;
    let att = c.attach(identity(&w.cfg)).await.unwrap();
    let id = att.id();
    let side = w.api.prefill_side().unwrap();
    let room = Some(pb::RoomRef {
        room_id: 3,
        generation: 1,
    });
    side.submit_work(pb::PrefillWork {
        room,
        request_id: 3,
        tokens: 20,
        deadline_ms: 1000,
        ..pb::PrefillWork::default()
    })
    .unwrap();
    let ready = |pages: Vec<u32>, layers: Option<pb::LayerRange>| pb::PagesReadyRequest {
        attach_id: id,
        room,
        pages,
        first_page: 0,
        layers,
        last: false,
    };
    let e = api_err(c.prefill.pages_ready(c.req(ready(vec![4], None))).await);
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::PageOutOfRange,
        "pages",
    );
    let e = api_err(
        c.prefill
            .pages_ready(c.req(ready(vec![u32::MAX], None)))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::PageOutOfRange,
        "pages",
    );
    let e = api_err(c.prefill.pages_ready(c.req(ready(vec![1, 1], None))).await);
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "pages",
    );
    let e = api_err(c.prefill.pages_ready(c.req(ready(vec![], None))).await);
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::Malformed,
        "pages",
    );
    let e = api_err(
        c.prefill
            .pages_ready(c.req(ready(vec![0], Some(pb::LayerRange { start: 2, end: 2 }))))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::LayerOutOfRange,
        "layers",
    );
    let e = api_err(
        c.prefill
            .pages_ready(c.req(ready(
                vec![0],
                Some(pb::LayerRange {
                    start: 0,
                    end: LAYERS + 1,
                }),
            )))
            .await,
    );
    check(
        e,
        Code::InvalidArgument,
        pb::ErrorReason::LayerOutOfRange,
        "layers",
    );
    let e = api_err(
        c.prefill
            .pages_ready(c.req(pb::PagesReadyRequest {
                room: None,
                ..ready(vec![0], None)
            }))
            .await,
    );
    check(e, Code::InvalidArgument, pb::ErrorReason::Malformed, "room");
    let other = Some(pb::RoomRef {
        room_id: 4,
        generation: 1,
    });
    let e = api_err(
        c.prefill
            .pages_ready(c.req(pb::PagesReadyRequest {
                room: other,
                ..ready(vec![0], None)
            }))
            .await,
    );
    check(e, Code::NotFound, pb::ErrorReason::UnknownRoom, "room");
    // A last PagesReady without pages ends a room's input: it too names an open room.
    let e = api_err(
        c.prefill
            .pages_ready(c.req(pb::PagesReadyRequest {
                room: other,
                last: true,
                ..ready(vec![], None)
            }))
            .await,
    );
    check(e, Code::NotFound, pb::ErrorReason::UnknownRoom, "room");
    // AwaitLayer is a LayerSplit rank's call.
    let e = api_err(
        c.prefill
            .await_layer(c.req(pb::AwaitLayerRequest {
                attach_id: id,
                room,
                layer: 1,
                pages: vec![0],
            }))
            .await,
    );
    check(e, Code::FailedPrecondition, pb::ErrorReason::WrongRole, "");
    let e = api_err(
        c.decode
            .reserve(c.req(pb::ReserveRequest {
                attach_id: id,
                request_id: 1,
                tokens: 1,
                kv_deadline_ms: 1,
                hand_off_token: 0,
            }))
            .await,
    );
    check(e, Code::FailedPrecondition, pb::ErrorReason::WrongRole, "");
    let e = api_err(
        c.decode
            .watch_work(c.req(pb::WatchDecodeWorkRequest { attach_id: id }))
            .await,
    );
    check(e, Code::FailedPrecondition, pb::ErrorReason::WrongRole, "");
    let e = api_err(
        c.decode
            .emit_tokens(c.req(pb::EmitTokensRequest {
                attach_id: id,
                request_id: 1,
                ..Default::default()
            }))
            .await,
    );
    check(e, Code::FailedPrecondition, pb::ErrorReason::WrongRole, "");
    // Nothing was begun: the room has no outstanding write and no page is held.
    assert_eq!(side.held_pages(), 0);
    assert!(c.health().await.unwrap().ready);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_both_sockets_leaves_the_worker_serving() {
    let w = start_worker(
        worker_config(
            WorkerRole::Decode,
            Shape {
                pages: 2,
                ..Shape::default()
            },
        ),
        Backend::Decode(Arc::new(ManualSource::default())),
        Options::default(),
    );
    // The pools socket: not JSON, an unknown op, a claim of an attach that does not exist.
    let pools = w.api.settings().pools_socket();
    for payload in [
        &b"\x00\xffnot json"[..],
        br#"{"op":"steal"}"#,
        br#"{"op":"claim","attach_id":9,"claim_token":1}"#,
    ] {
        let sock = rustix::net::socket(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            None,
        )
        .unwrap();
        rustix::net::connect(
            &sock,
            &rustix::net::SocketAddrUnix::new(pools.as_path()).unwrap(),
        )
        .unwrap();
        rustix::net::send(&sock, payload, rustix::net::SendFlags::empty()).unwrap();
        let (reply, fd): (tandem_worker::engine_api::fd_pass::PoolsResponse, _) =
            protocol::recv(sock.as_fd()).unwrap().unwrap();
        assert!(fd.is_none());
        match reply {
            tandem_worker::engine_api::fd_pass::PoolsResponse::Error { reason, .. } => {
                assert!(
                    reason == "MALFORMED" || reason == "NOT_ATTACHED",
                    "{reason}"
                )
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    // The gRPC socket: raw bytes that are not HTTP/2.
    let mut raw =
        std::os::unix::net::UnixStream::connect(w.api.settings().engine_socket()).unwrap();
    let _ = raw.write_all(b"GET / HTTP/1.1\r\n\r\n\x00\x01\x02garbage");
    drop(raw);
    let mut c = w.client().await;
    assert!(c.health().await.unwrap().ready);
    c.attach(identity(&w.cfg)).await.unwrap();
}
