//! No code: this crate only pins the dependency features of `tandem-worker` and `tandem-operator`
//! for `tandem-e2e`, so that the demo builds the release workspace once (see its `Cargo.toml`).
