//! The decode-side room state machine and its release gate.
//!
//! Decode pre-allocates the pages a room's KV lands in. Those pages may return to the free list only
//! when no prefill write can land in them any more (DESIGN contract 3; seed 004 BugFix #1; dataplane.md
//! R-ABORT-1/4/5 and §8 state machine 4):
//!
//! ```text
//! WaitingForInput → Transferring → Success → Committed            (normal path; pages go to the request)
//! any non-terminal ──fail(cause)──► ReleasePending(acks 0/k)
//!     ReleasePending ──k acks | transport proof──► ReleaseSafe    (pages may be freed)
//!     ReleasePending ──deadline, no proof──────► Quarantined      (alarm; pages kept out of the pool)
//!     Quarantined    ──k acks | transport proof──► ReleaseSafe    (late proof recovers the pages)
//! ```
//!
//! Every failure cause — client abort, timeout, transfer failure, heartbeat loss, prefill-side
//! failure, spec-guard trip, shutdown — goes through the same gate (R-ABORT-5). A timer alone never
//! frees pages (R-ABORT-4). Acks of another generation, of a rank that was not asked, or duplicates
//! are ignored (R-ABORT-7, TC-ABT-07/11).
//!
//! `GateMode::UnsafeBypass` frees pages at once on failure. It exists only as the negative control of
//! the abort stress test (`tandem-bench abort-stress --unsafe`), which must then find corrupt pages,
//! and only in builds with the `negative-controls` feature (the tests enable it; release builds do
//! not have it).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::id::{PrefillRank, RoomKey};

/// Why a decode room failed; every cause takes the same release gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureCause {
    /// The client cancelled the request.
    ClientAbort,
    /// The KV did not arrive before the room deadline (prefill queueing, seed 004).
    Timeout,
    /// A write failed or the transport reported an error.
    TransferFailed,
    /// The prefill peer stopped answering heartbeats or its control stream broke.
    HeartbeatLost,
    /// The prefill side reported the room failed.
    PrefillFailed,
    /// The speculative-decoding guard tripped (DESIGN contract 8).
    SpecGuard,
    /// Worker shutdown (DESIGN contract 9).
    Shutdown,
}

/// Proof from the transport that no write of a room can land any more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportProof {
    /// The TCP receiver fenced the room: writes of the old generation are dropped and none is being
    /// applied (R-XFER-6).
    ReceiverFenced,
    /// Every queue pair (connection) the peer could write through is destroyed or in error and its
    /// posted writes have been flushed (R-XFER-4).
    PeerConnectionsDestroyed,
}

/// How the pages of a room became safe to free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseProof {
    /// Every required prefill rank acked.
    AllAcks,
    /// The transport proved no write can land.
    Transport(TransportProof),
    /// The room had concluded (all KV landed, prefill done) before it failed.
    Concluded,
    /// The gate was bypassed (negative control only; feature `negative-controls`).
    #[cfg(feature = "negative-controls")]
    Bypassed,
}

/// What the caller must do with the room's pages now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateVerdict {
    /// Keep the pages; wait for acks, proof or the deadline.
    Hold,
    /// The pages may be freed. `from_quarantine` says they must be taken out of quarantine first.
    Free {
        /// The proof.
        proof: ReleaseProof,
        /// True when the room had been quarantined.
        from_quarantine: bool,
    },
    /// The deadline passed without proof: quarantine the pages and raise an alarm.
    Quarantine,
}

/// Release gate behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateMode {
    /// Contract 3.
    Safe,
    /// Free on failure without waiting (the pre-fix behaviour of seed 004): negative control only,
    /// built only with the `negative-controls` feature.
    #[cfg(feature = "negative-controls")]
    UnsafeBypass,
}

/// Decode room states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReceiverState {
    /// Pages allocated and published; no KV yet.
    WaitingForInput,
    /// KV is landing.
    Transferring,
    /// All KV landed and prefill concluded.
    Success,
    /// The pages were handed to the request.
    Committed,
    /// Failed; waiting for acks or proof.
    ReleasePending,
    /// Pages are free to reuse.
    ReleaseSafe(ReleaseProof),
    /// No proof by the deadline; pages quarantined.
    Quarantined,
}

