//! Issue 18, item 6: bad input at the engine API. A deterministic fuzzer (fixed-seed splitmix64, no
//! fuzzing crate) calls every method of `tandem.engine.v1` on a decode worker's engine socket with
//! random, truncated, bit-flipped and oversized payloads (a raw codec under tonic, so that the
//! bytes reach the server's decoder as they are): every call ends with a clear status (never a dead
//! server), no buffer is left behind, and the worker still serves a proper engine afterwards. It
//! prints how many inputs it tried. The typed refusals of well-formed but wrong messages are
//! `engine_api_malformed.rs`.

mod engine_api_support;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut};
use engine_api_support::*;
use prost::Message;
use tandem_worker::config::WorkerRole;
use tandem_worker::engine_api::pb;
use tandem_worker::engine_api::service::Backend;
use tonic::Status;
use tonic::codegen::http::Uri;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn bytes(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max + 1);
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Raw payload bytes under tonic's gRPC framing.
#[derive(Clone, Copy, Default)]
struct Raw;

impl tonic::codec::Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

/// Dials the engine's Unix socket for tonic.
#[derive(Clone)]
struct Uds(PathBuf);

type Dialed = hyper_util::rt::TokioIo<tokio::net::UnixStream>;

impl tonic::codegen::Service<Uri> for Uds {
    type Response = Dialed;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Dialed>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let path = self.0.clone();
        Box::pin(async move {
            Ok(hyper_util::rt::TokioIo::new(
                tokio::net::UnixStream::connect(path).await?,
            ))
        })
    }
}

