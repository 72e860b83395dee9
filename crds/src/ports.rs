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
/// LayerSplit rank-link port of a prefill pod in a `layerSplit` pool: the TCP mesh between the
/// CP ranks of one group (layer broadcasts, step orders; worker `layer_split::tcp_link`).
pub const RANK_LINK_PORT: u16 = 7002;
/// L3 protocol port of every CacheTier store replica.
pub const L3_PORT: u16 = 7420;
