//! DESIGN contract 6 (LayerSplit, seed 004): per-rank KV bytes = replicated / CP, attention outputs
//! bit-identical to the replicated layout, broadcasts move only the pages in use, the owner map must
//! match on every rank, and a consumer never reads a layer it has not received. Each protocol rule has
//! a negative control that must make its test fail.

use std::path::Path;
use std::time::Duration;

// The benchmark is a module of the `tandem-bench` binary (not of the library's API); compiled here.
#[allow(dead_code)]
#[path = "../src/bin/tandem-bench/layer_split.rs"]
mod layer_split_bench;

use tandem_worker::config::LayerSplit;
use tandem_worker::layer_split::group::{run_group_over_tcp, run_group_with_maps};
use tandem_worker::layer_split::receive::{Arrival, LayerReceiver};
use tandem_worker::layer_split::tcp_link::TcpLinkConfig;
use tandem_worker::layer_split::transport::{RankLink, channel_mesh};
use tandem_worker::layer_split::wire::{Frame, LayerFrame};
use tandem_worker::layer_split::{
    BroadcastScope, GroupSpec, KvLayout, LayerSplitError, OwnerMap, RankReport, RequestSpec,
    WaitPolicy, run_group,
};
use tandem_worker::model::{Attention, ModelCatalog, ModelIdentity};

const PAGE_TOKENS: u32 = 16;
const POOL_PAGES: u32 = 64;

fn model(layers: u32) -> ModelIdentity {
    ModelIdentity {
        name: "ls-test".into(),
        layers,
        attention: Attention::Gqa {
            kv_heads: 2,
            head_dim: 8,
        },
        dtype_bytes: 2,
        row_extra_bytes: 0,
    }
}

/// Chunk bytes of `model`: 16 tokens × 64 B.
const CHUNK: u64 = 16 * 64;

fn spec(layers: u32, cp: u32, layout: KvLayout) -> GroupSpec {
    GroupSpec {
        model: model(layers),
        cp_size: cp,
        page_tokens: PAGE_TOKENS,
        pool_pages: POOL_PAGES,
        layout,
        scope: BroadcastScope::PagesInUse,
        wait: WaitPolicy::Wait,
        indexer_work: 8,
        wait_timeout: Duration::from_secs(20),
    }
}

fn split(layers: u32, cp: u32) -> KvLayout {
    KvLayout::Split(OwnerMap::contiguous(layers, cp).unwrap())
}

fn requests() -> Vec<RequestSpec> {
    [1u32, 3, 7, 12, 5, 2]
        .iter()
        .enumerate()
        .map(|(i, p)| RequestSpec {
            id: 1000 + i as u64,
            pages: *p,
        })
        .collect()
}

fn outputs(r: &[RankReport]) -> Vec<Vec<u64>> {
    r.iter().map(|x| x.outputs.clone()).collect()
}

#[test]
fn per_rank_kv_bytes_are_the_replicated_bytes_over_cp() {
    let reqs = &requests()[..2];
    for (layers, cp) in [(8, 2), (8, 4), (61, 2), (61, 4)] {
        let rep = run_group(&spec(layers, cp, KvLayout::Replicated), reqs).unwrap();
        let ls = run_group(&spec(layers, cp, split(layers, cp)), reqs).unwrap();
        let full = rep[0].stored_kv_bytes;
        assert_eq!(full, u64::from(layers) * u64::from(POOL_PAGES) * CHUNK);
        assert!(rep.iter().all(|r| r.stored_kv_bytes == full));
        let mut sum = 0;
        for r in &ls {
            // Exact: rank r stores owned_r / L of the replicated pool.
            assert_eq!(
                r.stored_kv_bytes * u64::from(layers),
                full * u64::from(r.stored_layers)
            );
            // Bound: at most ⌈L/C⌉ / L of it; exactly 1/C when C divides L.
            assert!(r.stored_kv_bytes * u64::from(layers) <= full * u64::from(layers.div_ceil(cp)));
            if layers % cp == 0 {
                assert_eq!(r.stored_kv_bytes * u64::from(cp), full);
            }
            // The receive scratch is one layer: 1/L of the replicated pool.
            assert_eq!(r.scratch_bytes * u64::from(layers), full);
            sum += r.stored_kv_bytes;
        }
        assert_eq!(
            sum, full,
            "the group stores exactly one copy ({layers}/{cp})"
        );
    }
}

