//! With the `ffi` feature, compiles the C++ half of the cxx bridge (`src/ffi/mod.rs`) into the
//! static library. The torch adapter it calls (`cpp/torch_comms.h`) is compiled by the torch
//! extension build, against the installed torch.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "ffi")]
    {
        cxx_build::bridge("src/ffi/mod.rs")
            .std("c++17")
            .compile("sdp4bit-ffi");
        println!("cargo:rerun-if-changed=src/ffi/mod.rs");
        println!("cargo:rerun-if-changed=cpp/torch_comms.h");
    }
}
