//! The engine-API server: tonic on a UNIX stream socket (`<dir>/engine.sock`) plus the pools socket
//! (`<dir>/pools.sock`), and the deadline rule of every call.
//!
//! Deadlines (engine.proto, "Deadlines"): a unary call runs for at most the shorter of the client's
//! `grpc-timeout` and [`EngineApiConfig::max_call`](super::EngineApiConfig::max_call); past it the
//! call answers DEADLINE_EXCEEDED with reason `DEADLINE_EXCEEDED`. The answer is sent
//! [`DEADLINE_MARGIN`] before the client's deadline so that the typed status, not a transport
//! cancel, reaches the client. A server stream with a `grpc-timeout` ends at it with the same status.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tokio_stream::wrappers::{UnboundedReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status};

use crate::release::RoomKey;
use crate::store_client::socket_path::with_socket_address;

use super::decode::cause_from_wire;
use super::error::ApiError;
use super::fd_pass::PoolsSocket;
use super::identity::kind_from_proto;
use super::pb;
use super::service::{EngineApi, WeakClaims};
use super::tiers::{LoadJob, check_hashes};

/// How long before the client's deadline a call answers DEADLINE_EXCEEDED (at most 10 % of it).
pub const DEADLINE_MARGIN: Duration = Duration::from_millis(5);

/// Parses a `grpc-timeout` header value (`<1..8 digits><H|M|S|m|u|n>`, gRPC over HTTP/2 spec);
/// `None` for anything else.
pub fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The client's deadline of a request, if it sent one.
pub fn client_deadline<T>(req: &Request<T>) -> Option<Duration> {
    req.metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_grpc_timeout)
}

fn budget(client: Option<Duration>, max: Duration) -> Duration {
    match client {
        Some(c) => {
            let margin = DEADLINE_MARGIN.min(c / 10);
            c.saturating_sub(margin).min(max)
        }
        None => max,
    }
}

/// Runs `fut` within the call's budget.
async fn bounded<T>(
    what: &str,
    budget: Duration,
    fut: impl std::future::Future<Output = Result<T, ApiError>>,
) -> Result<T, Status> {
    match tokio::time::timeout(budget, fut).await {
        Ok(r) => r.map_err(Status::from),
        Err(_) => Err(ApiError::deadline(what, budget).into()),
    }
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// A stream of `rx`'s events that ends with DEADLINE_EXCEEDED at the client's deadline, if any.
fn stream_of<T: Send + 'static>(
    what: &'static str,
    rx: mpsc::UnboundedReceiver<T>,
    deadline: Option<Duration>,
) -> EventStream<T> {
    let Some(d) = deadline else {
        return Box::pin(tokio_stream::StreamExt::map(
            UnboundedReceiverStream::new(rx),
            Ok::<T, Status>,
        ));
    };
    let budget = budget(Some(d), d);
    let (tx, out) = mpsc::unbounded_channel();
    let mut rx = rx;
    tokio::spawn(async move {
        let sleep = tokio::time::sleep(budget);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                () = &mut sleep => {
                    let _ = tx.send(Err(ApiError::deadline(what, budget).into()));
                    return;
                }
                e = rx.recv() => match e {
                    Some(e) => if tx.send(Ok(e)).is_err() { return },
                    None => return,
                },
                () = tx.closed() => return,
            }
        }
    });
    Box::pin(UnboundedReceiverStream::new(out))
}

fn room(r: Option<pb::RoomRef>) -> Result<RoomKey, ApiError> {
    r.map(RoomKey::from)
        .ok_or_else(|| ApiError::malformed("room", "the room is missing"))
}

impl From<pb::RoomRef> for RoomKey {
    fn from(r: pb::RoomRef) -> Self {
        RoomKey::new(r.room_id, r.generation)
    }
}

impl From<RoomKey> for pb::RoomRef {
    fn from(k: RoomKey) -> Self {
        pb::RoomRef {
            room_id: k.room.0,
            generation: k.generation.0,
        }
    }
}

/// The tonic services over one [`EngineApi`].
#[derive(Debug, Clone)]
pub struct Services(pub Arc<EngineApi>);

impl Services {
    fn max(&self) -> Duration {
        self.0.settings().max_call
    }
}

