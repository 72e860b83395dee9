//! Monotonic counters of the snapshot buffer, for `/metrics` and the benchmark (DESIGN contract 4).

/// Counts since the store was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnapshotCounters {
    /// Snapshots granted slots (`prepare` succeeded).
    pub reserved: u64,
    /// `prepare` answered `snapshot-buf-full` (backpressure; nothing was reserved).
    pub buf_full: u64,
    /// Snapshots copied into the KV pool and inserted into the prefix index.
    pub finalized: u64,
    /// `finalize` answered `alloc-failed-on-finalize` (the snapshot stayed in its slots).
    pub alloc_failed_on_finalize: u64,
    /// Stale snapshots evicted to make room for a new one.
    pub evicted: u64,
    /// Snapshots aborted by the caller.
    pub aborted: u64,
    /// Aborted or evicted snapshots whose slots waited for their writer before being freed.
    pub drained: u64,
}
