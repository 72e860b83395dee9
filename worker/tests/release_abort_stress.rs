//! The abort stress in both modes, small N (CI): the safe gate must read zero corrupt pages, the
//! gate-bypassed negative control must find some (seed 004 BugFix #1; DESIGN contract 3).

// The stress is a module of the `tandem-bench` binary (not of the library's API); compiled here too.
#[allow(dead_code)]
#[path = "../src/bin/tandem-bench/abort_stress.rs"]
mod abort_stress;

use abort_stress::{AbortStressArgs, run};

#[test]
fn safe_mode_reads_no_corrupt_page() {
    let report = run(&AbortStressArgs::with(2_000, false)).unwrap();
    let lines = report.lines(false);
    eprintln!("{}", lines.join("\n"));
    assert_eq!(lines.last().unwrap(), "corrupt_pages=0", "{lines:?}");
    assert!(
        report.client_aborts + report.timeouts > 200,
        "the run must exercise aborts: {lines:?}"
    );
    assert!(report.acks > 0, "{lines:?}");
    assert_eq!(report.source_leaks, 0, "{lines:?}");
    assert_eq!(report.pages_quarantined_at_end, 0, "{lines:?}");
    assert!(report.completed > 1_000 / 2, "{lines:?}");
}

#[test]
fn unsafe_mode_negative_control_finds_corrupt_pages() {
    let report = run(&AbortStressArgs::with(2_000, true)).unwrap();
    let lines = report.lines(true);
    eprintln!("{}", lines.join("\n"));
    assert!(
        report.corrupt_pages > 0,
        "bypassing the release gate must corrupt pages: {lines:?}"
    );
    assert!(lines.last().unwrap().starts_with("corrupt_pages="));
}