#[tonic::async_trait]
impl pb::session_server::Session for Services {
    async fn attach(
        &self,
        req: Request<pb::AttachRequest>,
    ) -> Result<Response<pb::AttachReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let api = self.0.clone();
        let r = req.into_inner();
        // Allocation and registration may block (store-client IPC): off the async workers.
        let work = tokio::task::spawn_blocking(move || api.attach(&r));
        bounded("Attach", b, async move {
            work.await
                .map_err(|e| ApiError::internal(format!("attach task: {e}")))?
        })
        .await
        .map(Response::new)
    }

    async fn detach(
        &self,
        req: Request<pb::DetachRequest>,
    ) -> Result<Response<pb::DetachReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("Detach", b, async { self.0.detach(r.attach_id) })
            .await
            .map(Response::new)
    }

    async fn health(
        &self,
        _req: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        Ok(Response::new(self.0.health()))
    }
}

#[tonic::async_trait]
impl pb::decode_server::Decode for Services {
    async fn reserve(
        &self,
        req: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("Reserve", b, async {
            let d = self.0.decode(r.attach_id)?;
            let got = d.reserve_handed(
                r.attach_id,
                r.request_id,
                r.tokens,
                Duration::from_millis(r.kv_deadline_ms),
                r.hand_off_token,
            )?;
            Ok(pb::ReserveReply {
                room: Some(got.key.into()),
                pages: got.pages,
                after_release: got.after_release,
            })
        })
        .await
        .map(Response::new)
    }

    async fn await_kv(
        &self,
        req: Request<pb::AwaitKvRequest>,
    ) -> Result<Response<pb::AwaitKvReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("AwaitKv", b, async {
            let d = self.0.decode(r.attach_id)?;
            d.await_kv(r.attach_id, room(r.room)?).await
        })
        .await
        .map(Response::new)
    }

    async fn finish(
        &self,
        req: Request<pb::FinishRequest>,
    ) -> Result<Response<pb::ReleaseReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("Finish", b, async {
            let d = self.0.decode(r.attach_id)?;
            let released = d.finish(r.attach_id, room(r.room)?)?;
            Ok(pb::ReleaseReply { released })
        })
        .await
        .map(Response::new)
    }

    async fn abort(
        &self,
        req: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::ReleaseReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("Abort", b, async {
            let d = self.0.decode(r.attach_id)?;
            let cause = cause_from_wire(r.reason)?;
            let released = d.abort(r.attach_id, room(r.room)?, cause)?;
            Ok(pb::ReleaseReply { released })
        })
        .await
        .map(Response::new)
    }

    type WatchWorkStream = EventStream<pb::DecodeWork>;

    async fn watch_work(
        &self,
        req: Request<pb::WatchDecodeWorkRequest>,
    ) -> Result<Response<EventStream<pb::DecodeWork>>, Status> {
        let deadline = client_deadline(&req);
        let d = self.0.decode(req.get_ref().attach_id)?;
        Ok(Response::new(stream_of(
            "WatchWork",
            d.work().watch(),
            deadline,
        )))
    }

    async fn emit_tokens(
        &self,
        req: Request<pb::EmitTokensRequest>,
    ) -> Result<Response<pb::EmitTokensReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("EmitTokens", b, async {
            let d = self.0.decode(r.attach_id)?;
            if r.request_id == 0 {
                return Err(ApiError::malformed(
                    "request_id",
                    "EmitTokens names no request",
                ));
            }
            let cancelled = d.source().emit_tokens(&r)?;
            Ok(pb::EmitTokensReply { cancelled })
        })
        .await
        .map(Response::new)
    }

    async fn sync_session(
        &self,
        req: Request<pb::SyncSessionRequest>,
    ) -> Result<Response<pb::SyncSessionReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("SyncSession", b, async {
            let d = self.0.decode(r.attach_id)?;
            let key = room(r.room)?;
            // Whole pages are copied: off the runtime that serves the other engine calls.
            tokio::task::spawn_blocking(move || {
                d.sync_session(r.attach_id, r.request_id, r.attempt, key, &r.pages, r.last)
            })
            .await
            .map_err(|e| {
                ApiError::new(
                    tonic::Code::Internal,
                    pb::ErrorReason::Unspecified,
                    e.to_string(),
                )
            })?
        })
        .await
        .map(Response::new)
    }

    type WatchReleasesStream = EventStream<pb::SafeToReuse>;

    async fn watch_releases(
        &self,
        req: Request<pb::WatchReleasesRequest>,
    ) -> Result<Response<Self::WatchReleasesStream>, Status> {
        let deadline = client_deadline(&req);
        let d = self.0.decode(req.get_ref().attach_id)?;
        Ok(Response::new(stream_of(
            "WatchReleases",
            d.releases().watch(),
            deadline,
        )))
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for Services {
    type WatchWorkStream = EventStream<pb::PrefillWork>;

    async fn watch_work(
        &self,
        req: Request<pb::WatchWorkRequest>,
    ) -> Result<Response<Self::WatchWorkStream>, Status> {
        let deadline = client_deadline(&req);
        let p = self.0.prefill(req.get_ref().attach_id)?;
        Ok(Response::new(stream_of(
            "WatchWork",
            p.work().watch(),
            deadline,
        )))
    }

    async fn pages_ready(
        &self,
        req: Request<pb::PagesReadyRequest>,
    ) -> Result<Response<pb::PagesReadyReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("PagesReady", b, async {
            let p = self.0.prefill(r.attach_id)?;
            let accepted = p.pages_ready(r.attach_id, &r)?;
            Ok(pb::PagesReadyReply { accepted })
        })
        .await
        .map(Response::new)
    }

    async fn await_layer(
        &self,
        req: Request<pb::AwaitLayerRequest>,
    ) -> Result<Response<pb::AwaitLayerReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("AwaitLayer", b, async {
            let p = self.0.prefill(r.attach_id)?;
            // Blocks (within the call's budget, less a margin so that the typed answer comes
            // first): off the runtime.
            let within = b.saturating_sub(b / 10);
            tokio::task::spawn_blocking(move || p.await_layer(&r, within))
                .await
                .map_err(|e| ApiError::internal(format!("AwaitLayer task: {e}")))?
        })
        .await
        .map(Response::new)
    }

    type WatchSourceFreeStream = EventStream<pb::SourceFree>;

    async fn watch_source_free(
        &self,
        req: Request<pb::WatchSourceFreeRequest>,
    ) -> Result<Response<Self::WatchSourceFreeStream>, Status> {
        let deadline = client_deadline(&req);
        let p = self.0.prefill(req.get_ref().attach_id)?;
        Ok(Response::new(stream_of(
            "WatchSourceFree",
            p.source_free().watch(),
            deadline,
        )))
    }
}

