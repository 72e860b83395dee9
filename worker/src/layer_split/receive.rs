//! The consumer side of a layer broadcast: a per-layer completion event and one layer-sized receive
//! scratch (DESIGN contract 6; reference/dataplane.md R-LS-2, TC-LS-02).
//!
//! Frames may arrive early (the owner of layer `i + 3` is already there) or interleaved with the group
//! handshake; they wait in a pending map keyed by `(step, layer)`. [`LayerReceiver::wait`] is the event:
//! it returns once the frame for `(step, layer)` has been copied into the scratch, and attention on
//! that layer may then read the scratch. Waiting on a layer the rank owns itself, or on a layer whose
//! owner has gone, is an error, never a silent read. The scratch is laid out like one layer of the
//! pool (`pool_pages × chunk_bytes`, chunk of page `p` at `p × chunk_bytes`), which is what a kernel
//! indexing by page id reads: reading it without the wait reads whatever the previous layer left.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::error::LayerSplitError;
use super::ownership::OwnerMap;
use super::transport::{RankLink, Received};
use super::wire::{Frame, LayerFrame};

/// Pending frames, the per-layer delivery record and the receive scratch of one rank.
pub struct LayerReceiver {
    rank: u32,
    /// `None`: a replicated group (every rank stores every layer; nothing is broadcast, and a
    /// layer frame is refused), whose link still carries the hello and the step frames.
    map: Option<OwnerMap>,
    cp_size: u32,
    chunk_bytes: usize,
    pool_pages: u32,
    pending: HashMap<(u64, u32), LayerFrame>,
    /// Last step delivered per layer (duplicate detection).
    delivered: Vec<Option<u64>>,
    hellos: HashMap<u32, u64>,
    scratch: Vec<u8>,
    scratch_pages: Vec<u32>,
    scratch_request: Option<u64>,
    /// `Step` and `StepDone` frames (the serving path's coordination), in arrival order, taken
    /// with [`LayerReceiver::next_control`]; layer waits keep them here while they pump.
    control: VecDeque<Frame>,
}

impl LayerReceiver {
    /// A receiver for `rank` with a zeroed scratch of `pool_pages × chunk_bytes` bytes.
    pub fn new(rank: u32, map: OwnerMap, pool_pages: u32, chunk_bytes: usize) -> Self {
        let layers = map.layers() as usize;
        Self {
            rank,
            cp_size: map.cp_size(),
            map: Some(map),
            chunk_bytes,
            pool_pages,
            pending: HashMap::new(),
            delivered: vec![None; layers],
            hellos: HashMap::new(),
            scratch: vec![0u8; pool_pages as usize * chunk_bytes],
            scratch_pages: Vec::new(),
            scratch_request: None,
            control: VecDeque::new(),
        }
    }

    /// A receiver for `rank` of a replicated group of `cp_size` ranks: no scratch, no layer
    /// frame accepted; the hello (digest 0) and the step frames only.
    pub fn replicated(rank: u32, cp_size: u32) -> Self {
        Self {
            rank,
            map: None,
            cp_size,
            chunk_bytes: 0,
            pool_pages: 0,
            pending: HashMap::new(),
            delivered: Vec::new(),
            hellos: HashMap::new(),
            scratch: Vec::new(),
            scratch_pages: Vec::new(),
            scratch_request: None,
            control: VecDeque::new(),
        }
    }

    /// The owner of `layer`; under replication no layer has a broadcasting owner.
    fn owner(&self, layer: u32) -> Result<u32, LayerSplitError> {
        match &self.map {
            Some(m) => m.owner(layer),
            None => Err(LayerSplitError::BadFrame(format!(
                "layer {layer}: a replicated group broadcasts no layer"
            ))),
        }
    }

