//! The simulated prefill engine as a rank of a LayerSplit CP group (engine.proto `LayerSplitSeat`
//! and `AwaitLayer`; DESIGN contract 6; seed 004 "KV Cache 分层存储 LayerSplit").
//!
//! Its target pool holds only the rank's owned layers (pool layer `j` = model layer
//! `owned.start + j`) and a receive slot. A room goes through the model's layers in order:
//! - an **owned** layer: its share of the room's compute time, then the layer's chunks of every
//!   page (the request's deterministic KV, [`super::chunk_spec`], keyed by the model layer) into
//!   its pool layer, then a PagesReady for that layer alone — the worker writes it into the
//!   decode's pages and broadcasts it to the other ranks;
//! - **another** layer: AwaitLayer, then attention reads every page's receive slot, each chunk
//!   verified against the layer's KV of this request: a mismatch is a corrupt chunk read
//!   (`layer_corrupt_chunks`), what a kernel launched before the broadcast landed would read.
//!
//! A PagesReady with `last` and no pages ends the room once every layer went by (the rank's last
//! awaited layer may come after its last owned one).
//!
//! Negative control `--skip-layer-wait` (feature `negative-controls`): attention reads the receive
//! slot without AwaitLayer. The worker writes a slot only when asked, so the slot holds whatever it
//! held before — zeros or an earlier layer — and every such read is counted in
//! `layer_reads_before_ready` and, failing verification, in `layer_corrupt_chunks`.

use std::time::Duration;

use super::{Refused, Room, Summary, chunk_spec};
use crate::engine::content::{fill_chunk, verify_chunk};
use crate::engine_api::client::{Attached, ClientError, EngineClient};
use crate::engine_api::pb;
use crate::memory::pool::PoolRole;

/// Computes and sends `room` on a LayerSplit rank seated as `seat` (module docs), counting into
/// `s`. Returns [`Refused`] when the worker refused a call (the room failed meanwhile).
pub(super) async fn compute_and_send(
    room: &mut Room,
    seat: &pb::LayerSplitSeat,
    s: &mut Summary,
) -> Result<(), Refused> {
    let Room {
        client,
        att,
        work: w,
        pages,
        per_token,
        skip_layer_wait: skip_wait,
        ..
    } = room;
    let (att, w, pages, per_token, skip_wait): (
        &Attached,
        &pb::PrefillWork,
        &[u32],
        Duration,
        bool,
    ) = (att, w, pages, *per_token, *skip_wait);
    let client: &mut EngineClient = client;
    let id = att.id();
    let mut any_accepted = false;
    let refused = |any_accepted: bool, error: ClientError| Refused {
        any_accepted,
        error,
    };
    let target = att.pool(PoolRole::Target).ok_or_else(|| {
        refused(
            false,
            ClientError::Pools("a LayerSplit rank without a target pool".into()),
        )
    })?;
    let owned = seat.owned.map_or(0..0, |r| r.start..r.end);
    let layers = seat.model_layers.max(1);
    // The room's compute time spread over the model's layers; this rank computes its owned ones.
    let per_layer = per_token.saturating_mul(w.tokens) / layers;
    for layer in 0..layers {
        if owned.contains(&layer) {
            if !per_layer.is_zero() {
                tokio::time::sleep(per_layer).await;
            }
            let pool_layer = layer - owned.start;
            for (k, &page) in pages.iter().enumerate() {
                let spec = chunk_spec(target, w.request_id, w.tokens, k as u32, layer);
                let mut buf = vec![0u8; spec.bytes()];
                fill_chunk(&mut buf, &spec);
                target
                    .write(page, pool_layer, 0, &buf)
                    .map_err(|e| refused(any_accepted, e))?;
                s.chunks += 1;
            }
            let r = client.req(pb::PagesReadyRequest {
                attach_id: id,
                room: w.room,
                pages: pages.to_vec(),
                first_page: 0,
                layers: Some(pb::LayerRange {
                    start: layer,
                    end: layer + 1,
                }),
                last: false,
            });
            s.pages_ready_calls += 1;
            let accepted = client
                .prefill
                .pages_ready(r)
                .await
                .map_err(|e| refused(any_accepted, ClientError::from(e)))?
                .into_inner()
                .accepted;
            if !accepted {
                // The room failed: the worker returns the pages in a SourceFree.
                s.rooms_dropped += 1;
                return Ok(());
            }
            any_accepted = true;
            continue;
        }
        if skip_wait {
            s.layer_reads_before_ready += pages.len() as u64;
        } else {
            let r = client.req(pb::AwaitLayerRequest {
                attach_id: id,
                room: w.room,
                layer,
                pages: pages.to_vec(),
            });
            let reply = client
                .prefill
                .await_layer(r)
                .await
                .map_err(|e| refused(any_accepted, ClientError::from(e)))?
                .into_inner();
            s.layer_waits += 1;
            if reply.already_there {
                s.layer_waits_hidden += 1;
            }
        }
        // Attention on `layer` reads the receive slot of every page.
        for (k, &page) in pages.iter().enumerate() {
            let spec = chunk_spec(target, w.request_id, w.tokens, k as u32, layer);
            let mut buf = vec![0u8; spec.bytes()];
            target
                .read(page, seat.receive_slot, 0, &mut buf)
                .map_err(|e| refused(any_accepted, e))?;
            s.layer_chunks_read += 1;
            if verify_chunk(&buf, &spec).is_err() {
                s.layer_corrupt_chunks += 1;
            }
        }
    }
    if s.layer_corrupt_chunks > 0 {
        tracing::error!(
            room = ?w.room,
            corrupt = s.layer_corrupt_chunks,
            "attention read receive-slot chunks that do not hold their layer's KV"
        );
    }
    // The room's input ends with the layer loop.
    let r = client.req(pb::PagesReadyRequest {
        attach_id: id,
        room: w.room,
        pages: Vec::new(),
        first_page: 0,
        layers: None,
        last: true,
    });
    s.pages_ready_calls += 1;
    client
        .prefill
        .pages_ready(r)
        .await
        .map_err(|e| refused(any_accepted, ClientError::from(e)))?;
    s.pages += pages.len() as u64;
    Ok(())
}
