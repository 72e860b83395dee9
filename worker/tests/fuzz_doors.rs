//! Issue 18, item 6: bad input at every door. Deterministic fuzzers (a fixed-seed splitmix64, no
//! fuzzing crate) that feed malformed input to the worker's doors and check: a clear error (an
//! OpenAI error object at the front door, a gRPC status on the peer protocol), no panic (the
//! process or server keeps serving), nothing leaked (KV pages and rooms back to zero). Each prints
//! how many inputs it tried. Sized to run in seconds.
//!
//! - The front door of a real decode process (with a real prefill; loopback net 121, hosts 3 and
//!   10): random bytes, truncated JSON, wrong types, negative and absurd `max_tokens`, oversized
//!   prompts and bodies, a wrong `Content-Type`, clients that hang up mid-stream.
//! - The peer protocol of a prefill (`tandem.transfer.v1.Transfer`, in process): every method with
//!   random, truncated, bit-flipped and oversized payloads (a raw codec under tonic), out-of-order
//!   calls (a chunk or an abort before the room, a second open), signal streams with and without
//!   their header carrying random messages, and raw garbage on the control port.
//!
//! (The engine API's malformed-message tests are `engine_api_malformed.rs`.)

mod serve_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut};
use serde_json::{Value, json};
use serve_support::*;
use tandem_worker::config::WorkerRole;
use tandem_worker::control::KvLayout;
use tandem_worker::control::pb;
use tandem_worker::roles::prefill::node::{PrefillConfig, PrefillNode, PrefillService};
use tandem_worker::transfer::tcp::{TcpConfig, TcpTransport};
use tokio::io::AsyncWriteExt;
use tonic::Status;

/// splitmix64: the fuzzers' deterministic source.
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

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

// ---------------------------------------------------------------------------------------------
// The front door
// ---------------------------------------------------------------------------------------------

