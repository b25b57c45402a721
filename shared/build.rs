//! Compiles `proto/ferry/v1/*.proto` with protox (pure Rust, no system
//! `protoc`) and generates the prost messages and tonic clients and servers.
//! The encoded descriptor set is written next to the generated code so the
//! control plane can serve gRPC reflection.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time: a compile-time `env!` would bake one checkout's path
    // into a build script that cargo may reuse for another checkout.
    let proto_root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    let files = [
        "ferry/v1/common.proto",
        "ferry/v1/config.proto",
        "ferry/v1/agent.proto",
        "ferry/v1/lease.proto",
        "ferry/v1/dlq.proto",
        "ferry/v1/metrics.proto",
    ];
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

    // Imports are relative to `proto/` (`import "ferry/v1/dlq.proto";`), the
    // layout every generator expects: `proto/` is the only include path, and
    // the files are named `ferry/v1/*.proto` in the descriptor set.
    let fds = protox::compile(files.map(|f| proto_root.join(f)), [&proto_root])?;

    // compile_fds does not write the descriptor set itself.
    std::fs::write(out_dir.join("ferry_v1_descriptor.bin"), fds.encode_to_vec())?;

    // `build_transport(false)`: the generated `XClient::connect(dst)` helper
    // would clash with the `AgentService.Connect` RPC method; clients are built
    // with `XClient::new(channel)` instead.
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_fds(fds)?;

    for file in files {
        println!("cargo:rerun-if-changed={}", proto_root.join(file).display());
    }
    Ok(())
}
