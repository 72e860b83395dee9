//! The DecodePool front door's wire format (worker/interfaces/README.md §3): the request body, the
//! streamed chunks, the final `tandem` block, and an incremental `text/event-stream` decoder.

use serde::{Deserialize, Serialize};

use super::workload::TraceRequest;

/// Placeholder prompt text: the worker simulates `input_tokens` tokens instead.
pub const PLACEHOLDER_PROMPT: &str = "tandem replay";

/// `POST /v1/completions` body (OpenAI-compatible plus Tandem's extensions).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// Model name the pool serves.
    pub model: String,
    /// Prompt text (a placeholder in replay).
    pub prompt: String,
    /// Tokens to generate (the trace's `output_length`).
    pub max_tokens: u32,
    /// Always true in replay: TTFT is the first streamed event.
    pub stream: bool,
    /// Prompt length to simulate (the trace's `input_length`).
    pub input_tokens: u32,
    /// Prefix identity (the trace's `hash_ids`).
    pub kv_block_hashes: Vec<u64>,
    /// This attempt's KV deadline in ms (Tandem extension; unset: the worker's own). Set only on
    /// the first attempt of an abort probe ([`super::driver::AbortProbe`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_deadline_ms: Option<u64>,
    /// The session's KV after this turn (Tandem extension, snapshot sync; empty: not sent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub session_kv_hashes: Vec<u64>,
}

impl CompletionRequest {
    /// The streamed request for one trace line.
    pub fn from_trace(model: &str, r: &TraceRequest) -> Self {
        Self {
            model: model.to_owned(),
            prompt: PLACEHOLDER_PROMPT.to_owned(),
            max_tokens: r.output_length,
            stream: true,
            input_tokens: r.input_length,
            kv_block_hashes: r.hash_ids.clone(),
            kv_deadline_ms: None,
            session_kv_hashes: Vec::new(),
        }
    }
}

/// Prefix tokens served per tier (worker/interfaces/README.md §3 `tandem.prefix_hit_tokens`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TierTokens {
    /// L1: device memory.
    pub l1: u64,
    /// L2: host memory.
    pub l2: u64,
    /// L3: the CacheTier store.
    pub l3: u64,
}

impl TierTokens {
    /// l1 + l2 + l3.
    pub fn total(&self) -> u64 {
        self.l1 + self.l2 + self.l3
    }
}

/// The `tandem` block of the last streamed event.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TandemBlock {
    /// Prefix tokens that came from a cache tier instead of being prefilled.
    pub prefix_hit_tokens: TierTokens,
    /// KV bytes moved prefill → decode for this request.
    pub kv_bytes: u64,
    /// Pod name of the prefill worker.
    pub prefill_worker: String,
    /// Prefills beyond the first inside the decode worker (another peer after a failure, or a
    /// spec-guard retry).
    pub prefill_retries: u32,
    /// Revision of the decode worker that served it.
    pub revision: String,
    /// Chunks whose verification failed (must be 0).
    pub corrupt_chunks: u64,
    /// Mean speculative accept length.
    pub spec_accept_length: f64,
}

/// OpenAI `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
    /// Sum.
    pub total_tokens: u64,
}

/// One choice of a chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Choice {
    /// Choice index (0).
    pub index: u32,
    /// Token text.
    pub text: String,
    /// `null` until the last event, then `"length"` (or `"stop"`).
    pub finish_reason: Option<String>,
}

/// One `data:` event of the stream (also the whole body of a non-streamed response).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CompletionChunk {
    /// Choices (one).
    pub choices: Vec<Choice>,
    /// Only on the last event.
    pub usage: Option<Usage>,
    /// Only on the last event.
    pub tandem: Option<TandemBlock>,
}

/// Incremental `text/event-stream` decoder: feed body chunks, get the `data` of complete events.
/// Multi-line `data:` fields are joined with `\n`; comments and other fields are ignored
/// (WHATWG HTML, "Server-sent events", event stream interpretation).
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
    data: Vec<String>,
}

impl SseDecoder {
    /// Appends bytes; returns the data of every event completed by them.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let mut line: Vec<u8> = self.buf.drain(..=nl).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            if line.is_empty() {
                if !self.data.is_empty() {
                    events.push(std::mem::take(&mut self.data).join("\n"));
                }
                continue;
            }
            let line = String::from_utf8_lossy(&line);
            if let Some(v) = line.strip_prefix("data:") {
                self.data.push(v.strip_prefix(' ').unwrap_or(v).to_owned());
            }
        }
        events
    }
}

/// The message of a refused request's error body (OpenAI's `{"error":{"message","type","param",
/// "code"}}`), prefixed with its code when that is a string (`context_length_exceeded: …`);
/// `None` when the body is not one.
pub fn error_message(body: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let e = v.get("error")?;
    let message = e.get("message")?.as_str()?;
    Some(match e.get("code").and_then(serde_json::Value::as_str) {
        Some(code) if !code.is_empty() => format!("{code}: {message}"),
        _ => message.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_name_their_code() {
        let b = r#"{"error":{"message":"the prompt has 9 tokens; the pool holds 8","type":"invalid_request_error","param":"prompt","code":"context_length_exceeded"}}"#;
        assert_eq!(
            error_message(b).as_deref(),
            Some("context_length_exceeded: the prompt has 9 tokens; the pool holds 8")
        );
        let b = r#"{"error":{"message":"busy","type":"x","param":null,"code":429}}"#;
        assert_eq!(error_message(b).as_deref(), Some("busy"));
        assert_eq!(error_message("Payload Too Large"), None);
    }

    #[test]
    fn sse_events_split_across_chunks_and_lines() {
        let mut d = SseDecoder::default();
        assert!(d.feed(b"data: {\"a\"").is_empty());
        assert_eq!(
            d.feed(b":1}\n\n: comment\n\ndata: x\r\ndata: y\r\n\r\n"),
            vec!["{\"a\":1}".to_owned(), "x\ny".to_owned()]
        );
        assert_eq!(d.feed(b"data: [DONE]\n\n"), vec!["[DONE]".to_owned()]);
    }

    #[test]
    fn last_chunk_parses_usage_and_tandem_block() {
        let s = r#"{"id":"c","object":"text_completion","created":1,"model":"m",
            "choices":[{"index":0,"text":"","finish_reason":"length"}],
            "usage":{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13},
            "tandem":{"prefix_hit_tokens":{"l1":1,"l2":2,"l3":3},"kv_bytes":9,
            "prefill_worker":"p-0","revision":"r1","corrupt_chunks":0,"spec_accept_length":1.5}}"#;
        let c: CompletionChunk = serde_json::from_str(s).unwrap();
        assert_eq!(c.usage.unwrap().completion_tokens, 3);
        let t = c.tandem.unwrap();
        assert_eq!(t.prefix_hit_tokens.total(), 6);
        assert_eq!(t.revision, "r1");
        assert_eq!(c.choices[0].finish_reason.as_deref(), Some("length"));
    }

    #[test]
    fn error_bodies() {
        let b = r#"{"error":{"message":"draining","type":"unavailable","code":503}}"#;
        assert_eq!(error_message(b).as_deref(), Some("draining"));
        assert_eq!(error_message("nope"), None);
    }
}
