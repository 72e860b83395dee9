//! The Rust client of the engine API: what the simulated engine and the tests use, and the model for
//! the Python client (DESIGN §3.1). It connects over the UNIX socket, attaches, claims the pool fds on
//! the pools socket and maps each pool (`MAP_SHARED`), so the engine reads and writes the same bytes
//! as the worker at the same page indices.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::mm::{MapFlags, ProtFlags};
use tonic::transport::{Channel, Endpoint};

use crate::memory::pool::{KvGeometry, PoolLayout, PoolRole};
use crate::store_client::socket_path::with_socket_address;

use super::error::ApiError;
use super::identity::kind_from_proto;
use super::{ENGINE_SOCKET, fd_pass, pb};

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server refused with a typed error.
    #[error("refused: {0}")]
    Api(ApiError),
    /// A status without a typed error (transport failure, cancel).
    #[error("call failed: {0}")]
    Status(tonic::Status),
    /// Connecting failed.
    #[error("cannot connect to {path}: {message}")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// Claiming or mapping the pools failed.
    #[error("pools: {0}")]
    Pools(String),
}

impl ClientError {
    /// The typed error, if the server sent one.
    pub fn api(&self) -> Option<&ApiError> {
        match self {
            ClientError::Api(e) => Some(e),
            _ => None,
        }
    }
}

impl From<tonic::Status> for ClientError {
    fn from(s: tonic::Status) -> Self {
        match ApiError::from_status(&s) {
            Some(e) => ClientError::Api(e),
            None => ClientError::Status(s),
        }
    }
}

/// One pool mapped into this process.
#[derive(Debug)]
pub struct MappedPool {
    /// Its role.
    pub role: PoolRole,
    /// Its descriptor.
    pub descriptor: pb::PoolDescriptor,
    geometry: KvGeometry,
    base: usize,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory owned by this handle; access goes through bounds-checked
// methods that copy.
unsafe impl Send for MappedPool {}
// SAFETY: as above.
unsafe impl Sync for MappedPool {}

impl MappedPool {
    fn map(fd: OwnedFd, d: pb::PoolDescriptor) -> Result<Self, ClientError> {
        let role = kind_from_proto(d.kind)
            .ok_or_else(|| ClientError::Pools(format!("unknown pool kind {}", d.kind)))?;
        let layout = match pb::PoolLayout::try_from(d.layout) {
            Ok(pb::PoolLayout::LayerFirst) => PoolLayout::LayerFirst,
            Ok(pb::PoolLayout::PageFirst) => PoolLayout::PageFirst,
            _ => return Err(ClientError::Pools(format!("unknown layout {}", d.layout))),
        };
        let geometry = KvGeometry {
            bytes_per_token_layer: d.bytes_per_token_layer,
            layers: d.layers,
            page_tokens: d.page_tokens,
            pages: d.page_count,
            layout,
        };
        let need = geometry.total_bytes().unwrap_or(u64::MAX);
        if need > d.map_length || geometry.chunk_bytes() != d.chunk_bytes {
            return Err(ClientError::Pools(format!(
                "{role} pool descriptor is inconsistent: {need} B of pages in a {} B mapping",
                d.map_length
            )));
        }
        let len = usize::try_from(d.map_length)
            .map_err(|_| ClientError::Pools("mapping too large".into()))?;
        // SAFETY: a fresh shared mapping at a kernel-chosen address aliases nothing in this process.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                d.map_offset,
            )
        }
        .map_err(|e| ClientError::Pools(format!("mmap of the {role} pool: {e}")))?;
        Ok(Self {
            role,
            descriptor: d,
            geometry,
            base: p as usize,
            len,
            fd,
        })
    }

    /// The fd the pool is mapped from (as received on the pools socket).
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// The pool's geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    fn chunk_at(&self, page: u32, layer: u32) -> Result<(usize, usize), ClientError> {
        let off = self.geometry.chunk_offset(page, layer).ok_or_else(|| {
            ClientError::Pools(format!(
                "page {page} layer {layer} is outside the {} pool",
                self.role
            ))
        })? as usize;
        Ok((off, self.geometry.chunk_bytes() as usize))
    }

    /// Copies `src` into the chunk of (`page`, `layer`) at `offset`.
    ///
    /// # Errors
    /// Out-of-range page, layer or length.
    pub fn write(
        &self,
        page: u32,
        layer: u32,
        offset: usize,
        src: &[u8],
    ) -> Result<(), ClientError> {
        let (off, len) = self.chunk_at(page, layer)?;
        if offset.checked_add(src.len()).is_none_or(|e| e > len) {
            return Err(ClientError::Pools("write leaves the chunk".into()));
        }
        // SAFETY: in bounds of the live mapping (checked); concurrent access to one page is governed
        // by the API's page ownership (Reserve/SafeToReuse, PagesReady/SourceFree).
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                (self.base + off + offset) as *mut u8,
                src.len(),
            );
        }
        Ok(())
    }

    /// Copies the chunk bytes of (`page`, `layer`) at `offset` into `dst`.
    ///
    /// # Errors
    /// As [`MappedPool::write`].
    pub fn read(
        &self,
        page: u32,
        layer: u32,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), ClientError> {
        let (off, len) = self.chunk_at(page, layer)?;
        if offset.checked_add(dst.len()).is_none_or(|e| e > len) {
            return Err(ClientError::Pools("read leaves the chunk".into()));
        }
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.base + off + offset) as *const u8,
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }
}