/// The engine API's methods, `(path, server streaming)`.
const METHODS: [(&str, bool); 19] = [
    ("/tandem.engine.v1.Session/Attach", false),
    ("/tandem.engine.v1.Session/Detach", false),
    ("/tandem.engine.v1.Session/Health", false),
    ("/tandem.engine.v1.Decode/WatchWork", true),
    ("/tandem.engine.v1.Decode/EmitTokens", false),
    ("/tandem.engine.v1.Decode/SyncSession", false),
    ("/tandem.engine.v1.Decode/Reserve", false),
    ("/tandem.engine.v1.Decode/AwaitKv", false),
    ("/tandem.engine.v1.Decode/Finish", false),
    ("/tandem.engine.v1.Decode/Abort", false),
    ("/tandem.engine.v1.Decode/WatchReleases", true),
    ("/tandem.engine.v1.Prefill/WatchWork", true),
    ("/tandem.engine.v1.Prefill/PagesReady", false),
    ("/tandem.engine.v1.Prefill/WatchSourceFree", true),
    ("/tandem.engine.v1.Prefill/AwaitLayer", false),
    ("/tandem.engine.v1.Tiers/Lookup", false),
    ("/tandem.engine.v1.Tiers/Load", true),
    ("/tandem.engine.v1.Tiers/Store", false),
    ("/tandem.engine.v1.Spec/ReportSteps", false),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_api_fuzzer_refuses_bad_messages_and_keeps_serving() {
    use tonic::codegen::http::uri::PathAndQuery;
    let w = start_worker(
        worker_config(
            WorkerRole::Decode,
            Shape {
                pages: 4,
                ..Shape::default()
            },
        ),
        Backend::Decode(Arc::new(ManualSource::default())),
        // A fuzzed Attach that succeeds is never claimed: its pools come back at the claim
        // deadline.
        Options {
            tweak: Box::new(|c| c.claim_deadline = Duration::from_millis(500)),
            ..Options::default()
        },
    );
    // The pools are allocated once, at the first attach, and kept: attach and detach properly
    // first, so that the fuzz's count is compared with the worker's own pools.
    {
        let mut c = w.client().await;
        let a = c.attach(identity(&w.cfg)).await.unwrap();
        c.detach(a.id()).await.unwrap();
    }
    let buffers = w.live_buffers();
    let channel = tonic::transport::Endpoint::from_static("http://engine.sock")
        .timeout(Duration::from_secs(5))
        .connect_with_connector(Uds(w.api.settings().engine_socket()))
        .await
        .unwrap();
    // A valid attach to mutate: identity fields, truncations and flips reach the decoder.
    let attach = pb::AttachRequest {
        identity: Some(identity(&w.cfg)),
    }
    .encode_to_vec();
    let mut rng = Rng(0xE6_1618);
    let started = Instant::now();
    let (mut tried, mut refused) = (0u64, 0u64);
    for _ in 0..500 {
        let (path, streaming) = METHODS[rng.below(METHODS.len() as u64) as usize];
        let payload = match rng.below(6) {
            0 => rng.bytes(64),
            1 => rng.bytes(600),
            2 => {
                let cut = rng.below(attach.len() as u64 + 1) as usize;
                attach[..cut].to_vec()
            }
            3 => {
                let mut v = attach.clone();
                let i = rng.below(v.len() as u64) as usize;
                v[i] ^= 1 << rng.below(8);
                v
            }
            // Small varint fields: plausible ids, pages and counts.
            4 => (0..rng.below(6))
                .flat_map(|_| [((rng.below(8) + 1) << 3) as u8, rng.below(128) as u8])
                .collect(),
            _ if rng.below(10) == 0 => vec![0x0a; 5 << 20],
            _ => Vec::new(),
        };
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready().await.expect("the engine API keeps serving");
        let route = PathAndQuery::from_static(path);
        let outcome: Result<(), Status> = if streaming {
            match grpc
                .server_streaming(tonic::Request::new(payload), route, Raw)
                .await
            {
                Ok(resp) => {
                    let mut s = resp.into_inner();
                    match tokio::time::timeout(Duration::from_millis(20), s.message()).await {
                        Ok(r) => r.map(|_| ()),
                        Err(_) => Ok(()), // a watch that waits: hung up here
                    }
                }
                Err(s) => Err(s),
            }
        } else {
            tokio::time::timeout(
                Duration::from_secs(5),
                grpc.unary(tonic::Request::new(payload), route, Raw),
            )
            .await
            .map_err(|_| Status::deadline_exceeded("fuzz call"))
            .and_then(|r| r.map(|_| ()))
        };
        tried += 1;
        if let Err(s) = outcome {
            refused += 1;
            assert!(
                !matches!(s.code(), tonic::Code::Unknown | tonic::Code::Unavailable),
                "{path}: {s:?}"
            );
            assert!(
                !s.message().is_empty(),
                "{path}: a refusal without a reason"
            );
        }
    }
    // Raw garbage on the socket.
    for _ in 0..20 {
        use tokio::io::AsyncWriteExt;
        let mut c = tokio::net::UnixStream::connect(w.api.settings().engine_socket())
            .await
            .unwrap();
        let _ = c.write_all(&rng.bytes(512)).await;
        tried += 1;
    }
    println!(
        "engine API fuzzer: {tried} inputs ({refused} refused with a status) in {:?}",
        started.elapsed()
    );
    assert!(refused > 200, "only {refused} refused");
    // Nothing left behind (an unclaimed attach ends at its claim deadline), and a proper engine
    // is still served.
    let end = Instant::now() + Duration::from_secs(10);
    while w.live_buffers() != buffers {
        assert!(Instant::now() < end, "{} buffers left", w.live_buffers());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut c = w.client().await;
    assert!(c.health().await.unwrap().ready);
    // Any attach the fuzz made ended (unclaimed): a proper engine attaches and detaches.
    let end = Instant::now() + Duration::from_secs(10);
    let a = loop {
        match c.attach(identity(&w.cfg)).await {
            Ok(a) => break a,
            Err(e) => assert!(Instant::now() < end, "no attach after the fuzz: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    c.detach(a.id()).await.unwrap();
    assert_eq!(w.live_buffers(), buffers);
}
