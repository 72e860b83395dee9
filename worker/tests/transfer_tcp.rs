//! TCP transport on loopback: landing, receiver-side checks (bounds, stale generation), deadlines that
//! never report failure while writes may land, and a peer that dies mid-transfer.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tandem_worker::release::RoomKey;
use tandem_worker::transfer::tcp::{GenerationCheck, TcpConfig, TcpReceiver, TcpTransport};
use tandem_worker::transfer::{
    BatchLimits, FailureKind, HostRegion, ReceiveRegion, RegionId, TransferStatus, Transport,
    WriteBatch, WriteOp,
};

const PAGE: u64 = 4096;

fn receiver(check: GenerationCheck) -> (TcpReceiver, Arc<HostRegion>) {
    let rx = TcpReceiver::bind("127.0.0.1:0", check).unwrap();
    let region = Arc::new(HostRegion::new(8, PAGE));
    rx.register_region(RegionId(1), region.clone());
    (rx, region)
}

fn pages(key: RoomKey, first: u64, n: u64, fill: u8) -> WriteBatch {
    let ops = (first..first + n)
        .map(|p| WriteOp {
            key,
            region: RegionId(1),
            offset: p * PAGE,
            data: Bytes::from(vec![fill; PAGE as usize]),
        })
        .collect();
    WriteBatch::new(ops, BatchLimits::default()).unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

fn byte_at(region: &HostRegion, offset: u64) -> u8 {
    let mut b = [0u8; 1];
    region.read(offset, &mut b).unwrap();
    b[0]
}

#[test]
fn writes_land_in_an_open_room() {
    let (rx, region) = receiver(GenerationCheck::Enforced);
    let key = RoomKey::new(1, 1);
    rx.open_room(key);
    let tx = TcpTransport::new(TcpConfig::default());
    let h = tx
        .submit(&rx.addr().to_string(), pages(key, 0, 4, 0xAB), None)
        .unwrap();
    assert_eq!(tx.wait(h, soon()).unwrap(), TransferStatus::Completed);
    assert_eq!(byte_at(&region, 3 * PAGE + 17), 0xAB);
    assert_eq!(rx.stats().applied, 4);
    assert_eq!(tx.release(h).unwrap(), TransferStatus::Completed);
}

#[test]
fn late_write_of_a_fenced_generation_is_dropped_and_counted() {
    let (rx, region) = receiver(GenerationCheck::Enforced);
    let old = RoomKey::new(5, 1);
    rx.open_room(old);
    rx.fence(old, soon()).unwrap();
    // The room id is reused by a new incarnation (pages reassigned to another request).
    rx.open_room(RoomKey::new(5, 2));
    let tx = TcpTransport::new(TcpConfig::default());
    let h = tx
        .submit(&rx.addr().to_string(), pages(old, 0, 2, 0xEE), None)
        .unwrap();
    assert_eq!(
        tx.wait(h, soon()).unwrap(),
        TransferStatus::Failed(FailureKind::Rejected {
            stale: 2,
            invalid: 0
        })
    );
    assert_eq!(byte_at(&region, 0), 0, "late write must not land");
    assert_eq!(rx.stats().dropped_stale, 2);
    // Writes of a room that was never opened are dropped too.
    let h = tx
        .submit(
            &rx.addr().to_string(),
            pages(RoomKey::new(99, 1), 0, 1, 0xEE),
            None,
        )
        .unwrap();
    assert!(matches!(
        tx.wait(h, soon()).unwrap(),
        TransferStatus::Failed(FailureKind::Rejected { stale: 1, .. })
    ));
}

#[test]
fn negative_control_without_generation_check_the_late_write_lands() {
    let (rx, region) = receiver(GenerationCheck::Unchecked);
    let old = RoomKey::new(5, 1);
    rx.open_room(old);
    rx.fence(old, soon()).unwrap();
    rx.open_room(RoomKey::new(5, 2));
    let tx = TcpTransport::new(TcpConfig::default());
    let h = tx
        .submit(&rx.addr().to_string(), pages(old, 0, 1, 0xEE), None)
        .unwrap();
    assert_eq!(tx.wait(h, soon()).unwrap(), TransferStatus::Completed);
    assert_eq!(
        byte_at(&region, 0),
        0xEE,
        "without the check the stale write corrupts the page"
    );
}

#[test]
fn out_of_bounds_and_unknown_region_are_refused_whole() {
    let (rx, region) = receiver(GenerationCheck::Enforced);
    let key = RoomKey::new(1, 1);
    rx.open_room(key);
    let tx = TcpTransport::new(TcpConfig::default());
    let bad = WriteBatch::new(
        vec![
            WriteOp {
                key,
                region: RegionId(1),
                offset: 8 * PAGE - 10,
                data: Bytes::from(vec![1u8; 20]),
            },
            WriteOp {
                key,
                region: RegionId(7),
                offset: 0,
                data: Bytes::from(vec![1u8; 20]),
            },
        ],
        BatchLimits::default(),
    )
    .unwrap();
    let h = tx.submit(&rx.addr().to_string(), bad, None).unwrap();
    assert_eq!(
        tx.wait(h, soon()).unwrap(),
        TransferStatus::Failed(FailureKind::Rejected {
            stale: 0,
            invalid: 2
        })
    );
    assert_eq!(byte_at(&region, 8 * PAGE - 1), 0);
    assert_eq!(rx.stats().dropped_invalid, 2);
}

#[test]
fn deadline_on_a_stalled_peer_is_in_flight_not_failed_and_peer_death_fails_it() {
    // A "receiver" that accepts and never reads: writes sit in socket buffers and may still land.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let tx = TcpTransport::new(TcpConfig::default());
    let h = tx
        .submit(&addr, pages(RoomKey::new(1, 1), 0, 2, 1), None)
        .unwrap();
    let (conn, _) = listener.accept().unwrap();
    let status = tx
        .wait(h, Instant::now() + Duration::from_millis(100))
        .unwrap();
    assert_eq!(
        status,
        TransferStatus::InFlight,
        "a timeout is never reported as a failure"
    );
    assert!(tx.release(h).is_err(), "a live handle cannot be released");
    assert!(
        !tx.drain(Instant::now() + Duration::from_millis(20))
            .quiescent()
    );
    // The peer dies: the connection closes, the handle turns terminal within the deadline.
    drop(conn);
    drop(listener);
    let t0 = Instant::now();
    assert_eq!(
        tx.wait(h, soon()).unwrap(),
        TransferStatus::Failed(FailureKind::PeerLost)
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn receiver_killed_mid_transfer_then_restarted_peer_works() {
    let (mut rx, _) = receiver(GenerationCheck::Enforced);
    let addr = rx.addr().to_string();
    let key = RoomKey::new(1, 1);
    rx.open_room(key);
    let tx = TcpTransport::new(TcpConfig::default());
    // Large enough that the kill lands mid-stream.
    let big: Vec<WriteOp> = (0..64)
        .map(|i| WriteOp {
            key,
            region: RegionId(1),
            offset: (i % 8) * PAGE,
            data: Bytes::from(vec![3u8; PAGE as usize]),
        })
        .collect();
    let h = tx
        .submit(
            &addr,
            WriteBatch::new(big, BatchLimits::default()).unwrap(),
            None,
        )
        .unwrap();
    rx.shutdown();
    let status = tx.wait(h, soon()).unwrap();
    assert!(status.is_terminal(), "{status:?}");
    // A restarted receiver on a new port: the transport reconnects (no stale connection reused).
    let (rx2, region2) = receiver(GenerationCheck::Enforced);
    let key2 = RoomKey::new(1, 2);
    rx2.open_room(key2);
    let h2 = tx
        .submit(&rx2.addr().to_string(), pages(key2, 0, 1, 9), None)
        .unwrap();
    assert_eq!(tx.wait(h2, soon()).unwrap(), TransferStatus::Completed);
    assert_eq!(byte_at(&region2, 5), 9);
}

#[test]
fn cancel_before_send_drops_queued_writes() {
    let (rx, _) = receiver(GenerationCheck::Enforced);
    let key = RoomKey::new(1, 1);
    rx.open_room(key);
    let tx = TcpTransport::new(TcpConfig::default());
    let addr = rx.addr().to_string();
    let h = tx.submit(&addr, pages(key, 0, 8, 1), None).unwrap();
    let _ = tx.cancel(h).unwrap();
    let status = tx.wait(h, soon()).unwrap();
    assert!(
        matches!(
            status,
            TransferStatus::Cancelled | TransferStatus::Completed
        ),
        "{status:?}"
    );
    assert!(tx.drain(soon()).quiescent());
}

#[test]
fn writes_land_in_a_kv_pool_and_never_in_a_free_page() {
    use tandem_worker::memory::Allocator;
    use tandem_worker::memory::mmap::MmapBackend;
    use tandem_worker::memory::pool::{KvPool, PoolLayout, PoolRole, PoolSpec};
    use tandem_worker::model::{Attention, ModelIdentity};
    use tandem_worker::transfer::pool_region::PoolRegion;

    let model = ModelIdentity {
        name: "tiny".into(),
        layers: 2,
        attention: Attention::Gqa {
            kv_heads: 2,
            head_dim: 64,
        },
        dtype_bytes: 2,
        row_extra_bytes: 0,
    };
    let spec = PoolSpec {
        role: PoolRole::Target,
        model,
        page_tokens: 16,
        pages: 8,
        layout: PoolLayout::PageFirst,
    };
    let pool = Arc::new(KvPool::new(spec, &Allocator::new("decode", MmapBackend::new())).unwrap());
    let rx = TcpReceiver::bind("127.0.0.1:0", GenerationCheck::Enforced).unwrap();
    rx.register_region(
        RegionId(1),
        Arc::new(PoolRegion::for_tcp(pool.clone()).unwrap()),
    );
    let key = RoomKey::new(3, 1);
    rx.open_room(key);
    let page = pool.allocate(1).unwrap()[0];
    let chunk = pool.chunk_region(page, 1).unwrap();
    let free_page = tandem_worker::memory::pool::PageId((page.0 + 1) % 8);
    let free_chunk = pool.chunk_region(free_page, 0).unwrap();
    let tx = TcpTransport::new(TcpConfig::default());
    let ops = vec![
        WriteOp {
            key,
            region: RegionId(1),
            offset: chunk.offset as u64,
            data: Bytes::from(vec![0x5A; chunk.len]),
        },
        WriteOp {
            key,
            region: RegionId(1),
            offset: free_chunk.offset as u64,
            data: Bytes::from(vec![0x5A; chunk.len]),
        },
    ];
    let h = tx
        .submit(
            &rx.addr().to_string(),
            WriteBatch::new(ops, BatchLimits::default()).unwrap(),
            None,
        )
        .unwrap();
    assert_eq!(
        tx.wait(h, soon()).unwrap(),
        TransferStatus::Failed(FailureKind::Rejected {
            stale: 0,
            invalid: 1
        })
    );
    let mut back = vec![0u8; chunk.len];
    pool.read_chunk(page, 1, 0, &mut back).unwrap();
    assert!(
        back.iter().all(|b| *b == 0x5A),
        "the allocated page received the write"
    );
    assert_eq!(rx.stats().dropped_invalid, 1, "the free page was refused");
}
