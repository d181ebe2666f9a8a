//! Compiles the protos with `protox` (pure Rust), so building needs no system `protoc`.

use std::path::PathBuf;

/// One file per protobuf package: each later package (the parameter-server service, ...)
/// adds its own file here.
const PROTOS: &[&str] = &[
    "ibex/bench/v1/bench.proto",
    "helloworld/helloworld.proto",
    "ibex/ps/v1/ps.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("protos");
    for p in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    let fds = protox::compile(PROTOS, [&root])?;
    let mut config = prost_build::Config::new();
    // Bulk data must stay zero-copy after decoding: `Bytes` slices, not `Vec<u8>`.
    config.bytes(["."]);
    // tonic's clients and servers, and beside each service its Ibex types, whose unary
    // calls take Ibex's direct path.
    config.service_generator(ibex_codegen::configure().service_generator());
    config.compile_fds(fds)?;
    Ok(())
}
