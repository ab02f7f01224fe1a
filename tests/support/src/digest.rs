//! A 64-bit digest (FNV-1a) of byte strings, for keys of on-disk caches (not a checksum
//! against tampering).

/// The digest of everything added so far; each addition is delimited, so ("ab", "c") and
/// ("a", "bc") differ.
#[derive(Debug, Clone, Copy)]
pub struct Digest(u64);

impl Default for Digest {
    fn default() -> Self {
        Digest(0xcbf2_9ce4_8422_2325)
    }
}

impl Digest {
    /// Adds `bytes` and a delimiter.
    pub fn add(&mut self, bytes: &[u8]) -> &mut Self {
        for &b in bytes.iter().chain(&[0xff]) {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        self
    }

    /// The digest as 16 hex digits.
    pub fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}
