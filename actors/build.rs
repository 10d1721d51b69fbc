//! Generates the `kvferry.v1.Peer` service and messages. protoc comes from the
//! `protoc-bin-vendored` crate so that no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/kvferry/v1/peer.proto";
    println!("cargo:rerun-if-changed={proto}");
    // prost-build reads PROTOC; the build script is single-threaded, so setting it is sound.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure().compile_protos(&[proto], &["proto"])?;
    Ok(())
}
