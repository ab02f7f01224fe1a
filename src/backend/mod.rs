//! Executors of the fused passes. `cpu` is the rayon implementation and the executable
//! reference every other backend must reproduce byte for byte.

pub mod cpu;
