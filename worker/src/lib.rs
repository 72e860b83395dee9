//! Tandem data plane (see DESIGN §3). The crate has no Kubernetes dependency.