impl Drop for MappedPool {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours and whole; no reference into it outlives `self` (access copies).
        let _ = unsafe { rustix::mm::munmap(self.base as *mut _, self.len) };
    }
}

/// Dials the engine socket for tonic, through [`with_socket_address`] so that a path longer than
/// `sun_path` (a socket under a deep `$TANDEM_ROOT`) still connects.
#[derive(Debug, Clone)]
struct UdsConnector(PathBuf);

impl tonic::codegen::Service<tonic::codegen::http::Uri> for UdsConnector {
    type Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: tonic::codegen::http::Uri) -> Self::Future {
        let path = self.0.clone();
        Box::pin(async move {
            let std = tokio::task::spawn_blocking(move || {
                with_socket_address(&path, |a| std::os::unix::net::UnixStream::connect(a))
            })
            .await
            .map_err(std::io::Error::other)??;
            std.set_nonblocking(true)?;
            Ok(hyper_util::rt::TokioIo::new(
                tokio::net::UnixStream::from_std(std)?,
            ))
        })
    }
}

/// A live attach: the reply, the mapped pools, and the pools connection (closing it ends the attach).
#[derive(Debug)]
pub struct Attached {
    /// The Attach reply.
    pub reply: pb::AttachReply,
    /// The pools, in `fd_index` order.
    pub pools: Vec<MappedPool>,
    conn: Option<OwnedFd>,
}

impl Attached {
    /// The attach id.
    pub fn id(&self) -> u64 {
        self.reply.attach_id
    }

    /// The pool of `role`.
    pub fn pool(&self, role: PoolRole) -> Option<&MappedPool> {
        self.pools.iter().find(|p| p.role == role)
    }

    /// Closes the pools connection: the worker ends the attach (as if the engine exited).
    pub fn close(&mut self) {
        self.conn.take();
    }
}

/// A client of one worker's engine API.
#[derive(Debug, Clone)]
pub struct EngineClient {
    /// Session service.
    pub session: pb::session_client::SessionClient<Channel>,
    /// Decode service.
    pub decode: pb::decode_client::DecodeClient<Channel>,
    /// Prefill service.
    pub prefill: pb::prefill_client::PrefillClient<Channel>,
    /// Tier service.
    pub tiers: pb::tiers_client::TiersClient<Channel>,
    /// Spec service.
    pub spec: pb::spec_client::SpecClient<Channel>,
    call_timeout: Duration,
    socket_dir: PathBuf,
}