/// One raw POST: status and body, or what failed. `hang_up_after_first` drops the response after
/// its first body frame (a client that goes away mid-stream).
async fn post(
    addr: SocketAddr,
    body: Vec<u8>,
    content_type: &str,
    hang_up_after_first: bool,
) -> Result<(u16, String), String> {
    use http_body_util::{BodyExt, Full};
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", content_type)
        .body(Full::new(bytes::Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let code = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut text = Vec::new();
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.map_err(|e| e.to_string())?.into_data() {
            text.extend_from_slice(&d);
            if hang_up_after_first {
                return Ok((code, String::from_utf8_lossy(&text).into_owned()));
            }
        }
    }
    Ok((code, String::from_utf8_lossy(&text).into_owned()))
}

/// A body the front door must refuse or serve: one of the fuzzer's input classes.
fn front_door_input(rng: &mut Rng) -> (&'static str, Vec<u8>, &'static str, bool) {
    let good = json!({"model": "llama-3-8b", "prompt": "hello", "max_tokens": 3,
        "input_tokens": 100, "kv_block_hashes": [1, 2]});
    let absurd: [Value; 14] = [
        json!(-1),
        json!(-1_000_000_000i64),
        json!(0),
        json!(1e30),
        json!("x"),
        json!(null),
        json!(70_000),
        json!(u32::MAX),
        json!(u64::MAX),
        json!(1.5),
        json!(true),
        json!([]),
        json!({}),
        json!(-0.0),
    ];
    match rng.below(12) {
        0 => ("random bytes", rng.bytes(300), "application/json", false),
        1 => {
            let text = good.to_string();
            let cut = rng.below(text.len() as u64) as usize;
            (
                "truncated JSON",
                text.as_bytes()[..cut].to_vec(),
                "application/json",
                false,
            )
        }
        2 => {
            let mut v = good.clone();
            v["max_tokens"] = rng.pick(&absurd).clone();
            (
                "absurd max_tokens",
                v.to_string().into_bytes(),
                "application/json",
                false,
            )
        }
        3 => {
            let mut v = good.clone();
            v["input_tokens"] = rng.pick(&absurd).clone();
            (
                "absurd input_tokens",
                v.to_string().into_bytes(),
                "application/json",
                false,
            )
        }
        4 => {
            // Oversized prompts: far beyond the pool (context_length_exceeded) or a long text.
            let mut v = good.clone();
            if rng.below(2) == 0 {
                v["input_tokens"] = json!(rng.pick(&[10_000_000u64, 4_000_000_000, 1 << 20]));
            } else {
                v.as_object_mut().unwrap().remove("input_tokens");
                v["prompt"] = json!("tok ".repeat(200_000));
            }
            (
                "oversized prompt",
                v.to_string().into_bytes(),
                "application/json",
                false,
            )
        }
        5 => {
            let mut v = good.clone();
            let field = *rng.pick(&["prompt", "stream", "kv_block_hashes", "model"]);
            v[field] = rng.pick(&absurd).clone();
            (
                "wrong field type",
                v.to_string().into_bytes(),
                "application/json",
                false,
            )
        }
        6 => {
            let kind = *rng.pick(&[
                "text/plain",
                "application/x-www-form-urlencoded",
                "image/png",
            ]);
            (
                "wrong content type",
                good.to_string().into_bytes(),
                kind,
                false,
            )
        }
        7 => {
            let mut v = good.clone();
            v["stream"] = json!(true);
            v["max_tokens"] = json!(2000);
            (
                "hang up mid-stream",
                v.to_string().into_bytes(),
                "application/json",
                true,
            )
        }
        8 => {
            let mut bytes = good.to_string().into_bytes();
            let i = rng.below(bytes.len() as u64) as usize;
            bytes[i] = rng.next() as u8;
            ("flipped byte", bytes, "application/json", false)
        }
        9 => (
            "nested arrays",
            "[".repeat(10_000).into_bytes(),
            "application/json",
            false,
        ),
        10 => {
            let mut v = good.clone();
            v["stream"] = json!(rng.below(2) == 0);
            (
                "valid",
                v.to_string().into_bytes(),
                "application/json",
                false,
            )
        }
        _ => ("empty body", Vec::new(), "application/json", false),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn front_door_fuzzer_answers_every_input_with_a_clear_error_and_leaks_nothing() {
    let w = World::new(121);
    w.publish(&[3]);
    let _p = w.spawn(3, &config(WorkerRole::Prefill, "r1", w.ports), &[]);
    let _d = w.spawn(10, &config(WorkerRole::Decode, "r1", w.ports), &[]);
    let (health, front) = (w.addr(10, w.ports.health), w.addr(10, w.ports.front));
    until(Duration::from_secs(30), || async {
        status(health, "/readyz").await == Some(200)
    })
    .await;
    let mut rng = Rng(0x7A9D_E118);
    let started = Instant::now();
    let mut tried = 0u64;
    let mut by_status = std::collections::BTreeMap::<u16, u64>::new();
    let inputs = 300;
    for _ in 0..inputs {
        let (class, body, content_type, hang_up) = front_door_input(&mut rng);
        let (code, text) = tokio::time::timeout(
            Duration::from_secs(20),
            post(front, body, content_type, hang_up),
        )
        .await
        .unwrap_or_else(|_| panic!("{class}: no answer within 20 s"))
        .unwrap_or_else(|e| panic!("{class}: the front door failed: {e}"));
        tried += 1;
        *by_status.entry(code).or_default() += 1;
        assert!(
            [200, 400, 413, 415, 422, 429, 503].contains(&code),
            "{class}: unexpected status {code}: {text}"
        );
        if code != 200 {
            let e: Value = serde_json::from_str(&text)
                .unwrap_or_else(|_| panic!("{class}: {code} without a JSON error: {text:?}"));
            assert!(
                e["error"]["code"].is_string() && e["error"]["message"].is_string(),
                "{class}: {code} without the OpenAI error object: {e}"
            );
        } else if !hang_up && !text.starts_with("data:") {
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["tandem"]["corrupt_chunks"], 0, "{class}: {v}");
        }
    }
    // A body over the 16 MiB limit, twice.
    for _ in 0..2 {
        let (code, text) = post(front, vec![b' '; (16 << 20) + 1], "application/json", false)
            .await
            .unwrap();
        tried += 1;
        assert_eq!(code, 413, "{text}");
        assert!(text.contains("request_too_large"), "{text}");
    }
    println!(
        "front door fuzzer: {tried} inputs in {:?}, by status {by_status:?}",
        started.elapsed()
    );
    // The inputs covered the errors and the successes.
    assert!(
        by_status.get(&400).is_some_and(|n| *n > 50),
        "{by_status:?}"
    );
    assert!(
        by_status.get(&200).is_some_and(|n| *n > 10),
        "{by_status:?}"
    );
    // Nothing leaked: every page back, every request ended; the worker still serves.
    until(Duration::from_secs(15), || async {
        let r = get_json(health, "/report").await.1;
        let p = &r["kv_pages"];
        p["held"] == 0 && p["quarantined"] == 0 && p["free"] == p["total"]
    })
    .await;
    assert_eq!(status(health, "/readyz").await, Some(200));
    let (code, frames) = http(
        front,
        "POST",
        "/v1/completions",
        Some(completion(300, 4, false)),
    )
    .await;
    assert_eq!(code, 200, "{}", text(&frames));
    let r = get_json(health, "/report").await.1;
    assert_eq!(r["counters"]["corrupt_pages_read"], 0, "{r}");
    assert_eq!(r["kv_pages"]["stranded"], 0, "{r}");
}

// ---------------------------------------------------------------------------------------------
// The peer protocol
// ---------------------------------------------------------------------------------------------

/// Raw payload bytes under tonic's gRPC framing: whatever the fuzzer makes goes on the wire as the
/// message, and the reply comes back undecoded.
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

const LAYOUT: KvLayout = KvLayout {
    layers: 2,
    page_tokens: 16,
    token_bytes: 64,
};

/// A structurally valid message of `method` with fuzzed fields (room ids from a small set, so
/// that opens, chunks and aborts meet out of order).
fn peer_message(rng: &mut Rng, method: &str) -> Vec<u8> {
    use prost::Message;
    let room_ref = pb::RoomRef {
        room_id: rng.below(8),
        generation: rng.below(3),
    };
    let room = Some(room_ref);
    let layout = if rng.below(4) == 0 {
        Some(pb::KvLayout {
            layers: rng.below(4) as u32,
            page_tokens: rng.below(32) as u32,
            token_bytes: rng.below(128) as u32,
        })
    } else {
        Some(LAYOUT.into())
    };
    match method {
        "PeerHello" => pb::PeerInfo {
            worker_id: format!("fuzz-{}", rng.below(3)),
            role: rng.below(4) as i32,
            layout,
            revision: (*rng.pick(&["", "r1", "r2"])).to_owned(),
            incarnation: rng.below(4),
            ..Default::default()
        }
        .encode_to_vec(),
        "OpenRoom" => pb::OpenRoomRequest {
            room: room.filter(|_| rng.below(8) != 0),
            decode_rank: rng.below(2) as u32,
            request: Some(pb::RequestSpec {
                request_id: rng.next(),
                input_tokens: rng.below(200) as u32,
                output_tokens: 1,
                hash_ids: vec![rng.next()],
            }),
            decode_worker: format!("fuzz-{}", rng.below(3)),
            // A loopback port nothing listens on: a room's writes fail at once.
            data_addr: "127.0.0.1:1".into(),
            dst_region: rng.below(2) as u32,
            dst_pages: (0..rng.below(4)).map(|_| rng.next() as u32).collect(),
            layout,
            deadline_ms: rng.below(2000),
            decode_incarnation: rng.below(4),
            hand_off_token: rng.next(),
        }
        .encode_to_vec(),
        "SubmitChunk" => pb::SubmitChunkRequest {
            room,
            first_page: rng.next() as u32,
            pages: rng.next() as u32,
            last: rng.below(2) == 0,
        }
        .encode_to_vec(),
        "AbortRoom" => pb::Abort {
            room: room.filter(|_| rng.below(8) != 0),
            decode_rank: rng.below(2) as u32,
            reason: rng.below(10) as i32,
        }
        .encode_to_vec(),
        "WatchRoom" => room_ref.encode_to_vec(),
        _ => {
            let body = match rng.below(5) {
                0 => pb::peer_message::Body::Abort(pb::Abort {
                    room: room.filter(|_| rng.below(4) != 0),
                    decode_rank: rng.below(2) as u32,
                    reason: rng.below(10) as i32,
                }),
                1 => pb::peer_message::Body::Heartbeat(pb::Heartbeat {
                    seq: rng.next(),
                    live_rooms: vec![room_ref],
                    incarnation: rng.below(4),
                }),
                // Messages only prefill sends: the wrong direction.
                2 => pb::peer_message::Body::Chunk(pb::ChunkDone {
                    room,
                    last: true,
                    ..Default::default()
                }),
                3 => pb::peer_message::Body::Ack(pb::AbortAck {
                    room,
                    ..Default::default()
                }),
                _ => pb::peer_message::Body::Failed(pb::RoomFailed {
                    room,
                    ..Default::default()
                }),
            };
            pb::PeerMessage { body: Some(body) }.encode_to_vec()
        }
    }
}

/// A payload for `method`: valid, truncated, with appended junk, bit-flipped, random or oversized.
fn peer_payload(rng: &mut Rng, method: &str) -> (&'static str, Vec<u8>) {
    let valid = peer_message(rng, method);
    match rng.below(6) {
        0 => ("valid", valid),
        1 => {
            let cut = rng.below(valid.len() as u64 + 1) as usize;
            ("truncated", valid[..cut].to_vec())
        }
        2 => {
            let mut v = valid;
            v.extend(rng.bytes(64));
            ("junk appended", v)
        }
        3 => {
            let mut v = valid;
            if !v.is_empty() {
                let i = rng.below(v.len() as u64) as usize;
                v[i] ^= 1 << rng.below(8);
            }
            ("bit flipped", v)
        }
        4 => ("random", rng.bytes(200)),
        _ if rng.below(8) == 0 => ("oversized", vec![0x0a; 5 << 20]),
        _ => ("random", rng.bytes(40)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_protocol_fuzzer_refuses_bad_messages_and_leaks_no_room() {
    use tonic::codegen::http::uri::PathAndQuery;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let node = PrefillNode::new(
        PrefillConfig {
            worker_id: "prefill-fuzz".into(),
            rank: 0,
            layout: LAYOUT,
            compute_per_page: Duration::ZERO,
        },
        Arc::new(TcpTransport::new(TcpConfig::default())),
    );
    let service = PrefillService::new(node.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let mut rng = Rng(0x18_2026);
    let started = Instant::now();
    let (mut tried, mut refused) = (0u64, 0u64);
    let methods = [
        "PeerHello",
        "OpenRoom",
        "SubmitChunk",
        "AbortRoom",
        "WatchRoom",
        "Signal",
    ];
    for _ in 0..600 {
        let method = *rng.pick(&methods);
        let path =
            PathAndQuery::try_from(format!("/tandem.transfer.v1.Transfer/{method}")).unwrap();
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready().await.expect("the prefill keeps serving");
        let outcome: Result<(), Status> = match method {
            "WatchRoom" => {
                let (_, payload) = peer_payload(&mut rng, method);
                match grpc
                    .server_streaming(tonic::Request::new(payload), path, Raw)
                    .await
                {
                    // The first event (the room's state now) comes at once; the stream is dropped.
                    Ok(resp) => {
                        let mut s = resp.into_inner();
                        tokio::time::timeout(Duration::from_secs(5), s.message())
                            .await
                            .expect("WatchRoom answers its first event")
                            .map(|_| ())
                    }
                    Err(s) => Err(s),
                }
            }
            "Signal" => {
                let messages: Vec<Vec<u8>> = (0..rng.below(6))
                    .map(|_| peer_payload(&mut rng, method).1)
                    .collect();
                let mut req = tonic::Request::new(tokio_stream::iter(messages));
                if rng.below(4) != 0 {
                    req.metadata_mut().insert(
                        "tandem-worker-id",
                        format!("fuzz-{}", rng.below(3)).parse().unwrap(),
                    );
                }
                match grpc.streaming(req, path, Raw).await {
                    Ok(resp) => {
                        // Read what comes within a moment, then hang up.
                        let mut s = resp.into_inner();
                        let _ = tokio::time::timeout(Duration::from_millis(20), s.message()).await;
                        Ok(())
                    }
                    Err(s) => Err(s),
                }
            }
            _ => {
                let (_, payload) = peer_payload(&mut rng, method);
                grpc.unary(tonic::Request::new(payload), path, Raw)
                    .await
                    .map(|_| ())
            }
        };
        tried += 1;
        if let Err(s) = outcome {
            refused += 1;
            // A clear error: a status with a message, never an internal failure or a dead server.
            assert!(
                !matches!(s.code(), tonic::Code::Unknown | tonic::Code::Unavailable),
                "{method}: {s:?}"
            );
        }
    }
    // Raw garbage on the control port: the connection is dropped, the server stays up.
    for _ in 0..20 {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = c.write_all(&rng.bytes(512)).await;
        tried += 1;
    }
    println!(
        "peer protocol fuzzer: {tried} inputs ({refused} refused with a status) in {:?}",
        started.elapsed()
    );
    assert!(refused > 100, "the fuzzer refused only {refused} inputs");
    // Nothing leaked: every room the fuzz opened failed (its writes had nowhere to go) or is
    // aborted here, and the table empties.
    let mut client = pb::transfer_client::TransferClient::new(channel.clone());
    for room_id in 0..8 {
        for generation in 0..3 {
            for decode_rank in 0..2 {
                let _ = client
                    .abort_room(pb::Abort {
                        room: Some(pb::RoomRef {
                            room_id,
                            generation,
                        }),
                        decode_rank,
                        reason: pb::AbortReason::Client as i32,
                    })
                    .await;
            }
        }
    }
    let end = Instant::now() + Duration::from_secs(15);
    while node.rooms_held() > 0 {
        assert!(Instant::now() < end, "{} rooms leaked", node.rooms_held());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Still serving: a proper hello is answered.
    let hello = client
        .peer_hello(pb::PeerInfo {
            worker_id: "decode-ok".into(),
            layout: Some(LAYOUT.into()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(hello.worker_id, "prefill-fuzz");
}