#[test]
fn outputs_are_bit_identical_to_the_replicated_layout() {
    let reqs = requests();
    for (layers, cp) in [(8, 2), (10, 4), (7, 3)] {
        let rep = run_group(&spec(layers, cp, KvLayout::Replicated), &reqs).unwrap();
        let ls = run_group(&spec(layers, cp, split(layers, cp)), &reqs).unwrap();
        assert_eq!(outputs(&ls), outputs(&rep), "{layers} layers over {cp}");
        // The output is not trivially constant: requests and ranks differ.
        let o = &ls[0].outputs;
        assert!(o.windows(2).all(|w| w[0] != w[1]));
        assert_ne!(ls[0].outputs, ls[1].outputs);
        // A non-contiguous (interleaved) map gives the same outputs too.
        let owners = (0..layers).map(|l| l % cp).collect();
        let inter = OwnerMap::new(&LayerSplit { owners }, cp).unwrap();
        let ls2 = run_group(&spec(layers, cp, KvLayout::Split(inter)), &reqs).unwrap();
        assert_eq!(outputs(&ls2), outputs(&rep));
    }
}

#[test]
fn negative_control_attention_without_the_wait_diverges() {
    let reqs = requests();
    let (layers, cp) = (8, 2);
    let rep = run_group(&spec(layers, cp, KvLayout::Replicated), &reqs).unwrap();
    let mut s = spec(layers, cp, split(layers, cp));
    s.wait = WaitPolicy::UnsafeSkipWait;
    let unsafe_run = run_group(&s, &reqs).unwrap();
    for (u, r) in unsafe_run.iter().zip(&rep) {
        for (i, (a, b)) in u.outputs.iter().zip(&r.outputs).enumerate() {
            assert_ne!(
                a, b,
                "rank {} request {i}: skipping the wait must show",
                u.rank
            );
        }
    }
}

#[test]
fn broadcast_moves_only_the_pages_in_use() {
    let reqs = requests();
    let pages_in_use: u64 = reqs.iter().map(|r| u64::from(r.pages)).sum();
    let (layers, cp) = (10, 4);
    let ls = run_group(&spec(layers, cp, split(layers, cp)), &reqs).unwrap();
    let mut s = spec(layers, cp, split(layers, cp));
    s.scope = BroadcastScope::UnsafeWholeBuffer;
    let whole = run_group(&s, &reqs).unwrap();
    let peers = u64::from(cp - 1);
    let (mut used, mut all) = (0u64, 0u64);
    for (a, b) in ls.iter().zip(&whole) {
        let owned = u64::from(a.stored_layers);
        assert_eq!(
            a.broadcast_payload_bytes,
            pages_in_use * CHUNK * owned * peers,
            "rank {}: pages in use × chunk × owned layers × peers",
            a.rank
        );
        assert_eq!(a.frames_sent, reqs.len() as u64 * owned * peers);
        // One wait per layer the rank does not own, per request.
        assert_eq!(a.waits, reqs.len() as u64 * (u64::from(layers) - owned));
        assert!(a.waits_hidden <= a.waits);
        assert_eq!(
            b.broadcast_payload_bytes,
            reqs.len() as u64 * u64::from(POOL_PAGES) * CHUNK * owned * peers
        );
        used += a.broadcast_payload_bytes;
        all += b.broadcast_payload_bytes;
    }
    // Pool 64 pages, requests use 30 pages over 6 steps: the whole-buffer mode moves 12.8× more.
    assert_eq!(
        all * pages_in_use,
        used * reqs.len() as u64 * u64::from(POOL_PAGES)
    );
    assert!(
        all >= 10 * used,
        "whole buffer {all} vs pages in use {used}"
    );
    // The whole-buffer control is wasteful, not wrong.
    assert_eq!(outputs(&whole), outputs(&ls));
}

