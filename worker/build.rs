//! Compiles `proto/` with protox (a pure-Rust protobuf compiler: no `protoc` needed) and generates the
//! tonic client and server (DESIGN §3). The engine API (`tandem.engine.v1`, DESIGN §3.1) lives under
//! `interfaces/proto/`, where the `tandem-interfaces` crate will generate it.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fds = protox::compile(["tandem/transfer/v1/transfer.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    let engine = protox::compile(["tandem/engine/v1/engine.proto"], ["interfaces/proto"])?;
    tonic_prost_build::configure().compile_fds(engine)?;
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-changed=interfaces/proto");
    Ok(())
}