    /// Bytes of the receive scratch (one layer of the pool).
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch.len() as u64
    }

    /// Group setup (R-LS-1): sends this rank's owner-map digest to every peer and waits until every
    /// peer's digest has arrived; layer frames that overtake a slow hello are kept for later.
    ///
    /// # Errors
    /// [`LayerSplitError::OwnerMapMismatch`] for the first peer whose digest differs;
    /// transport, timeout and frame errors.
    pub fn handshake(
        &mut self,
        link: &dyn RankLink,
        timeout: Duration,
    ) -> Result<(), LayerSplitError> {
        let digest = self.map.as_ref().map_or(0, OwnerMap::digest);
        let hello = Frame::Hello {
            rank: self.rank,
            digest,
        }
        .encode();
        for peer in (0..link.cp_size()).filter(|p| *p != self.rank) {
            link.send(peer, hello.clone())?;
        }
        let peers = link.cp_size().saturating_sub(1) as usize;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((peer_rank, peer)) = self.hellos.iter().find(|(_, d)| **d != digest) {
                return Err(LayerSplitError::OwnerMapMismatch {
                    local_rank: self.rank,
                    local: digest,
                    peer_rank: *peer_rank,
                    peer: *peer,
                });
            }
            if self.hellos.len() >= peers {
                return Ok(());
            }
            match self.pump(link, deadline)? {
                Pumped::Frame => {}
                Pumped::Timeout => {
                    return Err(LayerSplitError::Transport {
                        peer: u32::MAX,
                        reason: format!(
                            "handshake: {} of {peers} peers answered",
                            self.hellos.len()
                        ),
                    });
                }
                Pumped::Closed => {
                    return Err(LayerSplitError::Transport {
                        peer: u32::MAX,
                        reason: "handshake: every peer link closed".into(),
                    });
                }
            }
        }
    }

    /// The per-layer event: blocks until the frame of `(step, layer)` from the layer's owner has
    /// arrived, then copies its chunks into the scratch at their page offsets. Says whether the frame
    /// was already there or had to be waited for.
    ///
    /// # Errors
    /// [`LayerSplitError::NeverBroadcast`] when `layer` is this rank's own (nobody broadcasts it here)
    /// or every peer link closed first; [`LayerSplitError::BroadcastTimeout`]; frame validation errors
    /// ([`LayerSplitError::WrongSender`], [`LayerSplitError::DuplicateLayer`], bad page ids).
    pub fn wait(
        &mut self,
        link: &dyn RankLink,
        step: u64,
        layer: u32,
        timeout: Duration,
    ) -> Result<Arrival, LayerSplitError> {
        let owner = self.owner(layer)?;
        if owner == self.rank {
            return Err(LayerSplitError::NeverBroadcast { step, layer, owner });
        }
        // Take what has already landed without blocking: if the frame is among it, the broadcast was
        // fully hidden behind the work done since it was issued.
        while !self.pending.contains_key(&(step, layer)) {
            match link.recv(Duration::ZERO) {
                Received::Frame(bytes) => self.accept(Frame::decode(&bytes)?)?,
                Received::Timeout | Received::Closed => break,
            }
        }
        let mut arrival = Arrival::AlreadyThere;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(frame) = self.pending.remove(&(step, layer)) {
                self.deliver(frame);
                self.delivered[layer as usize] = Some(step);
                return Ok(arrival);
            }
            arrival = Arrival::Waited;
            match self.pump(link, deadline)? {
                Pumped::Frame => {}
                Pumped::Timeout => {
                    return Err(LayerSplitError::BroadcastTimeout {
                        step,
                        layer,
                        timeout_ms: timeout.as_millis() as u64,
                    });
                }
                Pumped::Closed => {
                    return Err(LayerSplitError::NeverBroadcast { step, layer, owner });
                }
            }
        }
    }

    /// The next `Step` or `StepDone` frame, waiting at most `timeout`; `Ok(None)` when none came.
    /// Layer frames that arrive meanwhile are kept for their waits.
    ///
    /// # Errors
    /// [`LayerSplitError::Transport`] when every peer link closed; frame errors.
    pub fn next_control(
        &mut self,
        link: &dyn RankLink,
        timeout: Duration,
    ) -> Result<Option<Frame>, LayerSplitError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(f) = self.control.pop_front() {
                return Ok(Some(f));
            }
            match self.pump(link, deadline)? {
                Pumped::Frame => {}
                Pumped::Timeout => return Ok(None),
                Pumped::Closed => {
                    return Err(LayerSplitError::Transport {
                        peer: u32::MAX,
                        reason: "every peer link closed".into(),
                    });
                }
            }
        }
    }

    /// Takes one frame someone else read from the link (`bytes`, as [`RankLink::recv`] gave them):
    /// a layer frame waits for its [`LayerReceiver::take_layer`], a `Step` or `StepDone` for
    /// [`LayerReceiver::pop_control`]. For a reader thread that owns the link's receiving side
    /// while waiters only look here (the engine path, `roles::prefill::cp_engine`).
    ///
    /// # Errors
    /// Frame decoding and validation errors (the frame is dropped).
    pub fn accept_bytes(&mut self, bytes: &[u8]) -> Result<(), LayerSplitError> {
        self.accept(Frame::decode(bytes)?)
    }

    /// The per-layer event without reading the link: when the frame of `(step, layer)` has been
    /// accepted, copies it into the scratch and returns true; false while it has not come.
    ///
    /// # Errors
    /// [`LayerSplitError::NeverBroadcast`] when `layer` is this rank's own (nobody broadcasts it
    /// here); [`LayerSplitError::BadFrame`] under replication.
    pub fn take_layer(&mut self, step: u64, layer: u32) -> Result<bool, LayerSplitError> {
        let owner = self.owner(layer)?;
        if owner == self.rank {
            return Err(LayerSplitError::NeverBroadcast { step, layer, owner });
        }
        match self.pending.remove(&(step, layer)) {
            Some(frame) => {
                self.deliver(frame);
                self.delivered[layer as usize] = Some(step);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The oldest `Step` or `StepDone` frame accepted and not taken yet.
    pub fn pop_control(&mut self) -> Option<Frame> {
        self.control.pop_front()
    }

    /// Drops layer frames kept for steps before `step`: a step that failed (or whose wait was
    /// skipped) leaves its later layers' frames behind, and nobody will wait for them.
    pub fn forget_before(&mut self, step: u64) {
        self.pending.retain(|(s, _), _| *s >= step);
    }

    /// Layer frames kept for a later wait.
    pub fn pending_frames(&self) -> usize {
        self.pending.len()
    }

    /// The scratch chunk of `page` — valid for the layer last waited on if that frame carried `page`.
    ///
    /// # Errors
    /// [`LayerSplitError::BadFrame`] when `page` is outside the pool.
    pub fn chunk(&self, page: u32) -> Result<&[u8], LayerSplitError> {
        let start = page as usize * self.chunk_bytes;
        self.scratch
            .get(start..start + self.chunk_bytes)
            .ok_or_else(|| LayerSplitError::BadFrame(format!("page {page} outside the pool")))
    }

    /// Page ids carried by the frame last delivered into the scratch.
    pub fn scratch_pages(&self) -> &[u32] {
        &self.scratch_pages
    }

    /// Request id of the frame last delivered into the scratch.
    pub fn scratch_request(&self) -> Option<u64> {
        self.scratch_request
    }

    fn deliver(&mut self, frame: LayerFrame) {
        // Validated in `accept`: every page < pool_pages and payload = pages × chunk_bytes.
        for (k, page) in frame.pages.iter().enumerate() {
            let dst = *page as usize * self.chunk_bytes;
            let src = k * self.chunk_bytes;
            self.scratch[dst..dst + self.chunk_bytes]
                .copy_from_slice(&frame.payload[src..src + self.chunk_bytes]);
        }
        self.scratch_pages = frame.pages;
        self.scratch_request = Some(frame.request);
    }

    /// Takes one frame, waiting until `deadline` at most (a deadline already passed still takes
    /// a frame that has landed: a zero-timeout poll reads the link).
    fn pump(&mut self, link: &dyn RankLink, deadline: Instant) -> Result<Pumped, LayerSplitError> {
        let left = deadline.saturating_duration_since(Instant::now());
        match link.recv(left) {
            Received::Frame(bytes) => {
                self.accept(Frame::decode(&bytes)?)?;
                Ok(Pumped::Frame)
            }
            Received::Timeout => Ok(Pumped::Timeout),
            Received::Closed => Ok(Pumped::Closed),
        }
    }

    fn accept(&mut self, frame: Frame) -> Result<(), LayerSplitError> {
        match frame {
            Frame::Hello { rank, digest } => {
                if rank >= self.cp_size || rank == self.rank {
                    return Err(LayerSplitError::RankOutOfRange {
                        rank,
                        cp_size: self.cp_size,
                    });
                }
                self.hellos.insert(rank, digest);
                Ok(())
            }
            Frame::Layer(f) => {
                let owner = self.owner(f.layer)?;
                if f.from != owner {
                    return Err(LayerSplitError::WrongSender {
                        from: f.from,
                        layer: f.layer,
                        owner,
                    });
                }
                if f.chunk_bytes as usize != self.chunk_bytes {
                    return Err(LayerSplitError::BadFrame(format!(
                        "chunk of {} bytes, pool chunk is {}",
                        f.chunk_bytes, self.chunk_bytes
                    )));
                }
                if let Some(p) = f.pages.iter().find(|p| **p >= self.pool_pages) {
                    return Err(LayerSplitError::BadFrame(format!(
                        "page {p} outside 0..{}",
                        self.pool_pages
                    )));
                }
                let already = self.delivered[f.layer as usize].is_some_and(|s| s >= f.step);
                if already || self.pending.contains_key(&(f.step, f.layer)) {
                    return Err(LayerSplitError::DuplicateLayer {
                        step: f.step,
                        layer: f.layer,
                    });
                }
                self.pending.insert((f.step, f.layer), f);
                Ok(())
            }
            Frame::Step(_) | Frame::StepDone(_) | Frame::StepAbort { .. } => {
                self.control.push_back(frame);
                Ok(())
            }
        }
    }
}

/// How a [`LayerReceiver::wait`] was satisfied — the overlap figure of seed 004 "通信隐藏".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// The frame had landed before the wait began: the broadcast was hidden behind the indexer.
    AlreadyThere,
    /// The consumer blocked for it.
    Waited,
}

enum Pumped {
    Frame,
    Timeout,
    Closed,
}
