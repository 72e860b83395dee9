//! Fault injection at every external call of registration (DESIGN §6; seed 000 CI-1).
//!
//! A [`FaultInjector`] counts the calls of each kind — allocate, free, register, unregister — fails
//! the ones its [`FaultPlan`] names, and records every call in order in a [`CallLog`], so tests can
//! assert the undo order, that destroy happened exactly once and that nothing leaked. Attach it to an
//! allocator with [`crate::memory::Allocator::with_hook`] and wrap a store client in [`FaultyClient`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::memory::{Allocator, AllocatorDomain, AllocatorHook, BufferId, MemoryError};
use crate::store_client::{BufferRef, ClientMode, StoreClient, StoreError, StoreHandle};

/// One external call, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// Allocation of `len` bytes for `owner`.
    Allocate {
        /// Owner.
        owner: String,
        /// Bytes.
        len: usize,
    },
    /// Release of a buffer (a pool destroy).
    Free {
        /// Buffer.
        buffer: BufferId,
        /// Owner.
        owner: String,
    },
    /// Store registration of a range.
    Register {
        /// Start address.
        addr: usize,
        /// Length.
        len: usize,
    },
    /// Store unregistration.
    Unregister {
        /// Handle.
        handle: StoreHandle,
        /// Start address of the range it covered.
        addr: usize,
    },
}

/// Which call of each kind fails (1-based; `None` = never).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Fail the Nth allocation.
    pub allocate: Option<usize>,
    /// Fail the Nth free.
    pub free: Option<usize>,
    /// Fail the Nth registration.
    pub register: Option<usize>,
    /// Fail the Nth unregistration.
    pub unregister: Option<usize>,
}

#[derive(Debug, Default)]
struct State {
    plan: FaultPlan,
    counts: [usize; 4],
    log: Vec<Call>,
    /// Address of each handle, to log unregisters by address.
    handles: BTreeMap<StoreHandle, usize>,
}

/// Counts, fails and records external calls.
#[derive(Debug, Default)]
pub struct FaultInjector {
    state: Mutex<State>,
}

/// The recorded calls, in order.
pub type CallLog = Vec<Call>;

impl FaultInjector {
    /// An injector following `plan`.
    pub fn new(plan: FaultPlan) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                plan,
                ..State::default()
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The calls so far.
    pub fn log(&self) -> CallLog {
        self.state().log.clone()
    }

    /// Replaces the plan and resets the counters (the log is kept).
    pub fn set_plan(&self, plan: FaultPlan) {
        let mut s = self.state();
        s.plan = plan;
        s.counts = [0; 4];
    }

    /// Counts a call of `kind` (0 allocate, 1 free, 2 register, 3 unregister), records it, and says
    /// whether it must fail.
    fn hit(&self, kind: usize, call: Call) -> bool {
        let mut s = self.state();
        s.counts[kind] += 1;
        let n = s.counts[kind];
        let target = match kind {
            0 => s.plan.allocate,
            1 => s.plan.free,
            2 => s.plan.register,
            _ => s.plan.unregister,
        };
        s.log.push(call);
        target == Some(n)
    }

    /// `allocator` with this injector hooked in.
    pub fn hook_allocator(self: &Arc<Self>, allocator: &Allocator) -> Allocator {
        allocator.with_hook(self.clone())
    }
}

impl AllocatorHook for FaultInjector {
    fn before_allocate(&self, len: usize, owner: &str) -> Result<(), MemoryError> {
        let call = Call::Allocate {
            owner: owner.to_owned(),
            len,
        };
        if self.hit(0, call) {
            return Err(MemoryError::Injected(format!(
                "allocate {len} B for {owner}"
            )));
        }
        Ok(())
    }
    fn before_release(&self, buffer: BufferId, owner: &str) -> Result<(), MemoryError> {
        let call = Call::Free {
            buffer,
            owner: owner.to_owned(),
        };
        if self.hit(1, call) {
            return Err(MemoryError::Injected(format!("free {buffer}")));
        }
        Ok(())
    }
}

/// A store client that consults a [`FaultInjector`] before delegating each call.
#[derive(Debug)]
pub struct FaultyClient {
    inner: Arc<dyn StoreClient>,
    faults: Arc<FaultInjector>,
}

impl FaultyClient {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn StoreClient>, faults: Arc<FaultInjector>) -> Self {
        Self { inner, faults }
    }
}

impl StoreClient for FaultyClient {
    fn mode(&self) -> ClientMode {
        self.inner.mode()
    }
    fn host_allocator(&self) -> &Allocator {
        self.inner.host_allocator()
    }
    fn accepted_domains(&self) -> &'static [AllocatorDomain] {
        self.inner.accepted_domains()
    }
    fn check_registrable(&self, range: &BufferRef) -> Result<(), StoreError> {
        self.inner.check_registrable(range)
    }
    fn register_buffer(&self, range: &BufferRef) -> Result<StoreHandle, StoreError> {
        let call = Call::Register {
            addr: range.addr,
            len: range.len,
        };
        if self.faults.hit(2, call) {
            return Err(StoreError::Injected(format!(
                "register {:#x}+{}",
                range.addr, range.len
            )));
        }
        let handle = self.inner.register_buffer(range)?;
        self.faults.state().handles.insert(handle, range.addr);
        Ok(handle)
    }
    fn unregister_buffer(&self, handle: StoreHandle) -> Result<(), StoreError> {
        let addr = self
            .faults
            .state()
            .handles
            .get(&handle)
            .copied()
            .unwrap_or(0);
        if self.faults.hit(3, Call::Unregister { handle, addr }) {
            return Err(StoreError::Injected(format!("unregister {handle:?}")));
        }
        self.inner.unregister_buffer(handle)?;
        self.faults.state().handles.remove(&handle);
        Ok(())
    }
    fn registered_count(&self) -> usize {
        self.inner.registered_count()
    }
    fn segment_set(&self) -> Option<&Arc<crate::memory::shared::SegmentSet>> {
        self.inner.segment_set()
    }
    fn shutdown(&self) -> Result<(), StoreError> {
        self.inner.shutdown()
    }
}
