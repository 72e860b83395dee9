//! Seed 002 reproduced and fixed (DESIGN §7: "snapshot sync with the prefill pool 100% occupied:
//! ≥ 99% succeed"; the seed measured 0% before its fix).
//!
//! The same deterministic workload ([`tandem_worker::snapshot::workload`]) runs with the snapshot
//! space taken from the prefill KV pool (NEGATIVE CONTROL, the old design) and with the dedicated
//! buffer. With the pool always full when a sync arrives, the control fails (≈ 0% succeed) and the
//! dedicated buffer succeeds ≥ 99%, every finalized chunk verifying against `engine::content`. With
//! a pool that has room, the control succeeds: its failure is the occupancy, not a stub.

use tandem_worker::snapshot::workload::{
    Backing, WorkloadConfig, WorkloadReport, WorkloadTransport, run,
};

fn config(transport: WorkloadTransport) -> WorkloadConfig {
    WorkloadConfig {
        syncs: 300,
        transport,
        ..WorkloadConfig::default()
    }
}

fn check_dedicated(r: &WorkloadReport, cfg: &WorkloadConfig) {
    assert_eq!(r.attempted, u64::from(cfg.syncs));
    assert_eq!(
        r.max_pool_free_at_arrival, 0,
        "the KV pool was 100% occupied at every arrival"
    );
    assert!(
        r.success_ratio() >= 0.99,
        "dedicated buffer: {:.4} < 0.99 ({r:?})",
        r.success_ratio()
    );
    assert!(
        r.alloc_failed_on_finalize > 0,
        "finalize met the full pool and retried"
    );
    assert_eq!(r.corrupt_chunks, 0);
    assert!(r.verified_chunks >= r.succeeded * u64::from(cfg.pages_min * cfg.layers));
    assert_eq!(
        r.prepare_alloc_failed, 0,
        "prepare never allocates from the KV pool"
    );
}

#[test]
fn occupied_pool_dedicated_buffer_succeeds_and_the_shared_pool_control_fails_over_tcp() {
    let cfg = config(WorkloadTransport::Tcp);
    let dedicated = run(Backing::Dedicated, &cfg).unwrap();
    check_dedicated(&dedicated, &cfg);
    let control = run(Backing::SharedKvPool, &cfg).unwrap();
    assert_eq!(control.attempted, u64::from(cfg.syncs));
    assert!(
        control.success_ratio() <= 0.01,
        "the control must fail with the pool full: {control:?}"
    );
    assert_eq!(
        control.prepare_alloc_failed,
        control.attempted - control.succeeded
    );
}

#[test]
fn occupied_pool_dedicated_buffer_succeeds_over_the_one_sided_transport() {
    let cfg = config(WorkloadTransport::Sim);
    check_dedicated(&run(Backing::Dedicated, &cfg).unwrap(), &cfg);
}

#[test]
fn the_control_is_a_working_receive_path_when_the_pool_has_room() {
    let cfg = WorkloadConfig {
        occupy_pool: false,
        ..config(WorkloadTransport::Sim)
    };
    let control = run(Backing::SharedKvPool, &cfg).unwrap();
    assert_eq!(control.succeeded, control.attempted, "{control:?}");
    assert_eq!(control.corrupt_chunks, 0);
    assert!(control.verified_chunks > 0);
}

#[test]
fn a_workload_the_model_cannot_represent_is_refused() {
    let cfg = WorkloadConfig {
        pages_max: 9,
        prefill_request_pages: 8,
        ..config(WorkloadTransport::Sim)
    };
    assert!(run(Backing::Dedicated, &cfg).is_err());
}
