//! Compiles `proto/` with protox (a pure-Rust protobuf compiler: no `protoc` needed) and generates the
//! tonic client and server (DESIGN §3).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fds = protox::compile(["tandem/transfer/v1/transfer.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
