//! Generates the `kvferry.v1.Peer` and `kvferry.v1.Engine` services and messages. protoc
//! comes from the `protoc-bin-vendored` crate so that no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/kvferry/v1/peer.proto",
        "proto/kvferry/v1/engine.proto",
    ];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    // prost-build reads PROTOC; the build script is single-threaded, so setting it is sound.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure().compile_protos(&protos, &["proto"])?;
    Ok(())
}
