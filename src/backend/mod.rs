//! Executors of the fused passes. `cpu` is the rayon implementation and the executable
//! reference every other backend must reproduce byte for byte; `cuda` runs the same passes as
//! kernels on the caller's CUDA stream. [`Backend`] is what the collectives need of either.

pub mod cpu;
pub mod cuda;
mod device;
mod grad_element;

pub use device::{Backend, Element, GlobalScale, global_scale};
pub use grad_element::{GradElement, narrow_into, widen_into};