impl EngineClient {
    /// Connects to `<socket_dir>/engine.sock`; every unary call carries `call_timeout` as its
    /// deadline.
    ///
    /// # Errors
    /// [`ClientError::Connect`].
    pub async fn connect(socket_dir: &Path, call_timeout: Duration) -> Result<Self, ClientError> {
        let path = socket_dir.join(ENGINE_SOCKET);
        let err = |message: String| ClientError::Connect {
            path: path.clone(),
            message,
        };
        // The URI is a placeholder: the connector dials the socket path (any length).
        let channel = Endpoint::from_static("http://engine.sock")
            .connect_timeout(call_timeout)
            .connect_with_connector(UdsConnector(path.clone()))
            .await
            .map_err(|e| err(e.to_string()))?;
        Ok(Self {
            session: pb::session_client::SessionClient::new(channel.clone()),
            decode: pb::decode_client::DecodeClient::new(channel.clone()),
            prefill: pb::prefill_client::PrefillClient::new(channel.clone()),
            tiers: pb::tiers_client::TiersClient::new(channel.clone()),
            spec: pb::spec_client::SpecClient::new(channel),
            call_timeout,
            socket_dir: socket_dir.to_path_buf(),
        })
    }

    /// A request carrying the client's deadline.
    pub fn req<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        r.set_timeout(self.call_timeout);
        r
    }

    /// A request with an explicit deadline.
    pub fn req_within<T>(&self, msg: T, deadline: Duration) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        r.set_timeout(deadline);
        r
    }

    /// Attach only (no claim): the reply.
    ///
    /// # Errors
    /// The server's refusal.
    pub async fn attach_only(
        &mut self,
        identity: pb::EngineIdentity,
    ) -> Result<pb::AttachReply, ClientError> {
        let r = self.req(pb::AttachRequest {
            identity: Some(identity),
        });
        Ok(self.session.attach(r).await?.into_inner())
    }

    /// Attaches, claims the fds on the pools socket of this client's socket directory (the
    /// directory as this process sees it; the reply's `pools_socket` is the worker's view of the
    /// same file, which may be mounted elsewhere) and maps every pool.
    ///
    /// # Errors
    /// The server's refusal; [`ClientError::Pools`] when claiming or mapping fails.
    pub async fn attach(&mut self, identity: pb::EngineIdentity) -> Result<Attached, ClientError> {
        let reply = self.attach_only(identity).await?;
        let path = self.socket_dir.join(super::POOLS_SOCKET);
        let (id, token) = (reply.attach_id, reply.claim_token);
        let (conn, fds) = tokio::task::spawn_blocking(move || fd_pass::claim(&path, id, token))
            .await
            .map_err(|e| ClientError::Pools(e.to_string()))?
            .map_err(|e| ClientError::Pools(e.to_string()))?;
        if fds.len() != reply.pools.len() {
            return Err(ClientError::Pools(format!(
                "{} fds for {} pools",
                fds.len(),
                reply.pools.len()
            )));
        }
        let mut pools = Vec::new();
        for ((_, fd), d) in fds.into_iter().zip(reply.pools.iter().cloned()) {
            pools.push(MappedPool::map(fd, d)?);
        }
        Ok(Attached {
            reply,
            pools,
            conn: Some(conn),
        })
    }

    /// Detach: the worker ends the attach (its live rooms fail through the release path).
    ///
    /// # Errors
    /// The server's refusal (`NOT_ATTACHED`) or the call's failure.
    pub async fn detach(&mut self, attach_id: u64) -> Result<(), ClientError> {
        let r = self.req(pb::DetachRequest { attach_id });
        self.session.detach(r).await?;
        Ok(())
    }

    /// Health.
    ///
    /// # Errors
    /// The call's failure.
    pub async fn health(&mut self) -> Result<pb::HealthReply, ClientError> {
        let r = self.req(pb::HealthRequest {});
        Ok(self.session.health(r).await?.into_inner())
    }
}
