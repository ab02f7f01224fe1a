//! The numerics of SPEC §1: the group quantizer and the byte layout of what goes on the wire.
//!
//! Everything here works on one group or one slab at a time and is the single definition the
//! CPU passes (`backend::cpu`) apply in parallel and the CUDA kernels reproduce.

pub mod quant;
pub mod slab;
