//! The verbs wrapper: the only `unsafe` code of the RDMA transport (feature `rdma`).
//!
//! Raw `ibverbs-sys` types, because ibverbs 0.9's safe API posts only `IBV_WR_SEND`, keeps its
//! QP/MR pointers private and does not re-export its `ffi` module. Each object owns one verbs
//! resource and releases it on drop, holding an `Arc` of the object it was created from, so the
//! destruction order is the one verbs requires (QP before CQ and PD, MR before PD, everything
//! before the device context). `ibv_post_send` and `ibv_poll_cq` are `static inline` in `verbs.h`;
//! they are called through the provider's ops table (`(*ctx).ops`), as ibverbs itself does.
//!
//! Thread safety: libibverbs verbs are thread-safe on one context (rdma-core
//! `Documentation/libibverbs.md`), so the handles are `Send + Sync`; the transport still serialises
//! posting per QP (its ledger lock) to keep `wr_id` order equal to posting order.

use std::ffi::CStr;
use std::io;
use std::ptr;
use std::sync::Arc;

use ibverbs_sys as ffi;

use super::RdmaError;
use super::completions::{WcStatus, WrSpec};
use super::endpoint::RdmaEndpoint;
use crate::memory::pool::KvPool;

/// Memory the device may read (as a write source) or the peer may write (as a receive region).
///
/// # Safety
/// Implementors guarantee that [`RdmaMemory::host_range`] is host memory, mapped, readable and
/// writable for as long as the value lives (the transport keeps an `Arc` of it next to the
/// registration), and that other code tolerates the device writing into it at any time while it
/// is registered (the release gate decides when pages may be reused).
pub unsafe trait RdmaMemory: Send + Sync {
    /// Start and length of the range.
    ///
    /// # Errors
    /// A description when the memory is not host-addressable (e.g. a device pool without
    /// GPUDirect support, DESIGN contract 1).
    fn host_range(&self) -> Result<(*mut u8, usize), String>;
}

// SAFETY: a `KvPool` owns its buffer for its whole life and never remaps it; `host_ptr` refuses the
// device domain. Writes by the device land only in pages the release gate handed to a room.
unsafe impl RdmaMemory for KvPool {
    fn host_range(&self) -> Result<(*mut u8, usize), String> {
        let buffer = self.buffer();
        let ptr = buffer.host_ptr().map_err(|e| e.to_string())?;
        Ok((ptr, buffer.len()))
    }
}

fn last_os_error_or(fallback: &str) -> io::Error {
    let e = io::Error::last_os_error();
    if e.raw_os_error().is_some_and(|c| c != 0) {
        e
    } else {
        io::Error::other(fallback.to_string())
    }
}

/// An open device context and the attributes of the port in use.
pub(crate) struct Context {
    ctx: *mut ffi::ibv_context,
    pub(crate) name: String,
    pub(crate) port: u8,
    pub(crate) lid: u16,
    /// All zero when no GID index is used (InfiniBand LID routing).
    pub(crate) gid: [u8; 16],
    pub(crate) gid_index: Option<u8>,
    pub(crate) active_mtu: u32,
    pub(crate) max_msg_bytes: u64,
    pub(crate) max_qp_wr: u32,
    pub(crate) max_mr_size: u64,
}

