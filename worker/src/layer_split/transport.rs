//! The transport seam between the CP ranks of a group: a rank sends encoded [`super::wire`] frames to
//! a peer rank and receives frames from any peer.
//!
//! [`ChannelLink`] is the in-process implementation (one thread per rank, `std::sync::mpsc`);
//! [`super::tcp_link::TcpRankLink`] sends `len u32 | frame` on a stream per peer and runs a reader
//! thread per peer feeding the same [`RankLink::recv`]. Sending never blocks on the receiver (the channel is
//! unbounded, as a socket writer thread with its own queue would be), which is what lets the owner
//! issue layer `i`'s broadcast and go on with the indexer computation (seed 004 "通信隐藏").

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

use super::error::LayerSplitError;

/// What [`RankLink::recv`] got.
#[derive(Debug)]
pub enum Received {
    /// One encoded frame.
    Frame(Vec<u8>),
    /// Nothing within the timeout.
    Timeout,
    /// Every peer has closed its link: nothing will ever arrive again.
    Closed,
}

/// One rank's end of the group's links.
pub trait RankLink: Send {
    /// This rank.
    fn rank(&self) -> u32;
    /// CP size.
    fn cp_size(&self) -> u32;
    /// Sends `frame` to rank `to` without waiting for the receiver.
    ///
    /// # Errors
    /// [`LayerSplitError::RankOutOfRange`], or [`LayerSplitError::Transport`] when the peer is gone.
    fn send(&self, to: u32, frame: Vec<u8>) -> Result<(), LayerSplitError>;
    /// Receives the next frame from any peer, waiting at most `timeout`.
    fn recv(&self, timeout: Duration) -> Received;
}

/// In-process [`RankLink`]: frames move through `mpsc` channels.
pub struct ChannelLink {
    rank: u32,
    peers: Vec<Option<Sender<Vec<u8>>>>,
    inbox: Receiver<Vec<u8>>,
}

/// A full mesh of `cp_size` in-process links, index = rank. Dropping a link closes it towards every
/// peer.
pub fn channel_mesh(cp_size: u32) -> Vec<ChannelLink> {
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..cp_size).map(|_| channel()).unzip();
    receivers
        .into_iter()
        .enumerate()
        .map(|(rank, inbox)| ChannelLink {
            rank: rank as u32,
            peers: senders
                .iter()
                .enumerate()
                .map(|(r, s)| (r != rank).then(|| s.clone()))
                .collect(),
            inbox,
        })
        .collect()
}

impl RankLink for ChannelLink {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn cp_size(&self) -> u32 {
        self.peers.len() as u32
    }

    fn send(&self, to: u32, frame: Vec<u8>) -> Result<(), LayerSplitError> {
        let peer = self.peers.get(to as usize).and_then(Option::as_ref).ok_or(
            LayerSplitError::RankOutOfRange {
                rank: to,
                cp_size: self.cp_size(),
            },
        )?;
        peer.send(frame).map_err(|_| LayerSplitError::Transport {
            peer: to,
            reason: "peer link closed".into(),
        })
    }

    fn recv(&self, timeout: Duration) -> Received {
        match self.inbox.recv_timeout(timeout) {
            Ok(f) => Received::Frame(f),
            Err(RecvTimeoutError::Timeout) => Received::Timeout,
            Err(RecvTimeoutError::Disconnected) => Received::Closed,
        }
    }
}
