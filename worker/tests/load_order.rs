//! Load-before-read (DESIGN contract 5, seed 004 BugFix #2; reference TC-HIC-01..04).
//!
//! A request's prefix is loaded from host pages into "device" pages layer by layer for two pools, the
//! KV pool and the indexer pool, while compute walks the layers and verifies every byte it reads
//! against a deterministic function of (page key, pool, layer, offset). Device pages start with another
//! request's bytes, so a read before its load finished is a detected mismatch. Every rule has a
//! negative control that must produce mismatches. The host executor runs the plans of
//! `load::plan`, the same the CUDA backend runs (its device check: `load_order_cuda.rs`).

use std::sync::Arc;
use std::time::Duration;

use tandem_worker::load::error::LoadError;
use tandem_worker::load::event_ledger::EventLedger;
use tandem_worker::load::host_locks::{EvictionPolicy, HostPageLocks};
use tandem_worker::load::order::{
    ForwardStream, LoadContext, LoadExecutor, LoadOptions, PagePools, wait_layer,
};
use tandem_worker::load::plan::{
    FencePolicy, LoadJob, PageCopy, ReadPolicy, check_layer_reads, check_load_plan,
    plan_layer_reads, plan_load,
};
use tandem_worker::memory::pool::PoolRole;
use tandem_worker::tier::PageKey;

const LAYERS: u32 = 4;
const PAGES: u32 = 8;
const PAGE_BYTES: usize = 256;
const POOLS: [PoolRole; 2] = [PoolRole::Target, PoolRole::Indexer];
const WAIT: Duration = Duration::from_secs(10);

/// The bytes page `key` holds for (pool, layer): a small deterministic function of its inputs.
fn page_bytes(key: PageKey, pool: PoolRole, layer: u32) -> Vec<u8> {
    let seed =
        key.as_u64().wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (u64::from(layer) << 40) ^ pool as u64;
    (0..PAGE_BYTES)
        .map(|off| (seed.rotate_left((off % 64) as u32) as u8) ^ (off as u8).wrapping_mul(31))
        .collect()
}

fn keys(base: u64) -> Vec<PageKey> {
    (0..u64::from(PAGES))
        .map(|i| PageKey::from_trace_id(base + i))
        .collect()
}

fn fill(pools: &PagePools, keys: &[PageKey]) {
    for (page, key) in keys.iter().enumerate() {
        for pool in POOLS {
            for layer in 0..LAYERS {
                pools
                    .write(pool, layer, page as u32, &page_bytes(*key, pool, layer))
                    .expect("in range");
            }
        }
    }
}

/// Counts pages of `layer` that do not hold `keys`' bytes, for every pool in `reads`.
fn mismatches(device: &PagePools, keys: &[PageKey], layer: u32, reads: &[PoolRole]) -> usize {
    let mut bad = 0;
    for (page, key) in keys.iter().enumerate() {
        for pool in reads {
            let got = device.read(*pool, layer, page as u32).expect("in range");
            if got != page_bytes(*key, *pool, layer) {
                bad += 1;
            }
        }
    }
    bad
}

struct Rig {
    host: Arc<PagePools>,
    device: Arc<PagePools>,
    events: Arc<EventLedger>,
    forward: Arc<ForwardStream>,
    locks: Arc<HostPageLocks>,
    exec: LoadExecutor,
}

fn rig(options: LoadOptions) -> Rig {
    let host = Arc::new(PagePools::new(&POOLS, LAYERS, PAGES, PAGE_BYTES));
    let device = Arc::new(PagePools::new(&POOLS, LAYERS, PAGES, PAGE_BYTES));
    let events = Arc::new(EventLedger::new());
    let forward = Arc::new(ForwardStream::new());
    let locks = Arc::new(HostPageLocks::new());
    let exec = LoadExecutor::spawn(
        LoadContext {
            host: Arc::clone(&host),
            device: Arc::clone(&device),
            events: Arc::clone(&events),
            forward: Arc::clone(&forward),
            locks: Arc::clone(&locks),
        },
        options,
    )
    .expect("spawn");
    Rig {
        host,
        device,
        events,
        forward,
        locks,
        exec,
    }
}

fn identity_job(keys: &[PageKey], pools: &[PoolRole]) -> LoadJob {
    LoadJob {
        pools: pools.to_vec(),
        layers: LAYERS,
        pages: keys
            .iter()
            .enumerate()
            .map(|(i, k)| PageCopy {
                key: *k,
                host_page: i as u32,
                device_page: i as u32,
            })
            .collect(),
    }
}

