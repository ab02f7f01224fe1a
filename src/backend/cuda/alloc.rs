//! Device memory of the CUDA backend: [`DeviceBuffer`]s and where their memory comes from.
//!
//! A [`Cuda`](super::Cuda) backend allocates through an [`Allocator`]: the driver's
//! `cuMemAlloc` / `cuMemFree` in the device's primary context by default, or any
//! [`DeviceAllocator`] it is given. The torch extension gives it torch's CUDA caching
//! allocator (`src/ffi`), so the collectives' buffers come from torch's pool and count in
//! `torch.cuda.memory_allocated`.
//!
//! A buffer is either kept (a bucket's qWD reference, its tables: `DeviceBuffer::new`) or
//! taken for one call of a collective (`DeviceBuffer::take`) and given back when dropped,
//! once the work using it is enqueued. Given back, its memory goes only to work enqueued later
//! on the stream it was taken for, or ordered after that stream's work (stream-ordered reuse):
//! a given allocator does that itself (torch's caching allocator hands a freed block only to
//! later allocations on the same stream), and memory of the driver goes to a per-device pool
//! of driver blocks (`DriverPool`) rather than to `cuMemFree`, which would free memory a
//! stream still uses.

use std::fmt::Debug;
use std::marker::PhantomData;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::result as driver;

use super::exchange::Event;
use super::launch::{DeviceSpan, Stream};
use super::module::{Kernels, driver_error};
use crate::backend::Element;
use crate::error::{Error, Result};

/// Device memory handed out by a [`DeviceAllocator`]; dropping it returns the memory.
pub trait DeviceBlock: Send + Debug {
    /// The device address of the block's first byte.
    fn addr(&self) -> u64;
}

/// A source of device memory.
pub trait DeviceAllocator: Send + Sync + Debug {
    /// `bytes` (more than 0) bytes of memory of the device `kernels` run on, aligned to 16
    /// bytes at least (the kernels' widest accesses; the driver and torch align to 256 and
    /// 512), valid until the block is dropped. The allocator associates the block with the
    /// stream current on the calling thread (torch's current stream) and reuses it in stream
    /// order: a block dropped while work enqueued on that stream still uses it goes only to
    /// work that runs after that work (torch's caching allocator gives a freed block only to
    /// later allocations on the same stream; an allocator without streams waits for the
    /// device before it frees).
    fn allocate(&self, kernels: &'static Kernels, bytes: usize) -> Result<Box<dyn DeviceBlock>>;
}

/// Where a backend's buffers come from.
#[derive(Debug, Clone, Copy)]
pub enum Allocator {
    /// `cuMemAlloc` / `cuMemFree` in the device's primary context.
    Driver,
    /// The given allocator.
    Given(&'static dyn DeviceAllocator),
}

impl Allocator {
    /// `bytes` (more than 0) bytes on the device of `kernels`, as
    /// [`DeviceAllocator::allocate`].
    pub fn allocate(self, kernels: &'static Kernels, bytes: usize) -> Result<Box<dyn DeviceBlock>> {
        match self {
            Self::Driver => DriverBlock::allocate(kernels, bytes),
            Self::Given(allocator) => allocator.allocate(kernels, bytes),
        }
    }
}

/// Memory from `cuMemAlloc`, freed with `cuMemFree`.
#[derive(Debug)]
struct DriverBlock {
    kernels: &'static Kernels,
    addr: u64,
}

impl DriverBlock {
    fn allocate(kernels: &'static Kernels, bytes: usize) -> Result<Box<dyn DeviceBlock>> {
        Ok(Box::new(Self::new(kernels, bytes)?))
    }

    fn new(kernels: &'static Kernels, bytes: usize) -> Result<Self> {
        let addr = kernels.with_context(|| {
            // SAFETY: the device's primary context is current.
            unsafe { driver::malloc_sync(bytes) }.map_err(|e| {
                Error::Cuda(format!(
                    "cuMemAlloc of {bytes} bytes on device {} failed: {e}",
                    kernels.ordinal()
                ))
            })
        })?;
        Ok(Self { kernels, addr })
    }
}

impl DeviceBlock for DriverBlock {
    fn addr(&self) -> u64 {
        self.addr
    }
}

impl Drop for DriverBlock {
    fn drop(&mut self) {
        let addr = self.addr;
        // A failure to free cannot be reported from drop; the driver only fails here when the
        // context is already gone, and then the memory went with it.
        let _ = self.kernels.with_context(|| {
            // SAFETY: `addr` came from cuMemAlloc in this context and is freed once.
            unsafe { driver::free_sync(addr) }.map_err(driver_error("cuMemFree"))
        });
    }
}

/// Driver memory given back by the calls that took it ([`DeviceBuffer::take`] with
/// [`Allocator::Driver`]), kept for later calls on the same stream (never freed, as torch's
/// caching allocator keeps its blocks; a stream's blocks are reused only by that stream, so
/// that no stream comes to wait for another's work, which across ranks could deadlock their
/// collectives). Each block carries an event recorded on its stream when it was given back,
/// after the work using it; the call that takes it again makes the stream wait for that event
/// first, which costs nothing on the same stream and orders the work all the same should the
/// handle belong to a new stream by then. The host never waits.
#[derive(Debug, Default)]
struct DriverPool {
    free: Mutex<Vec<ReleasedBlock>>,
}

/// A block of the [`DriverPool`], free for work on `stream` ordered after `released`.
#[derive(Debug)]
struct ReleasedBlock {
    block: DriverBlock,
    bytes: usize,
    stream: Stream,
    released: Event,
}

impl DriverPool {
    /// The pool of every device's driver memory.
    fn get() -> &'static DriverPool {
        static POOL: OnceLock<DriverPool> = OnceLock::new();
        POOL.get_or_init(DriverPool::default)
    }