#[tonic::async_trait]
impl pb::tiers_server::Tiers for Services {
    async fn lookup(
        &self,
        req: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("Lookup", b, async {
            self.0.check_attach(r.attach_id)?;
            check_hashes(&r.prefix_hashes)?;
            let hits = self.0.tiers().lookup(&r.prefix_hashes)?;
            Ok(pb::LookupReply { hits })
        })
        .await
        .map(Response::new)
    }

    type LoadStream = EventStream<pb::LoadEvent>;

    async fn load(
        &self,
        req: Request<pb::LoadRequest>,
    ) -> Result<Response<Self::LoadStream>, Status> {
        let deadline = client_deadline(&req);
        let r = req.into_inner();
        self.0.check_attach(r.attach_id)?;
        check_hashes(&r.prefix_hashes)?;
        if r.pages.len() != r.prefix_hashes.len() {
            return Err(ApiError::malformed(
                "pages",
                format!(
                    "{} pages for {} hashes; one page per hash",
                    r.pages.len(),
                    r.prefix_hashes.len()
                ),
            )
            .into());
        }
        super::error::check_pages(&r.pages, self.0.pools().pages())?;
        let mut pools = Vec::new();
        for (i, k) in r.pools.iter().enumerate() {
            let role = kind_from_proto(*k).ok_or_else(|| {
                ApiError::malformed(&format!("pools[{i}]"), format!("pool kind {k} is unknown"))
            })?;
            if self.0.pools().pool(role).is_none() {
                return Err(ApiError::malformed(
                    &format!("pools[{i}]"),
                    format!("the {role} pool is not attached"),
                )
                .into());
            }
            pools.push(role);
        }
        if pools.is_empty() {
            pools.push(crate::memory::pool::PoolRole::Target);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        self.0.tiers().load(
            LoadJob {
                hashes: r.prefix_hashes,
                pages: r.pages,
                pools,
            },
            tx,
        )?;
        Ok(Response::new(stream_of("Load", rx, deadline)))
    }

    async fn store(
        &self,
        req: Request<pb::StoreRequest>,
    ) -> Result<Response<pb::StoreReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("Store", b, async {
            self.0.check_attach(r.attach_id)?;
            check_hashes(&r.prefix_hashes)?;
            if r.pages.len() != r.prefix_hashes.len() {
                return Err(ApiError::malformed("pages", "one page per hash"));
            }
            super::error::check_pages(&r.pages, self.0.pools().pages())?;
            let pages = self.0.tiers().store(&r.prefix_hashes, &r.pages)?;
            Ok(pb::StoreReply { pages })
        })
        .await
        .map(Response::new)
    }
}

