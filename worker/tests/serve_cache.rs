//! The prefix cache through the serving processes: a prefill with a CacheTier serves repeated
//! prefixes from L2, writes computed pages through to the `cache --config` replica, and — after
//! both the replica and the prefill restart — serves them from L3 (the replica loaded its objects
//! back from its data directory), the prefill loading its hottest pages back into L2 first.

mod serve_support;

use std::time::Duration;

use serde_json::Value;
use serve_support::*;
use tandem_worker::config::*;
use tandem_worker::store_client::ClientMode;

fn prefill_with_tier(w: &World) -> WorkerConfig {
    let mut cfg = config(WorkerRole::Prefill, "r1", w.ports);
    cfg.memory.client_mode = Some(ClientMode::Embedded);
    cfg.cache = Some(CacheConfig {
        tier: "l3".into(),
        service: L3_SERVICE.into(),
        replicas: 1,
        page_tokens: 512,
        write_policy: WritePolicy::WriteThrough,
    });
    cfg
}

fn request(hashes: &[u64]) -> Value {
    serde_json::json!({"prompt": "x", "max_tokens": 1, "input_tokens": 1536,
        "kv_block_hashes": hashes})
}

async fn hits(w: &World, hashes: &[u64]) -> (u64, u64) {
    let (code, frames) = http(
        w.addr(9, w.ports.front),
        "POST",
        "/v1/completions",
        Some(request(hashes)),
    )
    .await;
    let v: Value = serde_json::from_str(&text(&frames)).unwrap();
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["tandem"]["corrupt_chunks"], 0);
    let h = &v["tandem"]["prefix_hit_tokens"];
    (h["l2"].as_u64().unwrap(), h["l3"].as_u64().unwrap())
}

async fn wait_ready(w: &World, host: u8) {
    let h = w.addr(host, w.ports.health);
    until(Duration::from_secs(15), || async {
        status(h, "/readyz").await == Some(200)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefixes_hit_l2_then_l3_after_the_replica_and_the_prefill_restart() {
    let w = World::new(46);
    w.publish_names(&[(SERVICE, &[2]), (L3_SERVICE, &[5])]);
    let pcfg = prefill_with_tier(&w);
    let tcfg = tier(&w, &pcfg);
    let mut cache = w.spawn_cache(5, &tcfg);
    let mut prefill = w.spawn(2, &pcfg, &[]);
    let _decode = w.spawn(9, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    wait_ready(&w, 5).await;
    wait_ready(&w, 9).await;

    assert_eq!(hits(&w, &[101, 102, 103]).await, (0, 0), "cold");
    assert_eq!(
        hits(&w, &[101, 102, 103]).await,
        (1536, 0),
        "whole prompt from L2"
    );
    assert_eq!(
        hits(&w, &[101, 102, 999]).await,
        (1024, 0),
        "shared prefix of two pages"
    );
    // The L3 writes of the last request land after its KV was sent: wait for the count (bounded),
    // rather than read it the instant the response ends.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let pr = loop {
        let (_, pr) = get_json(w.addr(2, w.ports.health), "/report").await;
        if pr["counters"]["l3_pages_written"] == 4 || std::time::Instant::now() > deadline {
            break pr;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(pr["counters"]["l3_pages_written"], 4, "{pr}");
    assert_eq!(pr["counters"]["prefix_hit_tokens_l2"], 2560, "{pr}");
    assert_eq!(pr["degraded"], serde_json::json!([]), "{pr}");
    let (_, cr) = get_json(w.addr(5, w.ports.health), "/report").await;
    assert_eq!(
        (
            cr["role"].as_str(),
            cr["warm"].as_bool(),
            cr["objects"].as_u64()
        ),
        (Some("cache"), Some(true), Some(4)),
        "{cr}"
    );

    // Restart the replica (its data dir survives) and the prefill (its L2 is gone).
    cache.signal(libc::SIGTERM);
    assert!(
        cache
            .wait_exit(Duration::from_secs(10))
            .expect("cache exits")
            .success()
    );
    // The replica stops through the ordered teardown (DESIGN contract 9), every step clean.
    w.assert_clean_teardown(
        5,
        &[
            "StopAdmission",
            "JoinThreads",
            "DestroyTransports",
            "FreeMemory",
        ],
    );
    prefill.signal(libc::SIGTERM);
    assert!(
        prefill
            .wait_exit(Duration::from_secs(10))
            .expect("prefill exits")
            .success()
    );
    let _cache = w.spawn_cache(5, &tcfg);
    wait_ready(&w, 5).await;
    let h5 = w.addr(5, w.ports.health);
    until(Duration::from_secs(15), || async {
        let (_, r) = get_json(h5, "/report").await;
        r["warm"] == true && r["counters"]["l3_pages_loaded_back"] == 4
    })
    .await;
    // The prefill loads back the two most recently used pages (999 and 103) before it admits.
    let _prefill = w.spawn(2, &pcfg, &[("TANDEM_L3_LOADBACK_PAGES", "2")]);
    wait_ready(&w, 2).await;
    let (_, pr) = get_json(w.addr(2, w.ports.health), "/report").await;
    assert_eq!(pr["counters"]["l3_pages_loaded_back"], 2, "{pr}");
    // The decode reconnects to the restarted prefill on its next refresh.
    let front = w.addr(9, w.ports.front);
    until(Duration::from_secs(15), || async {
        http(front, "POST", "/v1/completions", Some(request(&[7])))
            .await
            .0
            == 200
    })
    .await;
    assert_eq!(
        hits(&w, &[101, 102, 103]).await,
        (0, 1536),
        "whole prompt from L3"
    );
    assert_eq!(
        hits(&w, &[101, 102, 103]).await,
        (1536, 0),
        "and now from L2"
    );
    assert_eq!(
        hits(&w, &[101, 102, 999]).await,
        (1536, 0),
        "999 was loaded back"
    );
}