    /// `bytes` bytes of `kernels`' device for work enqueued on `stream` from now on: a block
    /// of exactly that size given back on `stream` (`stream` made to wait for its event),
    /// else a new one.
    fn take(&self, kernels: &'static Kernels, stream: Stream, bytes: usize) -> Result<PooledBlock> {
        let reused = {
            let mut free = self
                .free
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            free.iter()
                .position(|r| {
                    r.bytes == bytes && r.stream == stream && std::ptr::eq(r.block.kernels, kernels)
                })
                .map(|at| free.swap_remove(at))
        };
        let block = match reused {
            Some(released) => {
                if let Err(e) = released.released.wait_on(stream) {
                    // Not ordered after its earlier users: back to the pool, untouched.
                    self.put(released);
                    return Err(e);
                }
                released.block
            }
            None => DriverBlock::new(kernels, bytes)?,
        };
        Ok(PooledBlock {
            block: Some(block),
            bytes,
            stream,
        })
    }

    fn put(&self, released: ReleasedBlock) {
        self.free
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(released);
    }
}

/// A block of the [`DriverPool`] taken for work on `stream`; dropped, it goes back to the
/// pool with an event recorded on `stream`.
#[derive(Debug)]
struct PooledBlock {
    block: Option<DriverBlock>,
    bytes: usize,
    stream: Stream,
}

impl DeviceBlock for PooledBlock {
    fn addr(&self) -> u64 {
        self.block.as_ref().map_or(0, |b| b.addr)
    }
}

impl Drop for PooledBlock {
    fn drop(&mut self) {
        let Some(block) = self.block.take() else {
            return;
        };
        match Event::record(block.kernels, self.stream) {
            Ok(released) => DriverPool::get().put(ReleasedBlock {
                block,
                bytes: self.bytes,
                stream: self.stream,
                released,
            }),
            Err(_) => {
                // Without an event nothing can order a later user after this one: wait for
                // the stream (a failure here means the context is gone, and the memory with
                // it), then free.
                let stream = self.stream.raw();
                let _ = block.kernels.with_context(|| {
                    // SAFETY: a live stream of this context (the Stream contract).
                    unsafe { driver::stream::synchronize(stream) }
                        .map_err(driver_error("cuStreamSynchronize"))
                });
                drop(block);
            }
        }
    }
}

/// `len` elements of `T` in device memory from an [`Allocator`], returned when dropped. A
/// zero-length buffer allocates nothing (its address is 0).
#[derive(Debug)]
pub struct DeviceBuffer<T> {
    block: Option<Box<dyn DeviceBlock>>,
    len: usize,
    _element: PhantomData<fn() -> T>,
}

impl<T: Element> DeviceBuffer<T> {
    /// `len` elements on the device of `kernels`, from `allocator`, kept until dropped (the
    /// driver's memory is freed then, so nothing enqueued may still use it).
    pub(super) fn new(kernels: &'static Kernels, allocator: Allocator, len: usize) -> Result<Self> {
        Self::from_block(len, |bytes| allocator.allocate(kernels, bytes))
    }

    /// `len` elements on the device of `kernels` for the work enqueued on `stream` from now
    /// on, from `allocator` (with `stream` current), or for [`Allocator::Driver`] from the
    /// pool of given back driver memory. Dropped once that work is enqueued, the memory goes
    /// back in stream order (module doc): the work still runs on it, and later work gets it
    /// only after.
    pub(super) fn take(
        kernels: &'static Kernels,
        allocator: Allocator,
        stream: Stream,
        len: usize,
    ) -> Result<Self> {
        Self::from_block(len, |bytes| match allocator {
            Allocator::Driver => Ok(Box::new(DriverPool::get().take(kernels, stream, bytes)?)),
            Allocator::Given(allocator) => allocator.allocate(kernels, bytes),
        })
    }

    /// `len` elements in the block `allocate` gives for their byte count (none when 0).
    fn from_block(
        len: usize,
        allocate: impl FnOnce(usize) -> Result<Box<dyn DeviceBlock>>,
    ) -> Result<Self> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or_else(|| Error::Buffer(format!("a device buffer of {len} elements overflows")))?;
        let block = if bytes == 0 {
            None
        } else {
            let block = allocate(bytes)?;
            if block.addr() % 16 != 0 {
                return Err(Error::Cuda(format!(
                    "the device allocator returned address {:#x}, not 16-byte aligned",
                    block.addr()
                )));
            }
            Some(block)
        };
        Ok(Self {
            block,
            len,
            _element: PhantomData,
        })
    }

    /// The device address (0 for an empty buffer).
    pub(super) fn addr(&self) -> u64 {
        self.block.as_ref().map_or(0, |block| block.addr())
    }

    /// The whole buffer.
    pub(super) fn span(&self) -> DeviceSpan<T> {
        // SAFETY: the block holds `len` elements of device memory owned by this buffer, which
        // outlives the borrow the span is handed out under.
        unsafe { DeviceSpan::from_raw(self.addr(), self.len) }
    }
}
