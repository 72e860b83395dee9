//! The process heap's policy for KV-sized buffers.
//!
//! Outside the registered pools, the worker still holds KV bytes on the heap: L2 pages of a prefill,
//! the L3 put queue, a cache replica's stored pages, transfer staging — buffers of one page each
//! (64 KiB to a few MiB), allocated on one runtime thread and freed on another. glibc gives each new
//! thread an arena of its own at its first allocation (up to 8 per core) and keeps what is freed in
//! the arena it came from, so a churn of page-sized buffers across threads leaves every arena holding
//! freed pages the others cannot reuse. Measured on the full-trace demo (12,031 requests, 640 KiB
//! pages): a cache replica configured for 1 GiB held 2.2 GiB anonymous memory, all in 64 MiB arenas,
//! and prefills 1.7 GiB next to a 1 GiB L2 — over the pods' memory and into the OOM killer on a
//! 24 GiB node. [`tune`] gives the process one arena: freed pages are reused by any thread, and
//! resident memory follows the peak of what the worker holds.
//!
//! Why not the other knobs (C model of the worker's churn, 10 threads, 1 GiB of 640 KiB pages
//! live, this 2-core machine; per page allocated, filled and freed): glibc's default 44 µs and 2.17×
//! the live bytes resident; one arena 56 µs and 1.02×; a fixed mmap threshold (every page its own
//! mapping, faulted and zeroed anew) 468 µs and 1.00× — bounded, but ten times the CPU.

/// What [`tune`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeapPolicy {
    /// One malloc arena for every thread.
    OneArena,
    /// The environment already sets the arena count or the mmap threshold (`MALLOC_ARENA_MAX`,
    /// `MALLOC_MMAP_THRESHOLD_`, or `glibc.malloc.arena_max` / `arena_test` / `mmap_threshold` in
    /// `GLIBC_TUNABLES`): the operator's choice is kept.
    FromEnvironment,
    /// Not glibc (or `mallopt` refused): the allocator's own policy stands.
    Unchanged,
}

/// Gives this process one glibc malloc arena unless the environment already sets the arena count or
/// the mmap threshold ([`HeapPolicy::FromEnvironment`]). Call once, first thing in `main`, before
/// other threads start.
pub fn tune() -> HeapPolicy {
    let var = |k: &str| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned());
    if env_sets_heap_policy(
        var("MALLOC_ARENA_MAX").as_deref(),
        var("MALLOC_MMAP_THRESHOLD_").as_deref(),
        var("GLIBC_TUNABLES").as_deref(),
    ) {
        return HeapPolicy::FromEnvironment;
    }
    one_arena()
}