/// Loads request B over request A's device pages with the indexer load of layer 2 delayed, and runs
/// compute over all layers under `policy`; returns the stale pages compute saw, per layer and pool
/// (`[layer][index in POOLS]`).
fn delayed_indexer_load(policy: ReadPolicy) -> Vec<[usize; 2]> {
    let r = rig(LoadOptions {
        delay: Some((PoolRole::Indexer, 2, Duration::from_millis(200))),
        ..LoadOptions::default()
    });
    let (a, b) = (keys(1_000), keys(2_000));
    fill(&r.device, &a); // stale bytes of a previous request
    fill(&r.host, &b);
    let ticket = r.exec.submit(identity_job(&b, &POOLS)).expect("submit");
    let round = r.forward.begin_round();
    let mut stale = Vec::new();
    for layer in 0..LAYERS {
        wait_layer(&r.events, layer, &POOLS, ticket.generation, WAIT, policy)
            .expect("loads recorded");
        stale.push(POOLS.map(|pool| mismatches(&r.device, &b, layer, &[pool])));
    }
    r.forward.end_round(round);
    ticket.wait_ack(WAIT).expect("load ok");
    assert_eq!(r.locks.locked_pages(), 0, "host pages unlocked at ack");
    stale
}

#[test]
fn delayed_indexer_load_is_never_read_early_when_compute_waits_on_every_pool() {
    let stale = delayed_indexer_load(ReadPolicy::WaitEveryPool);
    assert_eq!(stale, vec![[0, 0]; LAYERS as usize]);
}

#[test]
fn negative_control_skipping_the_indexer_wait_reads_stale_pages() {
    let stale = delayed_indexer_load(ReadPolicy::UnsafeSkipPool(PoolRole::Indexer));
    assert_eq!(
        stale[2][1], PAGES as usize,
        "every indexer page of layer 2 must be stale"
    );
    // The KV pool is still waited on, so it is never stale. Other layers' indexer pages race with
    // their (undelayed) copies, as any unwaited read does, so their count is not fixed.
    assert!(stale.iter().all(|s| s[0] == 0), "{stale:?}");
}

#[test]
fn reading_a_pool_no_load_covers_is_a_typed_error() {
    let r = rig(LoadOptions::default());
    let b = keys(3_000);
    fill(&r.host, &b);
    // The job forgets the indexer pool (sglang #27504: extra pools' IO never tracked).
    let ticket = r
        .exec
        .submit(identity_job(&b, &[PoolRole::Target]))
        .expect("submit");
    let err = wait_layer(
        &r.events,
        0,
        &POOLS,
        ticket.generation,
        WAIT,
        ReadPolicy::WaitEveryPool,
    );
    assert_eq!(
        err,
        Err(LoadError::NeverRecorded {
            pool: PoolRole::Indexer,
            layer: 0,
            generation: ticket.generation
        })
    );
    ticket.wait_ack(WAIT).expect("load ok");
}

/// Compute round A reads its pages slowly while a load of request B into the same device pages is
/// submitted; returns the mismatches A saw.
fn load_over_in_flight_compute(fence: FencePolicy) -> usize {
    let r = rig(LoadOptions {
        fence,
        ..LoadOptions::default()
    });
    let (a, b) = (keys(4_000), keys(5_000));
    fill(&r.device, &a);
    fill(&r.host, &b);
    let round = r.forward.begin_round();
    let device = Arc::clone(&r.device);
    let a_keys = a.clone();
    let compute = std::thread::spawn(move || {
        let mut bad = 0;
        for layer in 0..LAYERS {
            std::thread::sleep(Duration::from_millis(40));
            bad += mismatches(&device, &a_keys, layer, &POOLS);
        }
        bad
    });
    // Pages of A were freed by the scheduler and reassigned to B while round A still runs.
    let ticket = r.exec.submit(identity_job(&b, &POOLS)).expect("submit");
    let bad = compute.join().expect("compute thread");
    r.forward.end_round(round);
    ticket.wait_ack(WAIT).expect("load ok");
    // B is complete afterwards either way.
    let round_b = r.forward.begin_round();
    for layer in 0..LAYERS {
        wait_layer(
            &r.events,
            layer,
            &POOLS,
            ticket.generation,
            WAIT,
            ReadPolicy::WaitEveryPool,
        )
        .expect("recorded");
        assert_eq!(mismatches(&r.device, &b, layer, &POOLS), 0);
    }
    r.forward.end_round(round_b);
    bad
}

