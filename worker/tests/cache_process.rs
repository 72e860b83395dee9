//! The `tandem-worker cache` role as a real process: fill it over TCP from a trace replay, kill it
//! with SIGKILL, start it again on the same data directory, and check that the prefix hit ratio of a
//! probe replay returns to its value before the kill (DESIGN §7 "L3 loadback after restart"); a start
//! under a changed model identity serves misses without crashing; SIGTERM exits cleanly.

mod cache_support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cache_support::{identity, load_trace, object_bytes};
use tandem_worker::cache::l3_client::L3Client;
use tandem_worker::cache::l3_replay::{ReplayMode, replay_l3};
use tandem_worker::cache::l3_store::{L3Health, WarmState};
use tandem_worker::cache::manifest::{ShardCoords, StoreIdentity};

struct Replica {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(data: &Path, identity: &StoreIdentity) -> Replica {
    let id_file = data.with_extension("identity.json");
    std::fs::write(&id_file, serde_json::to_vec(identity).expect("json")).expect("identity file");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem-worker"))
        .args([
            "cache",
            "--listen",
            "127.0.0.1:0",
            "--progress-interval-s",
            "1",
        ])
        .arg("--data-dir")
        .arg(data)
        .arg("--identity")
        .arg(&id_file)
        .arg("--unsafe-no-fsync")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn tandem-worker cache");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read stdout");
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .expect("address");
    Replica { child, addr }
}

fn client(r: &Replica) -> L3Client {
    L3Client::connect(r.addr, Duration::from_secs(30)).expect("connect")
}

fn wait_warm(c: &L3Client) -> L3Health {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let h = c.health().expect("health");
        if h.state == WarmState::CacheWarm {
            return h;
        }
        assert!(Instant::now() < deadline, "no CacheWarm: {h:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn killed_replica_restarts_with_its_hit_ratio_and_survives_an_identity_change() {
    let Some(requests) = load_trace() else { return };
    let (fill, probe) = (&requests[..400], &requests[400..600]);
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("l3");
    let id = identity("m");
    let shard = ShardCoords::whole(&id);

    let first = start(&data, &id);
    let c = client(&first);
    wait_warm(&c);
    replay_l3(&c, fill, shard, ReplayMode::Fill, object_bytes).expect("fill");
    let before = replay_l3(&c, probe, shard, ReplayMode::LookupOnly, object_bytes)
        .expect("probe")
        .token_hit_ratio();
    let objects = c.health().expect("health").objects;
    assert!(
        before > 0.1 && objects > 1_000,
        "ratio {before}, objects {objects}"
    );
    drop(c);
    drop(first); // SIGKILL: no shutdown path runs

    let second = start(&data, &id);
    let c = client(&second);
    let h = wait_warm(&c);
    assert_eq!((h.objects, h.loadback.published), (objects, objects));
    assert_eq!(h.loadback.corrupt + h.loadback.identity_mismatch, 0);
    let after = replay_l3(&c, probe, shard, ReplayMode::LookupOnly, object_bytes)
        .expect("probe")
        .token_hit_ratio();
    println!(
        "probe hit ratio before kill {before:.4}, after restart {after:.4} ({objects} objects)"
    );
    assert_eq!(after, before);
    drop(c);
    // SIGTERM: a clean stop with exit status 0.
    let mut second = second;
    let pid = i32::try_from(second.child.id()).expect("pid");
    // SAFETY: kill(2) with a pid we spawned and still own (not yet waited for).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = second.child.wait().expect("wait");
    assert!(status.success(), "SIGTERM exit: {status:?}");

    let changed = StoreIdentity {
        model: tandem_worker::model::ModelIdentity {
            name: "another-model".into(),
            ..id.model.clone()
        },
        ..id
    };
    let third = start(&data, &changed);
    let c = client(&third);
    let h = wait_warm(&c);
    assert_eq!(h.loadback.identity_mismatch, objects);
    assert_eq!(h.objects, 0);
    let shard = ShardCoords::whole(&changed);
    let ratio = replay_l3(&c, probe, shard, ReplayMode::LookupOnly, object_bytes)
        .expect("probe")
        .token_hit_ratio();
    assert_eq!(ratio, 0.0, "another model's KV is never served");
}
