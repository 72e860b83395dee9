//! Transfer rooms and the abort-safe KV release protocol (DESIGN contract 3, seed 004 BugFix #1).
//!
//! A *room* is one request's KV hand-off from prefill to decode. Each incarnation of a room is named
//! by `(room id, generation)`: a retry of the same request reuses the id with a higher generation, so a
//! late message of an old incarnation can never be mistaken for the current one (R-ABORT-7).
//!
//! - [`id`]: the identifiers carried in every room-scoped message.
//! - [`sender`]: the prefill-side room table — marks rooms failed, counts outstanding writes, holds
//!   source pages until the send is terminal and emits each abort ack exactly once (R-ABORT-2/3/6).
//! - [`receiver`]: the decode-side room state machine and its release gate — pages are freed only with
//!   every required ack or a transport proof, otherwise quarantined with an alarm (R-ABORT-1/4/5).
//! - [`quarantine`]: pages that could not be proven safe, kept out of the free list until proof arrives.
//!
//! Everything here is pure state: no I/O, no clocks except the `Instant`s callers pass in.

pub mod id;
pub mod quarantine;
pub mod receiver;
pub mod sender;

pub use id::{DecodeRank, Generation, PrefillRank, RoomId, RoomKey};
