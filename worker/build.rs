//! Generates the tonic client and server of the peer protocol (DESIGN §3) from the `.proto` files
//! of `tandem-interfaces` (`worker/interfaces/proto/`), compiled with protox (no `protoc`). The
//! messages are not generated here: `extern_path` points every one of them at
//! `tandem_interfaces::peer::pb`, the one copy (worker/interfaces/README.md §6).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = std::path::Path::new("interfaces/proto");
    let fds = protox::compile(["tandem/transfer/v1/transfer.proto"], [proto])?;
    tonic_prost_build::configure()
        .extern_path(".tandem.transfer.v1", "::tandem_interfaces::peer::pb")
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed={}", proto.display());
    Ok(())
}
