//! The ports every Tandem pod listens on, as the operator renders them into container ports,
//! Services and the worker configs (`ports` of worker/interfaces/README.md §2).

/// gRPC control port of every prefill and decode worker (the peer protocol).
pub const CONTROL_PORT: u16 = 7000;
/// TCP data port of every prefill and decode worker (bulk KV over the TCP transport).
pub const DATA_PORT: u16 = 7001;
/// Health port of every worker role and store replica: `/healthz`, `/readyz`, `/metrics`,
/// `/report`.
pub const HEALTH_PORT: u16 = 8080;
/// Container port of the decode front door (OpenAI-compatible HTTP); the DecodePool's Service
/// maps `spec.frontDoor.port` to it.
pub const FRONT_DOOR_PORT: u16 = 8000;
/// Container port `engine-http` of an SGLang or vLLM engine (its own OpenAI-compatible API); the
/// DecodePool Service's `http` port targets it for those engines, except vLLM without a CacheTier
/// (prefill/decode through Tandem: the Service targets the front door, which hands requests to
/// the engines on this port).
pub const ENGINE_HTTP_PORT: u16 = 8100;
/// Rank-link port of a prefill pod of more than one CP rank: the TCP mesh between the CP ranks of
/// one group (step orders, and LayerSplit's layer broadcasts; worker `layer_split::tcp_link`).
pub const RANK_LINK_PORT: u16 = 7002;
/// L3 protocol port of every CacheTier store replica.
pub const L3_PORT: u16 = 7420;
