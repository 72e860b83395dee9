//! The worker's registration table in front of a store client (reference/dataplane.md R-REG-4, R-REG-6,
//! TC-REG-06, TC-REG-07).
//!
//! Defined results:
//! - zero-size range → [`RegisterError::ZeroSize`], no external call;
//! - exact duplicate (same address and length) → the same [`RegistrationId`] with its refcount raised,
//!   no external call; it then needs as many deregistrations;
//! - partial overlap with an existing registration → [`RegisterError::Overlap`], no external call;
//! - deregistering a set with any unknown id → [`DeregisterError::Unknown`] and nothing changes;
//! - deregistering a range that an in-flight transfer references → [`DeregisterError::Busy`] and
//!   nothing changes;
//! - a store failure while deregistering leaves that entry (and the rest of the set) registered, so a
//!   retry resumes where it stopped; the transaction instead quarantines it ([`Registry::quarantine`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::memory::BufferId;
use crate::store_client::{BufferRef, StoreClient, StoreError, StoreHandle};

/// Id of one registration in the worker's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegistrationId(pub u64);

impl std::fmt::Display for RegistrationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "registration#{}", self.0)
    }
}

/// State of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegistrationState {
    /// Registered with the store.
    Active,
    /// Its undo failed: it may still be registered externally, so its memory is never reused
    /// (reference/dataplane.md R-REG-3). Terminal until the process exits.
    Quarantined,
}

/// A snapshot of one registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistrationInfo {
    /// Id.
    pub id: RegistrationId,
    /// Buffer the range lies in.
    pub buffer: BufferId,
    /// Start address.
    pub addr: usize,
    /// Length.
    pub len: usize,
    /// Exact duplicates folded into it (≥ 1).
    pub refcount: u32,
    /// In-flight transfers referencing it.
    pub in_flight: u32,
    /// State.
    pub state: RegistrationState,
}

#[derive(Debug)]
struct Entry {
    info: RegistrationInfo,
    handle: StoreHandle,
}

#[derive(Debug, Default)]
struct Table {
    entries: BTreeMap<RegistrationId, Entry>,
    /// Start address → id. Registrations never overlap, so the neighbours of an address are the only
    /// candidates for an overlap: checks are O(log n).
    by_addr: BTreeMap<usize, RegistrationId>,
    next: u64,
}

impl Table {
    fn remove(&mut self, id: RegistrationId) {
        if let Some(e) = self.entries.remove(&id) {
            self.by_addr.remove(&e.info.addr);
        }
    }
}

/// Registration table over one store client.
#[derive(Debug)]
pub struct Registry {
    client: Arc<dyn StoreClient>,
    table: Mutex<Table>,
}

/// Errors of [`Registry::register`] and [`Registry::check`].
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// Size 0.
    #[error("{0}: zero-size registration")]
    ZeroSize(BufferId),
    /// Partial overlap with an existing registration.
    #[error("{buffer}: range {addr:#x}+{len} partially overlaps {existing}")]
    Overlap {
        /// The new range's buffer.
        buffer: BufferId,
        /// Start.
        addr: usize,
        /// Length.
        len: usize,
        /// The registration it overlaps.
        existing: RegistrationId,
    },
    /// Refused by the store client (domain, segment, remote or IPC reasons).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Errors of [`Registry::deregister`].
#[derive(Debug, thiserror::Error)]
pub enum DeregisterError {
    /// An id is not registered; nothing was changed.
    #[error("{0} is not registered; nothing was deregistered")]
    Unknown(RegistrationId),
    /// An id appears twice in one call; nothing was changed.
    #[error("{0} is listed twice; nothing was deregistered")]
    Duplicate(RegistrationId),
    /// In-flight transfers reference the range; nothing was changed.
    #[error("{id} is referenced by {in_flight} in-flight transfers; nothing was deregistered")]
    Busy {
        /// The registration.
        id: RegistrationId,
        /// Transfers referencing it.
        in_flight: u32,
    },
    /// The registration is quarantined and cannot be deregistered.
    #[error("{0} is quarantined")]
    Quarantined(RegistrationId),
    /// The store failed on `id`; the ids in `done` were deregistered, `id` and the rest were not.
    #[error("store failed to deregister {id} ({} done before it): {source}", done.len())]
    Store {
        /// Where it stopped.
        id: RegistrationId,
        /// Completed before the failure.
        done: Vec<RegistrationId>,
        /// Cause.
        source: StoreError,
    },
}

/// Proof that a transfer references a registration; dropping it releases the reference.
#[derive(Debug)]
pub struct InFlight<'a> {
    registry: &'a Registry,
    id: RegistrationId,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(e) = self.registry.table().entries.get_mut(&self.id) {
            e.info.in_flight = e.info.in_flight.saturating_sub(1);
        }
    }
}

impl Registry {
    /// An empty table over `client`.
    pub fn new(client: Arc<dyn StoreClient>) -> Self {
        Self {
            client,
            table: Mutex::new(Table::default()),
        }
    }

