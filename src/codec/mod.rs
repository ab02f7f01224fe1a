//! The group quantizer and the byte layout of what goes on the wire (docs/numerics.md §1, §6).
//!
//! Everything here works on one group or one slab at a time and is the single definition the
//! CPU passes (`backend::cpu`) apply in parallel and the CUDA kernels reproduce. The small
//! types every backend and the collectives share live here too, below all of them: what a
//! weight slab encodes ([`weight_encoding`]), Global-QSGD's integer codes ([`int_code`]) and
//! the element types a reduce-scatter sums ([`sum`]).

pub mod int_code;
pub mod quant;
pub mod slab;
pub mod sum;
pub mod weight_encoding;
