//! `tandem-bench transfer`: TCP transport throughput on loopback against a plain socket copy measured
//! in the same run (DESIGN §7: ≥ 80% for 4 MiB pages).
//!
//! Baseline: one connection, the sender `write_all`s page-sized buffers, the receiver `read_exact`s
//! them into 16 rotating page buffers (the transport's destination footprint) — the least a byte
//! mover can do. Transport: [`TcpTransport`] into a
//! [`TcpReceiver`] with a registered [`HostRegion`] and an open room, so every page pays the real
//! costs — frame header, region bounds and room generation checks, per-page lock, reply, handle
//! accounting — with a bounded window of batches in flight. Each measurement is repeated and the
//! best of each is compared, alternating the two so that machine noise hits both.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;

use tandem_worker::release::RoomKey;
use tandem_worker::transfer::tcp::{GenerationCheck, TcpConfig, TcpReceiver, TcpTransport};
use tandem_worker::transfer::{
    BatchLimits, HostRegion, RegionId, TransferStatus, Transport, WriteBatch, WriteOp,
};

/// Parameters.
#[derive(Clone, Debug, clap::Args)]
pub struct TransferArgs {
    /// Bytes moved per measurement (MiB).
    #[arg(long, default_value_t = 1024)]
    pub mib: u64,
    /// Repetitions of each measurement (the best is kept).
    #[arg(long, default_value_t = 3)]
    pub reps: u32,
    /// Page sizes to measure (bytes).
    #[arg(long, value_delimiter = ',', default_values_t = vec![4u64 << 20, 64 << 10])]
    pub page_bytes: Vec<u64>,
}

/// One page size's result.
#[derive(Clone, Debug, PartialEq)]
pub struct TransferResult {
    /// Page size (bytes).
    pub page_bytes: u64,
    /// Plain socket copy, GB/s.
    pub baseline_gbps: f64,
    /// TCP transport, GB/s.
    pub transport_gbps: f64,
    /// Median over repetitions of (transport / baseline) measured back to back: robust to load
    /// that shifts between repetitions.
    pub median_pair_ratio: f64,
}

impl TransferResult {
    /// The headline ratio: the median over repetitions of transport / baseline measured back to
    /// back (the bests alone swing widely on a loaded machine).
    pub fn ratio(&self) -> f64 {
        self.median_pair_ratio
    }

    /// Best transport / best baseline.
    pub fn best_ratio(&self) -> f64 {
        if self.baseline_gbps > 0.0 {
            self.transport_gbps / self.baseline_gbps
        } else {
            0.0
        }
    }

    /// The report line.
    pub fn line(&self) -> String {
        format!(
            "page_bytes={} ratio={:.3} best_baseline_gbps={:.2} best_transport_gbps={:.2} best_ratio={:.3}",
            self.page_bytes,
            self.ratio(),
            self.baseline_gbps,
            self.transport_gbps,
            self.best_ratio()
        )
    }
}

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum TransferBenchError {
    /// Socket setup or copy failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The transport failed.
    #[error("transport: {0}")]
    Transport(String),
}

/// Runs every page size.
pub fn run(args: &TransferArgs) -> Result<Vec<TransferResult>, TransferBenchError> {
    let mut out = Vec::new();
    for &page in &args.page_bytes {
        let pages = ((args.mib << 20) / page).max(1);
        let (mut base, mut xfer) = (0f64, 0f64);
        let mut pair_ratios = Vec::new();
        for _ in 0..args.reps.max(1) {
            let b = plain_copy(page, pages)?;
            let x = transport_copy(page, pages)?;
            base = base.max(b);
            xfer = xfer.max(x);
            if b > 0.0 {
                pair_ratios.push(x / b);
            }
        }
        pair_ratios.sort_by(f64::total_cmp);
        let median_pair_ratio = pair_ratios
            .get(pair_ratios.len() / 2)
            .copied()
            .unwrap_or(0.0);
        out.push(TransferResult {
            page_bytes: page,
            baseline_gbps: base,
            transport_gbps: xfer,
            median_pair_ratio,
        });
    }
    Ok(out)
}

