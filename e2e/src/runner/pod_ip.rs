//! Pod IPs from the loopback range (pure).
//!
//! Linux routes all of 127.0.0.0/8 to `lo`, so a process can bind any 127.x.y.z without network
//! configuration. A runner node with index `n` owns `127.<100+n>.0.0/16`: the node's own address
//! (its `InternalIP`, the pods' `hostIP`) is `127.<100+n>.0.1`, pods get `.0.2` upward, and a freed
//! address is reused only after every other one was handed out (least-recently-freed last), so a
//! late packet to a deleted pod does not reach its successor.

use std::collections::{BTreeSet, VecDeque};
use std::net::Ipv4Addr;

/// Errors of the allocator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodIpError {
    /// Every address of the node's range is in use.
    #[error("no free pod IP left in 127.{0}.0.0/16")]
    Exhausted(u8),
    /// The node index does not fit the 127.100–127.254 scheme.
    #[error("node index {0} out of range (0..=154)")]
    BadNodeIndex(u32),
}

/// Hands out and takes back pod IPs of one node.
#[derive(Debug, Clone)]
pub struct PodIpAllocator {
    octet: u8,
    next: u32,
    in_use: BTreeSet<Ipv4Addr>,
    freed: VecDeque<Ipv4Addr>,
}

/// Host part range of pod addresses: 0.2 ..= 255.254.
const FIRST: u32 = 2;
const LAST: u32 = (255 << 8) | 254;

impl PodIpAllocator {
    /// The allocator of runner node `node_index` (0-based).
    pub fn new(node_index: u32) -> Result<Self, PodIpError> {
        let octet = u8::try_from(100 + node_index)
            .ok()
            .filter(|o| *o <= 254)
            .ok_or(PodIpError::BadNodeIndex(node_index))?;
        Ok(Self {
            octet,
            next: FIRST,
            in_use: BTreeSet::new(),
            freed: VecDeque::new(),
        })
    }

    /// The node's own address, `127.<100+n>.0.1`.
    pub fn node_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(127, self.octet, 0, 1)
    }

    /// A free address; never one that is in use.
    pub fn allocate(&mut self) -> Result<Ipv4Addr, PodIpError> {
        let ip = if self.next <= LAST {
            let host = self.next;
            self.next += 1;
            Ipv4Addr::new(127, self.octet, (host >> 8) as u8, (host & 0xff) as u8)
        } else {
            self.freed
                .pop_front()
                .ok_or(PodIpError::Exhausted(self.octet))?
        };
        if (ip.octets()[3]) == 255 || ip.octets()[3] == 0 {
            // Skip .0 and .255 host bytes: some tools treat them as network/broadcast.
            return self.allocate();
        }
        self.in_use.insert(ip);
        Ok(ip)
    }

    /// Gives `ip` back (ignored if it was not handed out by this allocator).
    pub fn release(&mut self, ip: Ipv4Addr) {
        if self.in_use.remove(&ip) {
            self.freed.push_back(ip);
        }
    }

    /// Marks `ip` as in use (a pod found already running with this IP after a runner restart).
    /// Returns false if it is not in this node's range or already taken.
    pub fn claim(&mut self, ip: Ipv4Addr) -> bool {
        let o = ip.octets();
        if o[0] != 127 || o[1] != self.octet || self.in_use.contains(&ip) {
            return false;
        }
        self.freed.retain(|f| *f != ip);
        self.in_use.insert(ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_addresses_and_late_reuse() {
        let mut a = PodIpAllocator::new(0).unwrap();
        assert_eq!(a.node_ip(), Ipv4Addr::new(127, 100, 0, 1));
        let first = a.allocate().unwrap();
        assert_eq!(first, Ipv4Addr::new(127, 100, 0, 2));
        let second = a.allocate().unwrap();
        a.release(first);
        let third = a.allocate().unwrap();
        assert_ne!(
            third, first,
            "a freed address is not reused while fresh ones remain"
        );
        assert_ne!(third, second);
        assert!(PodIpAllocator::new(155).is_err());
        assert_eq!(PodIpAllocator::new(3).unwrap().node_ip().octets()[1], 103);
    }

    #[test]
    fn exhaustion_then_reuse_of_freed() {
        let mut a = PodIpAllocator::new(1).unwrap();
        let mut all = BTreeSet::new();
        while let Ok(ip) = a.allocate() {
            assert!(all.insert(ip), "duplicate {ip}");
            let o = ip.octets();
            assert!(o[3] != 0 && o[3] != 255);
        }
        assert_eq!(a.allocate(), Err(PodIpError::Exhausted(101)));
        let some = *all.iter().nth(10).unwrap();
        a.release(some);
        assert_eq!(a.allocate(), Ok(some));
        assert!(!a.claim(some));
        assert!(!a.claim(Ipv4Addr::new(127, 0, 0, 1)));
    }
}