// SAFETY: verbs on one context are thread-safe (module docs); the pointer is owned and freed once.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Opens device `name` (or the first one) and queries `port`. A GID is used when `gid_index`
    /// is given, or at index 0 on an Ethernet (RoCE) link, which needs a GRH.
    pub(crate) fn open(
        name: Option<&str>,
        port: u8,
        gid_index: Option<u8>,
    ) -> Result<Arc<Context>, RdmaError> {
        let mut count = 0i32;
        // SAFETY: `count` is a valid out-pointer; the list is freed below on every path.
        let list = unsafe { ffi::ibv_get_device_list(&mut count) };
        if list.is_null() {
            return Err(RdmaError::List(last_os_error_or("ibv_get_device_list")));
        }
        let mut chosen: Option<(*mut ffi::ibv_device, String)> = None;
        for i in 0..count.max(0) as usize {
            // SAFETY: the list holds `count` non-null device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: `dev` is a listed device; the name is a NUL-terminated string it owns.
            let dev_name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) }
                .to_string_lossy()
                .into_owned();
            if name.is_none_or(|n| n == dev_name) {
                chosen = Some((dev, dev_name));
                break;
            }
        }
        let opened = chosen.map(|(dev, dev_name)| {
            // SAFETY: `dev` comes from the live list (opening before freeing it is required).
            (unsafe { ffi::ibv_open_device(dev) }, dev_name)
        });
        // SAFETY: `list` came from ibv_get_device_list; an opened context stays valid after this.
        unsafe { ffi::ibv_free_device_list(list) };
        let Some((ctx, dev_name)) = opened else {
            return Err(RdmaError::NoDevice(name.map(str::to_string)));
        };
        let verbs_err = |step, source| RdmaError::Verbs {
            device: dev_name.clone(),
            step,
            source,
        };
        if ctx.is_null() {
            return Err(verbs_err("ibv_open_device", last_os_error_or("open")));
        }
        let mut context = Context {
            ctx,
            name: dev_name.clone(),
            port,
            lid: 0,
            gid: [0; 16],
            gid_index: None,
            active_mtu: 0,
            max_msg_bytes: 0,
            max_qp_wr: 0,
            max_mr_size: 0,
        };
        let mut dev_attr = ffi::ibv_device_attr::default();
        // SAFETY: `ctx` is open; `dev_attr` is a valid out-pointer of the right type.
        let rc = unsafe { ffi::ibv_query_device(ctx, &mut dev_attr) };
        if rc != 0 {
            return Err(verbs_err(
                "ibv_query_device",
                io::Error::from_raw_os_error(rc),
            ));
        }
        let mut port_attr = ffi::ibv_port_attr::default();
        // SAFETY: the exported `ibv_query_port` fills a prefix of `ibv_port_attr` (the compat
        // layout); the buffer is the full, zeroed struct, as ibverbs passes it.
        let rc = unsafe {
            ffi::ibv_query_port(
                ctx,
                port,
                (&mut port_attr as *mut ffi::ibv_port_attr).cast(),
            )
        };
        if rc != 0 {
            return Err(verbs_err(
                "ibv_query_port",
                io::Error::from_raw_os_error(rc),
            ));
        }
        if port_attr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(RdmaError::PortDown {
                device: dev_name,
                port,
                state: port_attr.state,
            });
        }
        let ethernet = u32::from(port_attr.link_layer) == ffi::IBV_LINK_LAYER_ETHERNET;
        let gid_index = gid_index.or(ethernet.then_some(0));
        if let Some(index) = gid_index {
            let mut gid = ffi::ibv_gid::default();
            // SAFETY: `ctx` is open; `gid` is a valid out-pointer.
            let rc = unsafe { ffi::ibv_query_gid(ctx, port, i32::from(index), &mut gid) };
            if rc != 0 {
                return Err(verbs_err("ibv_query_gid", io::Error::from_raw_os_error(rc)));
            }
            // SAFETY: every 16-byte pattern is a valid `raw` view of the GID union.
            context.gid = unsafe { gid.raw };
        }
        context.lid = port_attr.lid;
        context.gid_index = gid_index;
        context.active_mtu = port_attr.active_mtu;
        context.max_msg_bytes = u64::from(port_attr.max_msg_sz);
        context.max_qp_wr = dev_attr.max_qp_wr.max(1) as u32;
        context.max_mr_size = dev_attr.max_mr_size;
        Ok(Arc::new(context))
    }

    fn err(&self, step: &'static str, source: io::Error) -> RdmaError {
        RdmaError::Verbs {
            device: self.name.clone(),
            step,
            source,
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened in `open`, closed once; every child holds an `Arc<Context>`.
        let rc = unsafe { ffi::ibv_close_device(self.ctx) };
        if rc != 0 {
            tracing::error!(device = %self.name, rc, "ibv_close_device failed");
        }
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pd: *mut ffi::ibv_pd,
    pub(crate) ctx: Arc<Context>,
}

// SAFETY: see `Context`.
unsafe impl Send for Pd {}
// SAFETY: see `Context`.
unsafe impl Sync for Pd {}

impl Pd {
    pub(crate) fn alloc(ctx: &Arc<Context>) -> Result<Arc<Pd>, RdmaError> {
        // SAFETY: `ctx` is open.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.ctx) };
        if pd.is_null() {
            return Err(ctx.err("ibv_alloc_pd", last_os_error_or("alloc_pd")));
        }
        Ok(Arc::new(Pd {
            pd,
            ctx: ctx.clone(),
        }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc`; MRs and QPs hold an `Arc<Pd>`, so none is left.
        let rc = unsafe { ffi::ibv_dealloc_pd(self.pd) };
        if rc != 0 {
            tracing::error!(rc, "ibv_dealloc_pd failed");
        }
    }
}

/// A memory registration over existing memory (`IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE`).
pub(crate) struct Mr {
    mr: *mut ffi::ibv_mr,
    _pd: Arc<Pd>,
    _memory: Arc<dyn RdmaMemory>,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
}

// SAFETY: see `Context`; the registered memory is owned by `_memory`.
unsafe impl Send for Mr {}
// SAFETY: see `Context`.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers bytes `[offset, offset + len)` of `memory`.
    pub(crate) fn register(
        pd: &Arc<Pd>,
        memory: &Arc<dyn RdmaMemory>,
        offset: usize,
        len: usize,
    ) -> Result<Mr, RdmaError> {
        let (base, total) = memory.host_range().map_err(RdmaError::Memory)?;
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > total) {
            return Err(RdmaError::Memory(format!(
                "range {offset}+{len} outside memory of {total} B"
            )));
        }
        // SAFETY: `offset + len <= total`, so the pointer stays inside the range `RdmaMemory`
        // promises is valid while `memory` (kept in the `Mr`) lives.
        let addr = unsafe { base.add(offset) };
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        // SAFETY: `pd` is live; `[addr, addr + len)` is valid memory (above) that outlives the MR.
        let mr = unsafe { ffi::ibv_reg_mr(pd.pd, addr.cast(), len, access.0 as i32) };
        if mr.is_null() {
            return Err(pd.ctx.err("ibv_reg_mr", last_os_error_or("reg_mr")));
        }
        // SAFETY: `mr` is a valid registration returned just now.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(Mr {
            mr,
            _pd: pd.clone(),
            _memory: memory.clone(),
            addr: addr as u64,
            len: len as u64,
            lkey,
            rkey,
        })
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once, before `_memory` is released.
        let rc = unsafe { ffi::ibv_dereg_mr(self.mr) };
        if rc != 0 {
            tracing::error!(rc, addr = self.addr, "ibv_dereg_mr failed");
        }
    }
}

/// Completions taken per `ibv_poll_cq` call.
pub(crate) const POLL_BATCH: usize = 32;

/// A completion queue (one per queue pair, sized to its send queue).
pub(crate) struct Cq {
    cq: *mut ffi::ibv_cq,
    ctx: Arc<Context>,
}

// SAFETY: see `Context`.
unsafe impl Send for Cq {}
// SAFETY: see `Context`.
unsafe impl Sync for Cq {}

impl Cq {
    pub(crate) fn create(ctx: &Arc<Context>, entries: u32) -> Result<Arc<Cq>, RdmaError> {
        let entries = i32::try_from(entries).unwrap_or(i32::MAX);
        // SAFETY: `ctx` is open; no completion channel, no context pointer.
        let cq =
            unsafe { ffi::ibv_create_cq(ctx.ctx, entries, ptr::null_mut(), ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(ctx.err("ibv_create_cq", last_os_error_or("create_cq")));
        }
        Ok(Arc::new(Cq {
            cq,
            ctx: ctx.clone(),
        }))
    }

    /// Polls up to [`POLL_BATCH`] completions into `out` as `(wr_id, status)`.
    pub(crate) fn poll(&self, out: &mut Vec<(u64, WcStatus)>) -> io::Result<()> {
        let mut wcs = [ffi::ibv_wc::default(); POLL_BATCH];
        // SAFETY: `cq` is live; its context's ops table is filled by the provider at open time.
        let poll_cq = unsafe { (*(*self.cq).context).ops.poll_cq };
        let poll_cq = poll_cq.ok_or_else(|| io::Error::other("provider has no poll_cq"))?;
        // SAFETY: `wcs` holds `POLL_BATCH` entries; the provider writes at most that many.
        let n = unsafe { poll_cq(self.cq, POLL_BATCH as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(io::Error::other(format!("ibv_poll_cq returned {n}")));
        }
        for wc in &wcs[..n as usize] {
            out.push((wc.wr_id(), wc_status(wc)));
        }
        Ok(())
    }
}

fn wc_status(wc: &ffi::ibv_wc) -> WcStatus {
    use ffi::ibv_wc_status as s;
    match wc.error() {
        None => WcStatus::Success,
        Some((status, _vendor)) => match status {
            s::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
            s::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
            s::IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequest,
            s::IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
            s::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
            s::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
            other => WcStatus::Other(other),
        },
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created in `create`; the QP using it holds an `Arc<Cq>` and is destroyed first.
        let rc = unsafe { ffi::ibv_destroy_cq(self.cq) };
        if rc != 0 {
            tracing::error!(device = %self.ctx.name, rc, "ibv_destroy_cq failed");
        }
    }
}

/// `ibv_post_send` stopped at request `posted` (the ones before it were posted).
#[derive(Debug, thiserror::Error)]
#[error("ibv_post_send accepted {posted} request(s): {source}")]
pub(crate) struct PostError {
    pub(crate) posted: usize,
    pub(crate) source: io::Error,
}

/// An RC queue pair for RDMA WRITE.
pub(crate) struct Qp {
    qp: *mut ffi::ibv_qp,
    _cq: Arc<Cq>,
    pd: Arc<Pd>,
    pub(crate) qp_num: u32,
}

// SAFETY: see `Context`; posting is serialised by the caller.
unsafe impl Send for Qp {}
// SAFETY: see `Context`.
unsafe impl Sync for Qp {}

impl Qp {
    /// A queue pair in RESET with a send queue of `max_send_wr` requests (one SGE each).
    pub(crate) fn create(pd: &Arc<Pd>, cq: &Arc<Cq>, max_send_wr: u32) -> Result<Qp, RdmaError> {
        let mut attr = ffi::ibv_qp_init_attr {
            send_cq: cq.cq,
            recv_cq: cq.cq,
            cap: ffi::ibv_qp_cap {
                max_send_wr,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: `pd` and `cq` are live; `attr` is a valid init attribute.
        let qp = unsafe { ffi::ibv_create_qp(pd.pd, &mut attr) };
        if qp.is_null() {
            return Err(pd.ctx.err("ibv_create_qp", last_os_error_or("create_qp")));
        }
        // SAFETY: `qp` was just created.
        let qp_num = unsafe { (*qp).qp_num };
        Ok(Qp {
            qp,
            _cq: cq.clone(),
            pd: pd.clone(),
            qp_num,
        })
    }

    fn modify(
        &self,
        step: &'static str,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
    ) -> Result<(), RdmaError> {
        // SAFETY: `qp` is live; `attr` and `mask` describe a legal transition (callers below).
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if rc != 0 {
            return Err(self.pd.ctx.err(step, io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    /// RESET → INIT → RTR → RTS against `remote`; `local_psn` is the PSN this side advertised.
    pub(crate) fn connect(&self, remote: &RdmaEndpoint, local_psn: u32) -> Result<(), RdmaError> {
        use ffi::ibv_qp_attr_mask as m;
        let ctx = &self.pd.ctx;
        let mut init = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: ctx.port,
            qp_access_flags: (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
                .0,
            ..Default::default()
        };
        self.modify(
            "ibv_modify_qp(INIT)",
            &mut init,
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
        )?;
        let mut rtr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: ctx.active_mtu.min(remote.mtu),
            dest_qp_num: remote.qp_num,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ah_attr: ffi::ibv_ah_attr {
                dlid: remote.lid,
                sl: 0,
                src_path_bits: 0,
                port_num: ctx.port,
                ..Default::default()
            },
            ..Default::default()
        };
        if remote.gid != [0; 16] {
            let sgid_index = ctx.gid_index.ok_or_else(|| {
                RdmaError::Endpoint("the peer routes by GID but no local GID index is set".into())
            })?;
            rtr.ah_attr.is_global = 1;
            rtr.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            rtr.ah_attr.grh.hop_limit = 0xff;
            rtr.ah_attr.grh.sgid_index = sgid_index;
        }
        self.modify(
            "ibv_modify_qp(RTR)",
            &mut rtr,
            m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
        )?;
        let mut rts = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: local_psn,
            // 4.096 µs · 2^14 ≈ 67 ms per try, 7 retries: a dead peer fails the QP in ~0.5 s.
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            "ibv_modify_qp(RTS)",
            &mut rts,
            m::IBV_QP_STATE
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// Moves the QP to ERROR: it stops executing; its outstanding requests are flushed.
    pub(crate) fn set_error(&self) -> Result<(), RdmaError> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(
            "ibv_modify_qp(ERR)",
            &mut attr,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE,
        )
    }

    /// Posts `wrs` as one linked list of `IBV_WR_RDMA_WRITE` requests (one SGE each).
    pub(crate) fn post(&self, wrs: &[WrSpec]) -> Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<ffi::ibv_sge> = wrs
            .iter()
            .map(|w| ffi::ibv_sge {
                addr: w.local_addr,
                length: w.len,
                lkey: w.lkey,
            })
            .collect();
        let mut list: Vec<ffi::ibv_send_wr> = Vec::with_capacity(wrs.len());
        for (w, sge) in wrs.iter().zip(sges.iter_mut()) {
            let mut wr = ffi::ibv_send_wr {
                wr_id: w.wr_id,
                sg_list: sge,
                num_sge: 1,
                opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                send_flags: if w.signaled {
                    ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
                } else {
                    0
                },
                ..Default::default()
            };
            wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                remote_addr: w.remote_addr,
                rkey: w.rkey,
            };
            list.push(wr);
        }
        // Link after the vector is complete: its buffer no longer moves.
        let base = list.as_mut_ptr();
        for i in 0..list.len() - 1 {
            // SAFETY: `i + 1 < len`, so the pointer is inside `list`.
            list[i].next = unsafe { base.add(i + 1) };
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: `qp` is live; its context's ops table is filled by the provider.
        let post_send = unsafe { (*(*self.qp).context).ops.post_send };
        let Some(post_send) = post_send else {
            return Err(PostError {
                posted: 0,
                source: io::Error::other("provider has no post_send"),
            });
        };
        // SAFETY: `list` (and `sges`, which it points into) outlive the call; the provider copies
        // the requests into the send queue before returning. The source memory stays registered
        // and alive until the ledger retires the requests (it holds the `Bytes`).
        let rc = unsafe { post_send(self.qp, base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let posted = if bad.is_null() {
            0
        } else {
            // SAFETY: `bad` points into `list` (the provider returns the first failed request).
            usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
        };
        Err(PostError {
            posted: posted.min(wrs.len()),
            source: io::Error::from_raw_os_error(rc),
        })
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created in `create`, destroyed once, before its CQ and PD (held by `Arc`).
        let rc = unsafe { ffi::ibv_destroy_qp(self.qp) };
        if rc != 0 {
            tracing::error!(qp_num = self.qp_num, rc, "ibv_destroy_qp failed");
        }
    }
}