/// Destination pages both sides rotate over (the KV lands in distinct pages, not one hot buffer).
const SLOTS: u32 = 16;

fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9
}

fn plain_copy(page: u64, pages: u64) -> Result<f64, TransferBenchError> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        // The same destination footprint as the transport: rotate over `SLOTS` page buffers.
        let mut bufs: Vec<Vec<u8>> = (0..SLOTS).map(|_| vec![0u8; page as usize]).collect();
        for i in 0..pages {
            s.read_exact(&mut bufs[(i % u64::from(SLOTS)) as usize])?;
        }
        s.write_all(&[1])?;
        Ok(())
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let src = vec![7u8; page as usize];
    let t0 = Instant::now();
    for _ in 0..pages {
        s.write_all(&src)?;
    }
    let mut done = [0u8; 1];
    s.read_exact(&mut done)?;
    let elapsed = t0.elapsed();
    reader
        .join()
        .map_err(|_| TransferBenchError::Transport("reader thread panicked".into()))??;
    Ok(gbps(page * pages, elapsed))
}

fn transport_copy(page: u64, pages: u64) -> Result<f64, TransferBenchError> {
    let rx = TcpReceiver::bind("127.0.0.1:0", GenerationCheck::Enforced)?;
    let slots = SLOTS;
    rx.register_region(RegionId(0), Arc::new(HostRegion::new(slots, page)));
    let key = RoomKey::new(1, 1);
    rx.open_room(key);
    let tx = TcpTransport::new(TcpConfig::default());
    let peer = rx.addr().to_string();
    let src = Bytes::from(vec![7u8; page as usize]);
    // Batches of up to 8 pages (and at most 64 MiB), a window of 4 batches in flight.
    let per_batch = (8u64).min(((64u64 << 20) / page).max(1));
    let window = 4usize;
    let limits = BatchLimits::default();
    let mut in_flight = std::collections::VecDeque::new();
    let deadline = || Instant::now() + Duration::from_secs(60);
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < pages {
        let n = per_batch.min(pages - sent);
        let ops = (0..n)
            .map(|i| WriteOp {
                key,
                region: RegionId(0),
                offset: ((sent + i) % u64::from(slots)) * page,
                data: src.clone(),
            })
            .collect();
        let batch = WriteBatch::new(ops, limits)
            .map_err(|e| TransferBenchError::Transport(e.to_string()))?;
        in_flight.push_back(
            tx.submit(&peer, batch, None)
                .map_err(|e| TransferBenchError::Transport(e.to_string()))?,
        );
        sent += n;
        if in_flight.len() >= window
            && let Some(h) = in_flight.pop_front()
        {
            finish(&tx, h, deadline())?;
        }
    }
    while let Some(h) = in_flight.pop_front() {
        finish(&tx, h, deadline())?;
    }
    Ok(gbps(page * pages, t0.elapsed()))
}

fn finish(
    tx: &TcpTransport,
    h: tandem_worker::transfer::TransferHandle,
    deadline: Instant,
) -> Result<(), TransferBenchError> {
    match tx
        .wait(h, deadline)
        .map_err(|e| TransferBenchError::Transport(e.to_string()))?
    {
        TransferStatus::Completed => {
            tx.release(h)
                .map_err(|e| TransferBenchError::Transport(e.to_string()))?;
            Ok(())
        }
        other => Err(TransferBenchError::Transport(format!(
            "batch ended {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_moves_bytes_and_reports_a_ratio() {
        let r = run(&TransferArgs {
            mib: 4,
            reps: 1,
            page_bytes: vec![64 << 10],
        })
        .unwrap();
        assert_eq!(r.len(), 1);
        assert!(r[0].baseline_gbps > 0.0 && r[0].transport_gbps > 0.0);
        assert!(r[0].line().contains("ratio="));
    }
}
