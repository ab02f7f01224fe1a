//! Outputs as bit patterns: stable digests, bit vectors and a bit-exact comparison that names
//! the first difference.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use half::bf16;

/// A stable digest of a value (SipHash with fixed keys).
pub fn digest<T: Hash + ?Sized>(x: &T) -> u64 {
    let mut h = DefaultHasher::new();
    x.hash(&mut h);
    h.finish()
}

/// The bit patterns of bf16 values (comparable, hashable, NaN-safe).
pub fn bf16_bits(x: &[bf16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The bit patterns of fp32 values (comparable, hashable, NaN-safe).
pub fn f32_bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Asserts two shard sets are bit-identical (NaN-safe), naming the first difference.
pub fn assert_bits_eq(got: &[f32], want: &[f32], ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{ctx}: element {i} of {} differs: got {:e} ({:#010x}), want {:e} ({:#010x})",
            got.len(),
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}