#[test]
fn a_load_never_overwrites_pages_that_in_flight_compute_reads() {
    assert_eq!(load_over_in_flight_compute(FencePolicy::WaitForward), 0);
}

#[test]
fn negative_control_without_the_fence_corrupts_in_flight_compute() {
    assert!(load_over_in_flight_compute(FencePolicy::UnsafeSkipFence) > 0);
}

/// Host eviction runs while a (delayed) load reads host pages; an evicted host page is reused for
/// another key at once. Returns mismatches in the loaded device pages.
fn evict_during_load(policy: EvictionPolicy) -> usize {
    let r = rig(LoadOptions {
        delay: Some((PoolRole::Target, 1, Duration::from_millis(100))),
        ..LoadOptions::default()
    });
    let b = keys(6_000);
    fill(&r.host, &b);
    let ticket = r.exec.submit(identity_job(&b, &POOLS)).expect("submit");
    // L2 under pressure: the LRU order puts B's pages first.
    let victims = r
        .locks
        .pick_victims(b.iter().copied(), PAGES as usize, policy);
    for victim in &victims {
        let slot = b.iter().position(|k| k == victim).expect("one of b") as u32;
        let reuse = PageKey::from_trace_id(victim.as_u64() + 1_000_000);
        for pool in POOLS {
            for layer in 0..LAYERS {
                r.host
                    .write(pool, layer, slot, &page_bytes(reuse, pool, layer))
                    .expect("in range");
            }
        }
    }
    ticket.wait_ack(WAIT).expect("load ok");
    assert_eq!(r.locks.locked_pages(), 0);
    (0..LAYERS)
        .map(|l| mismatches(&r.device, &b, l, &POOLS))
        .sum()
}

#[test]
fn host_pages_stay_locked_until_the_load_is_acknowledged() {
    assert_eq!(evict_during_load(EvictionPolicy::SkipLocked), 0);
}

#[test]
fn negative_control_evicting_locked_host_pages_corrupts_the_load() {
    assert!(evict_during_load(EvictionPolicy::UnsafeIgnoreLocks) > 0);
}

#[test]
fn a_failed_copy_fails_every_remaining_event_and_releases_the_host_pages() {
    let r = rig(LoadOptions::default());
    let b = keys(7_000);
    fill(&r.host, &b);
    let mut job = identity_job(&b, &POOLS);
    // The last page points outside the device pool: the very first copy fails.
    job.pages[PAGES as usize - 1].device_page = PAGES + 3;
    let ticket = r.exec.submit(job).expect("submit");
    assert!(matches!(
        ticket.wait_ack(WAIT),
        Err(LoadError::OutOfRange { .. })
    ));
    for layer in 0..LAYERS {
        assert!(matches!(
            wait_layer(
                &r.events,
                layer,
                &POOLS,
                ticket.generation,
                WAIT,
                ReadPolicy::WaitEveryPool
            ),
            Err(LoadError::LoadFailed { .. })
        ));
    }
    assert_eq!(
        r.locks.locked_pages(),
        0,
        "a failed load releases its host pages"
    );
}

#[test]
fn the_host_backend_runs_the_plan_the_checks_accept_and_the_unsafe_read_plan_is_rejected() {
    // The host executor and the CUDA one both run `plan_load` / `plan_layer_reads`; the checks that
    // define the rules accept the safe plans and reject the negative control's.
    let job = identity_job(&keys(8_000), &POOLS);
    let plan = plan_load(&job, 1, 0, FencePolicy::WaitForward);
    assert_eq!(check_load_plan(&plan, &job), Ok(()));
    for layer in 0..LAYERS {
        let safe = plan_layer_reads(layer, &POOLS, 1, ReadPolicy::WaitEveryPool);
        assert_eq!(check_layer_reads(&safe, layer, &POOLS, 1), Ok(()));
        let unsafe_reads = plan_layer_reads(
            layer,
            &POOLS,
            1,
            ReadPolicy::UnsafeSkipPool(PoolRole::Indexer),
        );
        assert!(check_layer_reads(&unsafe_reads, layer, &POOLS, 1).is_err());
    }
}