#[test]
fn ranks_with_different_owner_maps_refuse_each_other() {
    let (layers, cp) = (8, 2);
    let contiguous = OwnerMap::contiguous(layers, cp).unwrap();
    let interleaved = OwnerMap::new(
        &LayerSplit {
            owners: (0..layers).map(|l| l % cp).collect(),
        },
        cp,
    )
    .unwrap();
    let s = spec(layers, cp, KvLayout::Split(contiguous.clone()));
    let results = run_group_with_maps(
        &s,
        &requests(),
        &[Some(contiguous.clone()), Some(interleaved)],
    );
    for (rank, r) in results.iter().enumerate() {
        match r {
            Err(LayerSplitError::OwnerMapMismatch {
                local_rank,
                peer_rank,
                ..
            }) => assert_eq!((*local_rank, *peer_rank), (rank as u32, 1 - rank as u32)),
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
    }
    // Control: the same maps on both ranks run.
    let ok = run_group_with_maps(
        &s,
        &requests(),
        &[Some(contiguous.clone()), Some(contiguous)],
    );
    assert!(ok.iter().all(Result::is_ok));
}

/// Over TCP (issue 15: the link between the pods of a group), on loopback: the split layout's
/// outputs equal the replicated layout's bit for bit, each rank stores its share, and the bytes
/// broadcast equal the in-process mesh's (the transport adds nothing to the payload).
#[test]
fn over_tcp_outputs_are_bit_identical_and_bytes_match_the_in_process_mesh() {
    let reqs = requests();
    for (layers, cp) in [(8, 2), (7, 3), (10, 4)] {
        let rep = run_group(&spec(layers, cp, KvLayout::Replicated), &reqs).unwrap();
        let map = OwnerMap::contiguous(layers, cp).unwrap();
        let s = spec(layers, cp, KvLayout::Split(map.clone()));
        let maps = vec![Some(map); cp as usize];
        let tcp: Vec<RankReport> = run_group_over_tcp(&s, &reqs, &maps, TcpLinkConfig::default())
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap();
        let mem = run_group(&s, &reqs).unwrap();
        assert_eq!(outputs(&tcp), outputs(&rep), "{layers} layers over {cp}");
        for (t, m) in tcp.iter().zip(&mem) {
            assert_eq!(t.stored_kv_bytes, m.stored_kv_bytes);
            assert_eq!(t.broadcast_payload_bytes, m.broadcast_payload_bytes);
            assert_eq!(t.frames_sent, m.frames_sent);
            assert_eq!(t.waits, m.waits);
        }
    }
}

/// Over TCP, ranks on different owner maps refuse each other when the streams open, before any
/// frame (R-LS-1): every rank fails with `OwnerMapMismatch`, naming the other rank.
#[test]
fn over_tcp_ranks_with_different_owner_maps_refuse_each_other_at_connect() {
    let (layers, cp) = (8, 2);
    let contiguous = OwnerMap::contiguous(layers, cp).unwrap();
    let interleaved = OwnerMap::new(
        &LayerSplit {
            owners: (0..layers).map(|l| l % cp).collect(),
        },
        cp,
    )
    .unwrap();
    let s = spec(layers, cp, KvLayout::Split(contiguous.clone()));
    let cfg = TcpLinkConfig {
        connect_timeout: Duration::from_secs(20),
        ..TcpLinkConfig::default()
    };
    let results = run_group_over_tcp(&s, &requests(), &[Some(contiguous), Some(interleaved)], cfg);
    for (rank, r) in results.iter().enumerate() {
        match r {
            Err(LayerSplitError::OwnerMapMismatch {
                local_rank,
                peer_rank,
                ..
            }) => assert_eq!((*local_rank, *peer_rank), (rank as u32, 1 - rank as u32)),
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
    }
}

/// The negative control over TCP: a rank that attends without waiting for the layer's broadcast
/// reads a stale scratch, and every output differs from the replicated layout's.
#[test]
fn over_tcp_negative_control_attention_without_the_wait_diverges() {
    let reqs = requests();
    let (layers, cp) = (8, 2);
    let rep = run_group(&spec(layers, cp, KvLayout::Replicated), &reqs).unwrap();
    let map = OwnerMap::contiguous(layers, cp).unwrap();
    let mut s = spec(layers, cp, KvLayout::Split(map.clone()));
    s.wait = WaitPolicy::UnsafeSkipWait;
    let maps = vec![Some(map); cp as usize];
    let unsafe_run: Vec<RankReport> =
        run_group_over_tcp(&s, &reqs, &maps, TcpLinkConfig::default())
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap();
    for (u, r) in unsafe_run.iter().zip(&rep) {
        for (i, (a, b)) in u.outputs.iter().zip(&r.outputs).enumerate() {
            assert_ne!(
                a, b,
                "rank {} request {i}: skipping the wait must show",
                u.rank
            );
        }
    }
}

fn layer_frame(from: u32, step: u64, layer: u32, pages: Vec<u32>) -> Vec<u8> {
    Frame::Layer(LayerFrame {
        from,
        step,
        request: 5,
        layer,
        chunk_bytes: CHUNK as u32,
        payload: vec![7u8; pages.len() * CHUNK as usize],
        pages,
    })
    .encode()
}

#[test]
fn waiting_on_a_layer_never_sent_is_an_error() {
    let map = OwnerMap::contiguous(4, 2).unwrap(); // rank 0: layers 0-1, rank 1: layers 2-3
    let short = Duration::from_millis(50);

    // A layer this rank owns is never broadcast to it.
    let mut links = channel_mesh(2);
    let l1 = links.pop().unwrap();
    let l0 = links.pop().unwrap();
    let mut rx = LayerReceiver::new(0, map.clone(), POOL_PAGES, CHUNK as usize);
    assert!(matches!(
        rx.wait(&l0, 0, 1, short),
        Err(LayerSplitError::NeverBroadcast { owner: 0, .. })
    ));
    // Owner alive but silent: timeout.
    assert!(matches!(
        rx.wait(&l0, 0, 2, short),
        Err(LayerSplitError::BroadcastTimeout { layer: 2, .. })
    ));
    // Layer 2 arrives: the event fires and the scratch holds its pages.
    l1.send(0, layer_frame(1, 0, 2, vec![3, 9])).unwrap();
    // Sent before the wait began: the broadcast was hidden.
    assert_eq!(rx.wait(&l0, 0, 2, short).unwrap(), Arrival::AlreadyThere);
    assert_eq!(rx.scratch_pages(), &[3, 9]);
    assert_eq!(rx.chunk(9).unwrap()[0], 7);
    // The same (step, layer) again is refused.
    l1.send(0, layer_frame(1, 0, 2, vec![3])).unwrap();
    assert!(matches!(
        rx.wait(&l0, 0, 3, short),
        Err(LayerSplitError::DuplicateLayer { step: 0, layer: 2 })
    ));
    // A rank sending a layer it does not own is refused (R-LS-1).
    l1.send(0, layer_frame(1, 1, 0, vec![1])).unwrap();
    assert!(matches!(
        rx.wait(&l0, 1, 3, short),
        Err(LayerSplitError::WrongSender {
            from: 1,
            layer: 0,
            owner: 0
        })
    ));
    // The owner goes away without sending: never broadcast, not a hang.
    drop(l1);
    assert!(matches!(
        rx.wait(&l0, 1, 3, Duration::from_secs(5)),
        Err(LayerSplitError::NeverBroadcast {
            step: 1,
            layer: 3,
            owner: 1
        })
    ));
}

#[test]
fn bench_reports_identical_outputs_and_both_ratios() {
    use layer_split_bench::{LayerSplitArgs, run};
    let args = LayerSplitArgs {
        layers: 7,
        cp: vec![2, 4],
        pool_pages: 32,
        page_tokens: 4,
        requests: 4,
        max_pages: 6,
        indexer_work: 1,
        models: None,
    };
    let report = run(&args).unwrap();
    for row in &report.rows {
        assert!(row.identical);
        assert!((row.group_sum_ratio - 1.0).abs() < 1e-12);
        let max = row.ranks.iter().map(|r| r.1).fold(0.0, f64::max);
        assert!(
            (max - row.bound).abs() < 1e-12,
            "7 layers: max rank = ⌈7/C⌉/7"
        );
        // 4 requests × 32 pool pages vs the pages they use.
        let expected = (4 * 32) as f64 / report.pages_in_use as f64;
        let got = row.whole_buffer_bytes as f64 / row.broadcast_bytes as f64;
        assert!((got - expected).abs() < 1e-9, "{got} vs {expected}");
    }
    assert!(report.rows.iter().all(|r| r.tcp_identical));
    let lines = report.lines();
    assert!(lines.iter().any(|l| l.trim() == "identical=true"));
    assert!(lines.iter().any(|l| l.trim() == "identical_over_tcp=true"));
    // The model section: GLM-5's capacity at CP 8 is 78/11 (PR #29930's ~7.1x), and every gain
    // figure is labelled as the model's.
    assert!(
        lines
            .iter()
            .any(|l| l.contains("glm-5") && l.contains("cp8=7.09x")),
        "{lines:#?}"
    );
    assert_eq!(
        lines.iter().filter(|l| l.contains("model_gain=")).count(),
        10,
        "5 context lengths at CP 8 and 4"
    );
}

/// `--models` adds every geometry of the shared `models.json` to the model's capacity table
/// (fails without the file when `TANDEM_REQUIRE_DATA=1`).
#[test]
fn bench_model_section_covers_the_shared_model_geometries() {
    use layer_split_bench::{ModelSection, run};
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/models.json");
    if !path.is_file() {
        assert!(
            std::env::var_os("TANDEM_REQUIRE_DATA").is_none(),
            "{} missing with TANDEM_REQUIRE_DATA set",
            path.display()
        );
        println!("SKIPPED: {} missing", path.display());
        return;
    }
    let catalog =
        ModelCatalog::from_json(&std::fs::read_to_string(&path).unwrap()).expect("models.json");
    let section = ModelSection::compute(Some(&catalog));
    assert_eq!(section.capacity.len(), 1 + catalog.models.len());
    let v3 = section
        .capacity
        .iter()
        .find(|r| r.model == "deepseek-v3")
        .expect("deepseek-v3 row");
    // 61 layers: CP 4 stores 16 + 1, CP 8 stores 8 + 1.
    assert_eq!(v3.ratios, vec![(4, 61.0 / 17.0), (8, 61.0 / 9.0)]);
    assert_eq!(v3.bytes_per_token, 70_272);
    // A missing file is a clear error, not an empty table.
    let args = layer_split_bench::LayerSplitArgs {
        layers: 7,
        cp: vec![2],
        pool_pages: 8,
        page_tokens: 4,
        requests: 1,
        max_pages: 2,
        indexer_work: 1,
        models: Some(path.with_file_name("no-such-models.json")),
    };
    let err = run(&args).unwrap_err().to_string();
    assert!(err.contains("no-such-models.json"), "{err}");
}