/// Why an ack was not counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckIgnored {
    /// The ack names another generation of the room (R-ABORT-7).
    StaleGeneration,
    /// The rank is not one this room waits for.
    UnexpectedRank,
    /// The rank already acked.
    Duplicate,
    /// The room is not waiting for acks (never failed, or already released).
    NotWaiting,
}

/// The outcome of [`ReceiverRoom::on_ack`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckOutcome {
    /// Not counted.
    Ignored(AckIgnored),
    /// Counted; the verdict says whether the pages are now free.
    Counted {
        /// Acks received so far.
        have: usize,
        /// Acks required.
        need: usize,
        /// What to do with the pages.
        verdict: GateVerdict,
    },
}

/// Errors of state transitions on the normal path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReceiverError {
    /// The transition is not allowed from this state.
    #[error("{key}: {event} not allowed in state {state:?}")]
    InvalidTransition {
        /// The room.
        key: RoomKey,
        /// The attempted event.
        event: &'static str,
        /// The state it was attempted in.
        state: ReceiverState,
    },
}

/// The decode side of one room incarnation.
#[derive(Clone, Debug)]
pub struct ReceiverRoom {
    key: RoomKey,
    required: BTreeSet<PrefillRank>,
    acks: BTreeSet<PrefillRank>,
    state: ReceiverState,
    cause: Option<FailureCause>,
    deadline: Option<Instant>,
    #[cfg_attr(
        not(feature = "negative-controls"),
        allow(dead_code, reason = "read only by the negative control")
    )]
    mode: GateMode,
}

impl ReceiverRoom {
    /// A room waiting for KV from every rank in `writers` (each may write, so each must ack).
    pub fn new(
        key: RoomKey,
        writers: impl IntoIterator<Item = PrefillRank>,
        mode: GateMode,
    ) -> ReceiverRoom {
        ReceiverRoom {
            key,
            required: writers.into_iter().collect(),
            acks: BTreeSet::new(),
            state: ReceiverState::WaitingForInput,
            cause: None,
            deadline: None,
            mode,
        }
    }

    /// The room's key.
    pub fn key(&self) -> RoomKey {
        self.key
    }

    /// Current state.
    pub fn state(&self) -> ReceiverState {
        self.state
    }

    /// Why the room failed, if it did.
    pub fn cause(&self) -> Option<FailureCause> {
        self.cause
    }

