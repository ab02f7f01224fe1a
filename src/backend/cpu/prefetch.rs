//! Software prefetch for the passes' input streams.
//!
//! A pass works group by group in its scratch buffer, with enough arithmetic per element that
//! the out-of-order window of a core does not reach far past the group it works on; where the
//! hardware prefetcher does not run ahead of such a loop (measured on a 2-core Intel Xeon
//! guest, bench/results/cpu.md), every group waits for memory. Each pass therefore asks for
//! the data `AHEAD_BYTES` past the part it is about to process. A prefetch is only a hint: it
//! reads nothing the program sees, never faults, and changes no result.

use std::ops::Range;

/// How far ahead of the element being processed a stream is prefetched: a few groups, far
/// enough to cover a memory access, near enough to stay in L1/L2 until used (on the Xeon
/// guest 2-8 KiB were equally good, 512 B too near).
const AHEAD_BYTES: usize = 4096;

/// A cache line.
const LINE: usize = 64;

/// One stream of a pass (a bucket, a shard, a reference), by address: taken before the data
/// is split among parallel tasks, so that a task can prefetch past its own part. It is only
/// used to prefetch, never to read or write.
#[derive(Clone, Copy, Debug)]
pub(super) struct Stream {
    addr: usize,
    bytes: usize,
    elem_bytes: usize,
}

impl Stream {
    /// The stream over `data`.
    pub(super) fn new<T>(data: &[T]) -> Self {
        Self {
            addr: data.as_ptr() as usize,
            bytes: size_of_val(data),
            elem_bytes: size_of::<T>(),
        }
    }

    /// The stream from its element `elements` on (empty past its end).
    pub(super) fn skip(self, elements: usize) -> Self {
        let offset = (elements * self.elem_bytes).min(self.bytes);
        Self {
            addr: self.addr + offset,
            bytes: self.bytes - offset,
            ..self
        }
    }

    /// Prefetches the elements `AHEAD_BYTES` past `range` (element indices of the stream, the
    /// part about to be processed), clamped to the stream.
    #[inline]
    pub(super) fn prefetch_ahead(self, range: Range<usize>) {
        let start = (range.start * self.elem_bytes + AHEAD_BYTES).min(self.bytes);
        let end = (range.end * self.elem_bytes + AHEAD_BYTES).min(self.bytes);
        let mut line = (self.addr + start) & !(LINE - 1);
        while line < self.addr + end {
            prefetch_line(line);
            line += LINE;
        }
    }
}

/// Asks the core to bring the cache line at `addr` into L1.
#[inline(always)]
fn prefetch_line(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: PREFETCHT0 is a hint: it does not access memory as far as the program can
        // observe and does not fault on any address; `addr` lies inside a live slice.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(addr as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prefetching any range of a stream, including past its end and of an empty stream, is
    /// harmless.
    #[test]
    fn prefetch_ahead_stays_harmless_at_the_edges() {
        let data = vec![1.0f32; 5000];
        let stream = Stream::new(&data);
        for start in [0, 10, 4000, 4999, 5000, 9000] {
            stream.prefetch_ahead(start..start + 128);
        }
        Stream::new::<u8>(&[]).prefetch_ahead(0..64);
        stream.skip(4990).prefetch_ahead(0..128);
        stream.skip(9000).prefetch_ahead(0..128);
        assert!(data.iter().all(|&x| x == 1.0));
    }
}
