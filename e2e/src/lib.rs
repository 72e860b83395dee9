//! Tandem end-to-end harness (DESIGN §6, issue 4).
//!
//! * [`cluster`]: a real Kubernetes control plane (etcd 3.6, kube-apiserver with RBAC,
//!   kube-controller-manager, kube-scheduler, kwok) on 127.0.0.1, built from the Go module proxy and
//!   cached; `tandem-e2e cluster up|down|status`.
//! * [`runner`]: the process runner, a minimal kubelet that runs pods bound to its nodes as local
//!   processes (`tandem-worker`, `tandem-operator`) on their own 127.x addresses.
//! * [`scale`]: the operator at scale on kwok nodes, measured (`tandem-e2e scale`).
//! * [`pidfile`], [`http_get`]: process identity for safe stops; health and readiness GETs.
//!
//! Measured figures (build time, memory, disk, startup) are in `e2e/README.md`.

pub mod cluster;
pub mod demo;
pub mod http_get;
pub mod pidfile;
pub mod replay;
pub mod report;
pub mod runner;
pub mod scale;
