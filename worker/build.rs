//! Generates the tonic client and server of the peer protocol (DESIGN §3) from the `.proto` files
//! of `tandem-interfaces` (`worker/interfaces/proto/`), compiled with protox (no `protoc`). The
//! peer messages are not generated here: `extern_path` points every one of them at
//! `tandem_interfaces::peer::pb`, the one copy (worker/interfaces/README.md §6). The engine API
//! (`tandem.engine.v1`, DESIGN §3.1) is generated here whole for now, messages included.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = std::path::Path::new("interfaces/proto");
    let fds = protox::compile(["tandem/transfer/v1/transfer.proto"], [proto])?;
    tonic_prost_build::configure()
        .extern_path(".tandem.transfer.v1", "::tandem_interfaces::peer::pb")
        .compile_fds(fds)?;
    let engine = protox::compile(["tandem/engine/v1/engine.proto"], [proto])?;
    tonic_prost_build::configure().compile_fds(engine)?;
    println!("cargo:rerun-if-changed={}", proto.display());
    Ok(())
}
