//! The host's exchange buffers: [`HostBuffer`], and the process-wide pool that
//! [`Host::call_buffer`](super::Host) takes them from and their drop gives them back to, so
//! that the buckets that run one after another reuse the same memory instead of allocating,
//! zeroing and freeing (and, above glibc's mmap threshold, faulting in) their exchange buffers
//! on every call.
//!
//! A buffer goes back to the pool only when it is dropped, and a collective drops its call
//! buffers only after every exchange on them has completed (`Backend::call_buffer`; an
//! exchange in flight borrows its buffers, so the compiler enforces it on the host). A pooled
//! buffer is handed out with the bytes of its last use: the host passes and exchanges write
//! every element of a call buffer before anything reads it (`tests/host_buffers.rs` fills the
//! pool with a poison pattern and checks every collective's bytes against cold, zeroed
//! buffers). Buffers are matched by element type and exact length; the pool keeps at most
//! [`POOL_CAP_BYTES`] and frees what would exceed it.

use std::any::{Any, TypeId};
use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

use crate::backend::Element;

/// The most bytes the pool keeps between calls: the exchange buffers of many buckets (the
/// sdp4bit preset's reduce-scatter of a 4M-element bucket takes about 10 MiB per rank at
/// P = 1, half that with two buffers of four chunks).
pub const POOL_CAP_BYTES: usize = 256 << 20;

/// A host buffer of `T`s: a vector, given back to the pool when dropped if it came from it.
#[derive(Debug)]
pub struct HostBuffer<T: Element> {
    data: Vec<T>,
    pooled: bool,
}

impl<T: Element> HostBuffer<T> {
    /// A zeroed buffer of `len` elements of its own (freed when dropped, never pooled): what a
    /// collective keeps across calls.
    pub fn owned(len: usize) -> Self {
        Self {
            data: vec![T::zeroed(); len],
            pooled: false,
        }
    }

    /// A buffer of `len` elements from the pool (contents: its last use's, or zeros when newly
    /// allocated), given back to it when dropped.
    pub fn pooled(len: usize) -> Self {
        let data = POOL.take::<T>(len).unwrap_or_else(|| {
            count(|s| s.allocated += 1);
            vec![T::zeroed(); len]
        });
        Self { data, pooled: true }
    }
}

/// A vector as a buffer of its own (never pooled).
impl<T: Element> From<Vec<T>> for HostBuffer<T> {
    fn from(data: Vec<T>) -> Self {
        Self {
            data,
            pooled: false,
        }
    }
}

impl<T: Element> Deref for HostBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<T: Element> DerefMut for HostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
}

impl<T: Element> Drop for HostBuffer<T> {
    fn drop(&mut self) {
        if self.pooled && !self.data.is_empty() {
            POOL.give_back(std::mem::take(&mut self.data));
        }
    }
}

/// Counts of the pool since the process started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Call buffers newly allocated (zeroed) because none of their type and length was pooled.
    pub allocated: u64,
    /// Call buffers handed out again from the pool.
    pub reused: u64,
    /// Bytes the pool holds now.
    pub pooled_bytes: usize,
}

/// The pool's counts now.
pub fn stats() -> PoolStats {
    let state = POOL.state.lock().unwrap_or_else(|e| e.into_inner());
    PoolStats {
        pooled_bytes: state.bytes,
        ..state.stats
    }
}

/// Frees every buffer the pool holds (buffers in use go back to it when dropped).
pub fn clear() {
    let free = {
        let mut state = POOL.state.lock().unwrap_or_else(|e| e.into_inner());
        state.bytes = 0;
        std::mem::take(&mut state.free)
    };
    drop(free);
}

/// Sets every byte of every buffer the pool holds to `byte`: a poison for tests that their
/// next users write each byte before reading it.
pub fn overwrite_pooled(byte: u8) {
    let mut state = POOL.state.lock().unwrap_or_else(|e| e.into_inner());
    for buffer in state.free.values_mut().flatten() {
        buffer.bytes_mut().fill(byte);
    }
}

/// A free vector in the pool, of any element type.
trait Pooled: Send {
    /// Its bytes.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// Itself, to downcast back to its vector.
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

impl<T: Element> Pooled for Vec<T> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(self.as_mut_slice())
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

fn count(f: impl FnOnce(&mut PoolStats)) {
    f(&mut POOL.state.lock().unwrap_or_else(|e| e.into_inner()).stats);
}

/// Free vectors by element type and length, last in first out.
struct Pool {
    state: Mutex<PoolState>,
}

struct PoolState {
    free: BTreeMap<(TypeId, usize), Vec<Box<dyn Pooled>>>,
    bytes: usize,
    stats: PoolStats,
}

static POOL: Pool = Pool {
    state: Mutex::new(PoolState {
        free: BTreeMap::new(),
        bytes: 0,
        stats: PoolStats {
            allocated: 0,
            reused: 0,
            pooled_bytes: 0,
        },
    }),
};

impl Pool {
    fn take<T: Element>(&self, len: usize) -> Option<Vec<T>> {
        if len == 0 {
            return Some(Vec::new());
        }
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let boxed = state.free.get_mut(&(TypeId::of::<T>(), len))?.pop()?;
        state.bytes -= len * size_of::<T>();
        state.stats.reused += 1;
        boxed.into_any().downcast::<Vec<T>>().ok().map(|v| *v)
    }

    fn give_back<T: Element>(&self, data: Vec<T>) {
        let bytes = std::mem::size_of_val(data.as_slice());
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.bytes + bytes > POOL_CAP_BYTES {
            drop(state);
            return; // `data` is freed here, outside the lock.
        }
        state.bytes += bytes;
        state
            .free
            .entry((TypeId::of::<T>(), data.len()))
            .or_default()
            .push(Box::new(data));
    }
}
