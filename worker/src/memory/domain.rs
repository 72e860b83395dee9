//! Allocator domains (DESIGN contract 1, §2 `CacheTier.allocator`).

/// The domain enum crosses the operator/worker boundary (it is in the worker config): it lives in
/// `tandem-interfaces` (worker/interfaces/README.md §2).
pub use tandem_interfaces::memory::AllocatorDomain;

/// A consumer refused a buffer because of its domain (DESIGN contract 1; reference/dataplane.md
/// R-MEM-2 `DomainMismatch{buffer, domain, consumer}`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{consumer} accepts {accepted:?} but buffer {buffer} ({owner}) is in the {domain} domain")]
pub struct DomainMismatch {
    /// The buffer.
    pub buffer: super::BufferId,
    /// Its owner.
    pub owner: String,
    /// Its domain.
    pub domain: AllocatorDomain,
    /// Who refused it, e.g. `RDMA transport`, `snapshot buffer`.
    pub consumer: String,
    /// What the consumer accepts.
    pub accepted: Vec<AllocatorDomain>,
}

/// The check every consumer runs before any side effect: `buffer` must be in one of `accepted`.
///
/// # Errors
/// [`DomainMismatch`] naming the buffer, its owner and domain, the consumer and what it accepts.
pub fn require_domain(
    buffer: &super::Buffer,
    consumer: &str,
    accepted: &[AllocatorDomain],
) -> Result<(), DomainMismatch> {
    if accepted.contains(&buffer.domain()) {
        return Ok(());
    }
    Err(DomainMismatch {
        buffer: buffer.id(),
        owner: buffer.owner().to_owned(),
        domain: buffer.domain(),
        consumer: consumer.to_owned(),
        accepted: accepted.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Allocator;
    use crate::memory::mmap::MmapBackend;

    #[test]
    fn consumers_refuse_other_domains_by_name() {
        let a = Allocator::new("m", MmapBackend::new());
        let b = a.allocate(1, "draft host KV pool").unwrap();
        assert!(require_domain(&b, "L3 store", &[AllocatorDomain::Mmap]).is_ok());
        let e = require_domain(&b, "L3 store", &[AllocatorDomain::SharedMemory]).unwrap_err();
        assert_eq!(e.domain, AllocatorDomain::Mmap);
        let msg = e.to_string();
        assert!(
            msg.contains("L3 store") && msg.contains("draft host KV pool"),
            "{msg}"
        );
        b.free().unwrap();
    }
}
