//! The wire form of an RDMA endpoint in the peer hello (`PeerInfo.rdma`): conversions between
//! [`pb::RdmaEndpoint`] and the transport's own [`RdmaEndpoint`], which knows nothing of the proto.
//! Decoding validates ([`RdmaEndpoint::validate`]): a malformed endpoint is refused, typed
//! ([`EndpointError`]), before anything is connected.

use super::pb;
use crate::transfer::RegionId;
use crate::transfer::rdma::endpoint::{EndpointError, RdmaEndpoint, RemoteMr};

impl From<&RdmaEndpoint> for pb::RdmaEndpoint {
    fn from(e: &RdmaEndpoint) -> Self {
        pb::RdmaEndpoint {
            qp_num: e.qp_num,
            lid: u32::from(e.lid),
            gid: e.gid.to_vec(),
            psn: e.psn,
            mtu: e.mtu,
            regions: e
                .regions
                .iter()
                .map(|m| pb::RdmaRegion {
                    region_id: m.region.0,
                    region_offset: m.region_offset,
                    addr: m.addr,
                    rkey: m.rkey,
                    len: m.len,
                })
                .collect(),
        }
    }
}

impl TryFrom<&pb::RdmaEndpoint> for RdmaEndpoint {
    type Error = EndpointError;

    /// Decodes and [`RdmaEndpoint::validate`]s a wire endpoint.
    fn try_from(p: &pb::RdmaEndpoint) -> Result<Self, EndpointError> {
        let lid = u16::try_from(p.lid).map_err(|_| EndpointError::Lid(p.lid))?;
        let gid: [u8; 16] = p
            .gid
            .as_slice()
            .try_into()
            .map_err(|_| EndpointError::GidLength(p.gid.len()))?;
        let e = RdmaEndpoint {
            qp_num: p.qp_num,
            lid,
            gid,
            psn: p.psn,
            mtu: p.mtu,
            regions: p
                .regions
                .iter()
                .map(|r| RemoteMr {
                    region: RegionId(r.region_id),
                    region_offset: r.region_offset,
                    addr: r.addr,
                    rkey: r.rkey,
                    len: r.len,
                })
                .collect(),
        };
        e.validate()?;
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint() -> RdmaEndpoint {
        RdmaEndpoint {
            qp_num: 0x12_3456,
            lid: 7,
            gid: [0xfe; 16],
            psn: 42,
            mtu: 5,
            regions: vec![
                RemoteMr {
                    region: RegionId(0),
                    region_offset: 0,
                    addr: 0x7000_0000,
                    rkey: 11,
                    len: 4096,
                },
                RemoteMr {
                    region: RegionId(0),
                    region_offset: 4096,
                    addr: 0x9000_0000,
                    rkey: 12,
                    len: 4096,
                },
            ],
        }
    }

    #[test]
    fn round_trips_through_the_hello_message() {
        let e = endpoint();
        let wire = pb::RdmaEndpoint::from(&e);
        assert_eq!(RdmaEndpoint::try_from(&wire).unwrap(), e);
        let hello = pb::PeerInfo {
            rdma: Some(wire),
            ..Default::default()
        };
        let bytes = prost::Message::encode_to_vec(&hello);
        let back: pb::PeerInfo = prost::Message::decode(bytes.as_slice()).unwrap();
        assert_eq!(RdmaEndpoint::try_from(&back.rdma.unwrap()).unwrap(), e);
    }

    #[test]
    fn malformed_endpoints_are_refused() {
        let mut wire = pb::RdmaEndpoint::from(&endpoint());
        wire.gid.pop();
        assert_eq!(
            RdmaEndpoint::try_from(&wire),
            Err(EndpointError::GidLength(15))
        );
        let mut wire = pb::RdmaEndpoint::from(&endpoint());
        wire.lid = 1 << 16;
        assert_eq!(
            RdmaEndpoint::try_from(&wire),
            Err(EndpointError::Lid(1 << 16))
        );
        let mut e = endpoint();
        e.qp_num = 1 << 24;
        assert!(matches!(e.validate(), Err(EndpointError::Not24Bits { .. })));
        let mut e = endpoint();
        e.mtu = 0;
        assert_eq!(e.validate(), Err(EndpointError::Mtu(0)));
        let mut e = endpoint();
        e.regions[1].region_offset = 4095;
        assert_eq!(e.validate(), Err(EndpointError::Overlap(0)));
        let mut e = endpoint();
        e.regions[0].addr = u64::MAX;
        assert!(matches!(
            e.validate(),
            Err(EndpointError::BadRegistration { .. })
        ));
    }
}
