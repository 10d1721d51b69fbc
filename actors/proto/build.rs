//! Generates the `kvferry.v1.Peer` and `kvferry.v1.Engine` services and messages. protoc
//! comes from the `protoc-bin-vendored` crate so that no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["kvferry/v1/peer.proto", "kvferry/v1/engine.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    // prost-build reads PROTOC; the build script is single-threaded, so setting it is sound.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    // A query's hashes decode as slices of the received buffer (`Bytes`), not one
    // allocation each: a query of 1,024 hashes spent more in malloc than in the cache.
    tonic_prost_build::configure()
        .bytes(".kvferry.v1.QueryRequest.hashes")
        .bytes(".kvferry.v1.QueryRequest.packed_hashes")
        .compile_protos(&protos, &["."])?;
    Ok(())
}