/// Whether these environment values (`MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_`,
/// `GLIBC_TUNABLES`) set the arena count or the mmap threshold as glibc reads them: a count of at
/// least 1, a threshold that is a number, or a tunable of those names (other malloc tunables, such
/// as `glibc.malloc.hugetlb`, leave the fragmentation as it is and do not count).
pub fn env_sets_heap_policy(
    arena_max: Option<&str>,
    mmap_threshold: Option<&str>,
    tunables: Option<&str>,
) -> bool {
    let count = |v: &str| v.trim().parse::<u64>().is_ok_and(|n| n >= 1);
    arena_max.is_some_and(count)
        || mmap_threshold.is_some_and(|v| v.trim().parse::<u64>().is_ok())
        || tunables.is_some_and(|t| {
            t.split(':').any(|kv| {
                let (name, value) = kv.split_once('=').unwrap_or((kv, ""));
                matches!(
                    name.trim(),
                    "glibc.malloc.arena_max"
                        | "glibc.malloc.arena_test"
                        | "glibc.malloc.mmap_threshold"
                ) && !value.trim().is_empty()
            })
        })
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn one_arena() -> HeapPolicy {
    // SAFETY: mallopt only changes allocator parameters; it takes no pointers.
    let ok = unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    if ok == 1 {
        HeapPolicy::OneArena
    } else {
        HeapPolicy::Unchanged
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn one_arena() -> HeapPolicy {
    HeapPolicy::Unchanged
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    const PAGE: usize = 640 << 10;
    const LIVE: usize = 400;
    const THREADS: usize = 8;
    const PER_THREAD: usize = 3000;
    const SCENARIO: &str = "TANDEM_HEAP_SCENARIO";

    /// Resident anonymous memory of this process, in KiB (`RssAnon` of /proc/self/status).
    fn rss_anon_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("RssAnon")
    }

    /// The worker's page churn, run only in a child process (the heap policy is per process, and
    /// must be set before threads allocate — libtest's own threads already have, so the child gets
    /// the same setting as `MALLOC_ARENA_MAX=1` in its environment): 8 threads put page-sized
    /// buffers (640 KiB, less up to 3 x 4 KiB) into 400 shared slots (250 MiB live) and free what
    /// they displace, which another thread allocated; prints the resident KiB at the end.
    #[test]
    fn heap_scenario() {
        if std::env::var_os(SCENARIO).is_none() {
            return;
        }
        let slots: Arc<Vec<Mutex<Vec<u8>>>> =
            Arc::new((0..LIVE).map(|_| Mutex::new(Vec::new())).collect());
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let slots = slots.clone();
                std::thread::spawn(move || {
                    let mut r = (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    for i in 0..PER_THREAD {
                        r ^= r << 13;
                        r ^= r >> 7;
                        r ^= r << 17;
                        let size = PAGE - (r as usize % 4) * 4096;
                        let page = vec![(i as u8) | 1; size];
                        let old = std::mem::replace(
                            &mut *slots[(r >> 8) as usize % LIVE].lock().unwrap(),
                            page,
                        );
                        drop(old);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        println!("RSS_KIB {}", rss_anon_kib());
        drop(slots);
    }

    fn resident_kib(mode: &str) -> u64 {
        let exe = std::env::current_exe().expect("the test binary");
        let mut cmd = std::process::Command::new(exe);
        cmd.args([
            "--exact",
            "memory::heap::tests::heap_scenario",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SCENARIO, mode)
        .env_remove("MALLOC_ARENA_MAX")
        .env_remove("MALLOC_MMAP_THRESHOLD_")
        .env_remove("GLIBC_TUNABLES");
        if mode == "one-arena" {
            cmd.env("MALLOC_ARENA_MAX", "1");
        }
        let out = cmd.output().expect("run the scenario");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "scenario {mode} failed: {stdout}");
        // libtest prints it after the test's name, on the same line.
        stdout
            .split("RSS_KIB ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("scenario {mode} printed no figure: {stdout}"))
    }

    #[test]
    fn only_an_arena_count_or_mmap_threshold_in_the_environment_counts_as_tuned() {
        assert!(!env_sets_heap_policy(None, None, None));
        assert!(env_sets_heap_policy(Some("2"), None, None));
        assert!(
            !env_sets_heap_policy(Some(""), None, None),
            "glibc ignores an empty count"
        );
        assert!(!env_sets_heap_policy(Some("0"), None, None));
        assert!(env_sets_heap_policy(None, Some("262144"), None));
        assert!(env_sets_heap_policy(
            None,
            None,
            Some("glibc.malloc.tcache_count=0:glibc.malloc.arena_max=4")
        ));
        assert!(!env_sets_heap_policy(
            None,
            None,
            Some("glibc.malloc.hugetlb=1")
        ));
        assert!(!env_sets_heap_policy(
            None,
            None,
            Some("glibc.pthread.rseq=0")
        ));
    }

    #[test]
    fn tune_sets_one_arena() {
        // mallopt here changes the heap of this test process (every test in it): harmless, the
        // policy only decides where freed memory is kept.
        if std::env::var_os("MALLOC_ARENA_MAX").is_none()
            && std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none()
            && std::env::var_os("GLIBC_TUNABLES").is_none()
        {
            assert_eq!(tune(), HeapPolicy::OneArena);
        }
    }

    #[test]
    fn resident_memory_follows_the_live_pages_only_with_one_arena() {
        let live_kib = (LIVE * PAGE / 1024) as u64;
        let tuned = resident_kib("one-arena");
        assert!(
            tuned <= live_kib * 6 / 5,
            "one arena: {tuned} KiB resident for {live_kib} KiB of live pages"
        );
        // Negative control: glibc's own policy keeps freed pages in per-thread arenas (the outage).
        let untuned = resident_kib("default");
        assert!(
            untuned >= live_kib * 13 / 10,
            "glibc's default kept only {untuned} KiB resident for {live_kib} KiB live: the scenario no longer shows the fragmentation"
        );
    }
}