#[tonic::async_trait]
impl pb::spec_server::Spec for Services {
    async fn report_steps(
        &self,
        req: Request<pb::SpecStepsRequest>,
    ) -> Result<Response<pb::SpecStepsReply>, Status> {
        let b = budget(client_deadline(&req), self.max());
        let r = req.into_inner();
        bounded("ReportSteps", b, async {
            let d = self.0.decode(r.attach_id)?;
            d.report_steps(r.attach_id, room(r.room)?, &r.steps)
        })
        .await
        .map(Response::new)
    }
}

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Binding a socket failed.
    #[error("engine API socket {path}: {source}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// A running engine-API server. [`RunningServer::stop`] (or drop) ends the live attach, stops both
/// sockets and removes their files.
#[derive(Debug)]
pub struct RunningServer {
    api: Arc<EngineApi>,
    pools: PoolsSocket,
    engine_socket: PathBuf,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Starts the server of `api` on its socket directory (created if missing). Must run inside a tokio
/// runtime.
///
/// # Errors
/// [`ServerError::Bind`].
pub fn start(api: Arc<EngineApi>) -> Result<RunningServer, ServerError> {
    let dir = api.settings().socket_dir.clone();
    let engine_socket = api.settings().engine_socket();
    let bind_err = |path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| ServerError::Bind { path, source }
    };
    std::fs::create_dir_all(&dir).map_err(bind_err(&dir))?;
    if let Ok(meta) = std::fs::symlink_metadata(&engine_socket) {
        use std::os::unix::fs::FileTypeExt;
        if meta.file_type().is_socket() {
            std::fs::remove_file(&engine_socket).map_err(bind_err(&engine_socket))?;
        }
    }
    let std_listener = with_socket_address(&engine_socket, |a| {
        std::os::unix::net::UnixListener::bind(a)
    })
    .map_err(bind_err(&engine_socket))?;
    std_listener
        .set_nonblocking(true)
        .map_err(bind_err(&engine_socket))?;
    let listener =
        tokio::net::UnixListener::from_std(std_listener).map_err(bind_err(&engine_socket))?;
    let pools_path = api.settings().pools_socket();
    let pools = PoolsSocket::start(&pools_path, Arc::new(WeakClaims(Arc::downgrade(&api))))
        .map_err(|e| ServerError::Bind {
            path: e.path,
            source: e.source,
        })?;
    let (tx, rx) = oneshot::channel::<()>();
    let svc = Services(api.clone());
    let task = tokio::spawn(async move {
        let result = tonic::transport::Server::builder()
            .add_service(pb::session_server::SessionServer::new(svc.clone()))
            .add_service(pb::decode_server::DecodeServer::new(svc.clone()))
            .add_service(pb::prefill_server::PrefillServer::new(svc.clone()))
            .add_service(pb::tiers_server::TiersServer::new(svc.clone()))
            .add_service(pb::spec_server::SpecServer::new(svc))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = rx.await;
            })
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "engine API server failed");
        }
    });
    tracing::info!(socket = %engine_socket.display(), pools = %pools_path.display(), "engine API serving");
    Ok(RunningServer {
        api,
        pools,
        engine_socket,
        shutdown: Some(tx),
        task: Some(task),
    })
}

impl RunningServer {
    /// The API.
    pub fn api(&self) -> &Arc<EngineApi> {
        &self.api
    }

    /// Ends the live attach (its rooms fail through the gate), stops serving and removes the
    /// socket files. Idempotent.
    pub async fn stop(&mut self) {
        self.api.shutdown();
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        self.pools.stop();
        let _ = std::fs::remove_file(&self.engine_socket);
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.api.shutdown();
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.pools.stop();
        let _ = std::fs::remove_file(&self.engine_socket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_parses_every_unit_and_refuses_garbage() {
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse_grpc_timeout("40m"), Some(Duration::from_millis(40)));
        assert_eq!(parse_grpc_timeout("5u"), Some(Duration::from_micros(5)));
        assert_eq!(
            parse_grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "m", "10", "123456789S", "1x", "-1S", "1.5S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_budget_answers_before_the_client_and_never_past_the_maximum() {
        let max = Duration::from_secs(30);
        assert_eq!(budget(None, max), max);
        assert_eq!(budget(Some(Duration::from_secs(60)), max), max);
        assert_eq!(
            budget(Some(Duration::from_millis(200)), max),
            Duration::from_millis(195)
        );
        assert_eq!(
            budget(Some(Duration::from_millis(20)), max),
            Duration::from_millis(18)
        );
    }
}