    /// The prefill ranks that must ack.
    pub fn required(&self) -> impl Iterator<Item = PrefillRank> + '_ {
        self.required.iter().copied()
    }

    /// The first chunk landed.
    pub fn on_chunk(&mut self) -> Result<(), ReceiverError> {
        match self.state {
            ReceiverState::WaitingForInput => {
                self.state = ReceiverState::Transferring;
                Ok(())
            }
            ReceiverState::Transferring => Ok(()),
            s => Err(self.invalid("chunk", s)),
        }
    }

    /// All KV landed and prefill concluded the room.
    pub fn on_complete(&mut self) -> Result<(), ReceiverError> {
        match self.state {
            ReceiverState::WaitingForInput | ReceiverState::Transferring => {
                self.state = ReceiverState::Success;
                Ok(())
            }
            s => Err(self.invalid("complete", s)),
        }
    }

    /// Hand the pages to the request (after [`ReceiverRoom::on_complete`]).
    pub fn commit(&mut self) -> Result<(), ReceiverError> {
        match self.state {
            ReceiverState::Success => {
                self.state = ReceiverState::Committed;
                Ok(())
            }
            s => Err(self.invalid("commit", s)),
        }
    }

    /// Fails the room. Returns the prefill ranks to send ABORT to and the gate's verdict. A room that
    /// concluded (or was committed) frees at once: every write of it completed. Failing an already
    /// failed room changes nothing and notifies nobody.
    pub fn fail(
        &mut self,
        cause: FailureCause,
        now: Instant,
        ack_timeout: Duration,
    ) -> (Vec<PrefillRank>, GateVerdict) {
        match self.state {
            ReceiverState::Success | ReceiverState::Committed => {
                self.cause = Some(cause);
                let proof = ReleaseProof::Concluded;
                self.state = ReceiverState::ReleaseSafe(proof);
                (
                    Vec::new(),
                    GateVerdict::Free {
                        proof,
                        from_quarantine: false,
                    },
                )
            }
            ReceiverState::WaitingForInput | ReceiverState::Transferring => {
                self.cause = Some(cause);
                let notify: Vec<PrefillRank> = self.required.iter().copied().collect();
                #[cfg(feature = "negative-controls")]
                if self.mode == GateMode::UnsafeBypass {
                    let proof = ReleaseProof::Bypassed;
                    self.state = ReceiverState::ReleaseSafe(proof);
                    return (
                        notify,
                        GateVerdict::Free {
                            proof,
                            from_quarantine: false,
                        },
                    );
                }
                self.state = ReceiverState::ReleasePending;
                self.deadline = Some(now + ack_timeout);
                let verdict = self.check_acks(false);
                (notify, verdict)
            }
            ReceiverState::ReleasePending
            | ReceiverState::ReleaseSafe(_)
            | ReceiverState::Quarantined => (Vec::new(), GateVerdict::Hold),
        }
    }

    /// An ABORT_ACK arrived from `rank` for `key`.
    pub fn on_ack(&mut self, key: RoomKey, rank: PrefillRank) -> AckOutcome {
        if key != self.key {
            return AckOutcome::Ignored(AckIgnored::StaleGeneration);
        }
        if !self.required.contains(&rank) {
            return AckOutcome::Ignored(AckIgnored::UnexpectedRank);
        }
        let quarantined = match self.state {
            ReceiverState::ReleasePending => false,
            ReceiverState::Quarantined => true,
            _ => return AckOutcome::Ignored(AckIgnored::NotWaiting),
        };
        if !self.acks.insert(rank) {
            return AckOutcome::Ignored(AckIgnored::Duplicate);
        }
        let verdict = self.check_acks(quarantined);
        AckOutcome::Counted {
            have: self.acks.len(),
            need: self.required.len(),
            verdict,
        }
    }

    /// The transport proved no write of this room can land.
    pub fn on_transport_proof(&mut self, proof: TransportProof) -> GateVerdict {
        let from_quarantine = match self.state {
            ReceiverState::ReleasePending => false,
            ReceiverState::Quarantined => true,
            _ => return GateVerdict::Hold,
        };
        let proof = ReleaseProof::Transport(proof);
        self.state = ReceiverState::ReleaseSafe(proof);
        GateVerdict::Free {
            proof,
            from_quarantine,
        }
    }

    /// Time passes. Past the ack deadline without proof the room is quarantined (once).
    pub fn on_tick(&mut self, now: Instant) -> GateVerdict {
        match (self.state, self.deadline) {
            (ReceiverState::ReleasePending, Some(deadline)) if now >= deadline => {
                self.state = ReceiverState::Quarantined;
                GateVerdict::Quarantine
            }
            _ => GateVerdict::Hold,
        }
    }

    /// The ack deadline, once failed.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    fn check_acks(&mut self, from_quarantine: bool) -> GateVerdict {
        if self.acks.len() == self.required.len()
            && self.required.iter().all(|r| self.acks.contains(r))
        {
            let proof = ReleaseProof::AllAcks;
            self.state = ReceiverState::ReleaseSafe(proof);
            GateVerdict::Free {
                proof,
                from_quarantine,
            }
        } else {
            GateVerdict::Hold
        }
    }

    fn invalid(&self, event: &'static str, state: ReceiverState) -> ReceiverError {
        ReceiverError::InvalidTransition {
            key: self.key,
            event,
            state,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(5);

    fn room(ranks: &[u32]) -> ReceiverRoom {
        ReceiverRoom::new(
            RoomKey::new(9, 2),
            ranks.iter().map(|r| PrefillRank(*r)),
            GateMode::Safe,
        )
    }

    fn free(proof: ReleaseProof) -> GateVerdict {
        GateVerdict::Free {
            proof,
            from_quarantine: false,
        }
    }

    #[test]
    fn abort_notifies_every_writer_and_holds_until_all_ack() {
        let mut r = room(&[0, 1]);
        r.on_chunk().unwrap();
        let (notify, v) = r.fail(FailureCause::ClientAbort, Instant::now(), T);
        assert_eq!(notify, vec![PrefillRank(0), PrefillRank(1)]);
        assert_eq!(v, GateVerdict::Hold);
        assert_eq!(
            r.on_ack(r.key(), PrefillRank(0)),
            AckOutcome::Counted {
                have: 1,
                need: 2,
                verdict: GateVerdict::Hold
            }
        );
        assert_eq!(
            r.on_ack(r.key(), PrefillRank(0)),
            AckOutcome::Ignored(AckIgnored::Duplicate),
            "a duplicate ack does not count twice"
        );
        assert_eq!(
            r.on_ack(r.key(), PrefillRank(1)),
            AckOutcome::Counted {
                have: 2,
                need: 2,
                verdict: free(ReleaseProof::AllAcks)
            }
        );
        assert_eq!(r.state(), ReceiverState::ReleaseSafe(ReleaseProof::AllAcks));
    }

    #[test]
    fn late_ack_of_old_generation_is_ignored() {
        let mut r = room(&[0]);
        r.fail(FailureCause::Timeout, Instant::now(), T);
        assert_eq!(
            r.on_ack(RoomKey::new(9, 1), PrefillRank(0)),
            AckOutcome::Ignored(AckIgnored::StaleGeneration)
        );
        assert_eq!(r.state(), ReceiverState::ReleasePending);
        assert_eq!(
            r.on_ack(RoomKey::new(9, 2), PrefillRank(5)),
            AckOutcome::Ignored(AckIgnored::UnexpectedRank)
        );
    }

    #[test]
    fn timer_alone_never_frees_it_quarantines() {
        let t0 = Instant::now();
        let mut r = room(&[0]);
        r.fail(FailureCause::Timeout, t0, T);
        assert_eq!(r.on_tick(t0 + T / 2), GateVerdict::Hold);
        assert_eq!(r.on_tick(t0 + T), GateVerdict::Quarantine);
        assert_eq!(
            r.on_tick(t0 + T * 2),
            GateVerdict::Hold,
            "quarantine is raised once"
        );
        // A late valid ack (or proof) recovers the pages out of quarantine.
        assert_eq!(
            r.on_ack(r.key(), PrefillRank(0)),
            AckOutcome::Counted {
                have: 1,
                need: 1,
                verdict: GateVerdict::Free {
                    proof: ReleaseProof::AllAcks,
                    from_quarantine: true
                }
            }
        );
    }

    #[test]
    fn transport_proof_frees_without_acks() {
        let mut r = room(&[0, 1]);
        r.fail(FailureCause::HeartbeatLost, Instant::now(), T);
        assert_eq!(
            r.on_transport_proof(TransportProof::ReceiverFenced),
            free(ReleaseProof::Transport(TransportProof::ReceiverFenced))
        );
    }

    #[test]
    fn concluded_room_frees_at_once_and_second_failure_is_inert() {
        let mut r = room(&[0]);
        r.on_chunk().unwrap();
        r.on_complete().unwrap();
        r.commit().unwrap();
        let (notify, v) = r.fail(FailureCause::SpecGuard, Instant::now(), T);
        assert!(notify.is_empty());
        assert_eq!(v, free(ReleaseProof::Concluded));
        assert_eq!(
            r.fail(FailureCause::Shutdown, Instant::now(), T),
            (vec![], GateVerdict::Hold)
        );
    }

    #[test]
    fn every_cause_takes_the_same_gate() {
        for cause in [
            FailureCause::ClientAbort,
            FailureCause::Timeout,
            FailureCause::TransferFailed,
            FailureCause::HeartbeatLost,
            FailureCause::PrefillFailed,
            FailureCause::SpecGuard,
            FailureCause::Shutdown,
        ] {
            let mut r = room(&[0]);
            assert_eq!(
                r.fail(cause, Instant::now(), T).1,
                GateVerdict::Hold,
                "{cause:?} must wait for proof"
            );
        }
    }

    #[cfg(feature = "negative-controls")]
    #[test]
    fn unsafe_bypass_frees_immediately() {
        let mut r = ReceiverRoom::new(RoomKey::new(1, 1), [PrefillRank(0)], GateMode::UnsafeBypass);
        r.on_chunk().unwrap();
        assert_eq!(
            r.fail(FailureCause::Timeout, Instant::now(), T).1,
            free(ReleaseProof::Bypassed)
        );
    }

    #[test]
    fn normal_path_rejects_out_of_order_events() {
        let mut r = room(&[0]);
        assert!(r.commit().is_err());
        r.fail(FailureCause::ClientAbort, Instant::now(), T);
        assert!(r.on_chunk().is_err());
        assert!(r.on_complete().is_err());
    }
}