    /// The store client.
    pub fn client(&self) -> &Arc<dyn StoreClient> {
        &self.client
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // Each mutation is a single insert/remove/field update: a poisoned table is still consistent.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks `range` without side effects: `Ok(Some(id))` if it is an exact duplicate of `id`,
    /// `Ok(None)` if a new registration would be attempted.
    ///
    /// # Errors
    /// [`RegisterError::ZeroSize`], [`RegisterError::Overlap`], or the client's preflight errors
    /// (domain mismatch, not in segment).
    pub fn check(&self, range: &BufferRef) -> Result<Option<RegistrationId>, RegisterError> {
        Self::check_in(&self.table(), &*self.client, range)
    }

    fn check_in(
        table: &Table,
        client: &dyn StoreClient,
        range: &BufferRef,
    ) -> Result<Option<RegistrationId>, RegisterError> {
        if range.len == 0 {
            return Err(RegisterError::ZeroSize(range.buffer));
        }
        let before = table.by_addr.range(..=range.addr).next_back();
        let after = table.by_addr.range(range.addr..).next();
        for (_, id) in before.into_iter().chain(after) {
            let Some(e) = table.entries.get(id) else {
                continue;
            };
            let overlap = RegisterError::Overlap {
                buffer: range.buffer,
                addr: range.addr,
                len: range.len,
                existing: e.info.id,
            };
            if e.info.addr == range.addr && e.info.len == range.len {
                if e.info.state == RegistrationState::Quarantined {
                    return Err(overlap);
                }
                return Ok(Some(e.info.id));
            }
            if range.overlaps(e.info.addr, e.info.len) {
                return Err(overlap);
            }
        }
        client.check_registrable(range)?;
        Ok(None)
    }

    /// Registers `range` (or raises the refcount of its exact duplicate).
    ///
    /// # Errors
    /// As [`Registry::check`], plus the store's registration error.
    pub fn register(&self, range: &BufferRef) -> Result<RegistrationId, RegisterError> {
        let mut table = self.table();
        if let Some(id) = Self::check_in(&table, &*self.client, range)? {
            if let Some(e) = table.entries.get_mut(&id) {
                e.info.refcount += 1;
            }
            return Ok(id);
        }
        let handle = self.client.register_buffer(range)?;
        table.next += 1;
        let id = RegistrationId(table.next);
        table.by_addr.insert(range.addr, id);
        table.entries.insert(
            id,
            Entry {
                info: RegistrationInfo {
                    id,
                    buffer: range.buffer,
                    addr: range.addr,
                    len: range.len,
                    refcount: 1,
                    in_flight: 0,
                    state: RegistrationState::Active,
                },
                handle,
            },
        );
        Ok(id)
    }

    /// Validates that every id can be deregistered now, without changing anything.
    ///
    /// # Errors
    /// [`DeregisterError::Unknown`], [`DeregisterError::Duplicate`], [`DeregisterError::Busy`],
    /// [`DeregisterError::Quarantined`].
    pub fn check_deregister(&self, ids: &[RegistrationId]) -> Result<(), DeregisterError> {
        Self::check_deregister_in(&self.table(), ids)
    }

    fn check_deregister_in(table: &Table, ids: &[RegistrationId]) -> Result<(), DeregisterError> {
        for (i, id) in ids.iter().enumerate() {
            if ids[..i].contains(id) {
                return Err(DeregisterError::Duplicate(*id));
            }
            let e = table.entries.get(id).ok_or(DeregisterError::Unknown(*id))?;
            if e.info.state == RegistrationState::Quarantined {
                return Err(DeregisterError::Quarantined(*id));
            }
            if e.info.in_flight > 0 {
                return Err(DeregisterError::Busy {
                    id: *id,
                    in_flight: e.info.in_flight,
                });
            }
        }
        Ok(())
    }

    /// Deregisters a set: validates the whole set first (nothing changes on a validation error), then
    /// lowers each refcount and unregisters from the store at zero, in the order given.
    ///
    /// # Errors
    /// The validation errors, or [`DeregisterError::Store`] naming where it stopped.
    pub fn deregister(&self, ids: &[RegistrationId]) -> Result<(), DeregisterError> {
        let mut table = self.table();
        Self::check_deregister_in(&table, ids)?;
        let mut done = Vec::with_capacity(ids.len());
        for &id in ids {
            let Some(e) = table.entries.get_mut(&id) else {
                continue;
            };
            if e.info.refcount > 1 {
                e.info.refcount -= 1;
            } else {
                let handle = e.handle;
                if let Err(source) = self.client.unregister_buffer(handle) {
                    return Err(DeregisterError::Store { id, done, source });
                }
                table.remove(id);
            }
            done.push(id);
        }
        Ok(())
    }

    /// Marks a registration quarantined (its undo failed). Idempotent; unknown ids are ignored.
    pub fn quarantine(&self, id: RegistrationId) {
        if let Some(e) = self.table().entries.get_mut(&id) {
            e.info.state = RegistrationState::Quarantined;
        }
    }

    /// Takes an in-flight reference on `id` (a transfer is about to use the range).
    ///
    /// # Errors
    /// [`DeregisterError::Unknown`] or [`DeregisterError::Quarantined`].
    pub fn acquire(&self, id: RegistrationId) -> Result<InFlight<'_>, DeregisterError> {
        let mut table = self.table();
        let e = table
            .entries
            .get_mut(&id)
            .ok_or(DeregisterError::Unknown(id))?;
        if e.info.state == RegistrationState::Quarantined {
            return Err(DeregisterError::Quarantined(id));
        }
        e.info.in_flight += 1;
        Ok(InFlight { registry: self, id })
    }

    /// Snapshot of one registration.
    pub fn get(&self, id: RegistrationId) -> Option<RegistrationInfo> {
        self.table().entries.get(&id).map(|e| e.info.clone())
    }

    /// Snapshot of all registrations.
    pub fn list(&self) -> Vec<RegistrationInfo> {
        self.table()
            .entries
            .values()
            .map(|e| e.info.clone())
            .collect()
    }

    /// Active registrations.
    pub fn active_count(&self) -> usize {
        self.table()
            .entries
            .values()
            .filter(|e| e.info.state == RegistrationState::Active)
            .count()
    }

    /// Quarantined registrations.
    pub fn quarantined_count(&self) -> usize {
        self.table()
            .entries
            .values()
            .filter(|e| e.info.state == RegistrationState::Quarantined)
            .count()
    }
}
