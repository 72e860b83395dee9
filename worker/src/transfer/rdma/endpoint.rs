//! What two peers exchange to connect RC queue pairs and address each other's memory (pure; always
//! compiled). Carried in the peer hello as `PeerInfo.rdma`; the wire form and its conversions live
//! with the peer protocol (`crate::control`), so this module does not depend on it.
//!
//! The exchange: decode creates one RC queue pair per prefill peer and sends its endpoint — QP
//! number, port LID/GID, first PSN, MTU and the memory registrations prefill may write
//! ([`RemoteMr`]) — in its hello; prefill creates its own QP, answers with its endpoint (no
//! regions), and both sides move their QP RESET → INIT → RTR → RTS against the other's endpoint.

use crate::transfer::RegionId;

/// One memory registration of a peer: region bytes `[region_offset, region_offset + len)` live at
/// the peer's virtual address `addr` and are writable under `rkey`. A region may be registered as
/// several MRs (each at most the device's `max_mr_size`: Mooncake#2017 — never advertise bytes that
/// are not registered), each listed as its own `RemoteMr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteMr {
    /// The receive region this registration belongs to.
    pub region: RegionId,
    /// Offset of the registration's first byte within the region (bytes).
    pub region_offset: u64,
    /// The peer's virtual address of that byte.
    pub addr: u64,
    /// Remote key of the memory region.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

/// The connection data of one RC queue pair (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaEndpoint {
    /// Queue pair number (24 bits).
    pub qp_num: u32,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Port GID; all zero means "no GRH" (InfiniBand within one subnet). RoCE needs a GID.
    pub gid: [u8; 16],
    /// First packet sequence number of the sender's send queue (24 bits).
    pub psn: u32,
    /// Active path MTU as the verbs enum value (1 = 256 B … 5 = 4096 B).
    pub mtu: u32,
    /// Registrations the peer may write (empty on the writing side).
    pub regions: Vec<RemoteMr>,
}

/// A malformed endpoint from the wire (the peer is refused; nothing is connected).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointError {
    /// `qp_num` or `psn` does not fit 24 bits.
    #[error("{field} {value:#x} does not fit 24 bits")]
    Not24Bits {
        /// Which field.
        field: &'static str,
        /// Its value.
        value: u32,
    },
    /// `lid` does not fit 16 bits.
    #[error("lid {0:#x} does not fit 16 bits")]
    Lid(u32),
    /// `gid` is not 16 bytes.
    #[error("gid has {0} bytes, expected 16")]
    GidLength(usize),
    /// `mtu` is not a verbs MTU enum value (1..=5).
    #[error("mtu enum {0} is not in 1..=5")]
    Mtu(u32),
    /// A registration is empty or its address or region range overflows.
    #[error("region {region} registration at offset {region_offset}: empty or overflowing")]
    BadRegistration {
        /// The region.
        region: u32,
        /// Its region offset.
        region_offset: u64,
    },
    /// Two registrations of one region overlap in region offsets.
    #[error("region {0}: registrations overlap")]
    Overlap(u32),
}

impl RdmaEndpoint {
    /// Checks the ranges of every field (a malformed endpoint must never reach `ibv_modify_qp` or
    /// the write planner).
    ///
    /// # Errors
    /// The first [`EndpointError`] found.
    pub fn validate(&self) -> Result<(), EndpointError> {
        for (field, value) in [("qp_num", self.qp_num), ("psn", self.psn)] {
            if value >= 1 << 24 {
                return Err(EndpointError::Not24Bits { field, value });
            }
        }
        if !(1..=5).contains(&self.mtu) {
            return Err(EndpointError::Mtu(self.mtu));
        }
        let mut sorted: Vec<&RemoteMr> = self.regions.iter().collect();
        sorted.sort_by_key(|m| (m.region, m.region_offset));
        for (i, mr) in sorted.iter().enumerate() {
            let bad = EndpointError::BadRegistration {
                region: mr.region.0,
                region_offset: mr.region_offset,
            };
            if mr.len == 0
                || mr.addr.checked_add(mr.len).is_none()
                || mr.region_offset.checked_add(mr.len).is_none()
            {
                return Err(bad);
            }
            if let Some(next) = sorted.get(i + 1)
                && next.region == mr.region
                && next.region_offset < mr.region_offset + mr.len
            {
                return Err(EndpointError::Overlap(mr.region.0));
            }
        }
        Ok(())
    }
}
