//! Device memory of the CUDA backend: [`DeviceBuffer`]s and where their memory comes from.
//!
//! A [`Cuda`](super::Cuda) backend allocates through an [`Allocator`]: the driver's
//! `cuMemAlloc` / `cuMemFree` in the device's primary context by default, or any
//! [`DeviceAllocator`] it is given. The torch extension gives it torch's CUDA caching
//! allocator (`src/ffi`), so the collectives' buffers come from torch's pool and count in
//! `torch.cuda.memory_allocated`.

use std::fmt::Debug;
use std::marker::PhantomData;

use cudarc::driver::result as driver;

use super::launch::DeviceSpan;
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
    /// 512), valid until the block is dropped. An allocator tied to streams (torch's) associates the block with the stream
    /// current on the calling thread.
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
        let addr = kernels.with_context(|| {
            // SAFETY: the device's primary context is current.
            unsafe { driver::malloc_sync(bytes) }.map_err(|e| {
                Error::Cuda(format!(
                    "cuMemAlloc of {bytes} bytes on device {} failed: {e}",
                    kernels.ordinal()
                ))
            })
        })?;
        Ok(Box::new(Self { kernels, addr }))
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

/// `len` elements of `T` in device memory from an [`Allocator`], returned when dropped. A
/// zero-length buffer allocates nothing (its address is 0).
#[derive(Debug)]
pub struct DeviceBuffer<T> {
    block: Option<Box<dyn DeviceBlock>>,
    len: usize,
    _element: PhantomData<fn() -> T>,
}

impl<T: Element> DeviceBuffer<T> {
    /// `len` elements on the device of `kernels`, from `allocator`.
    pub(super) fn new(kernels: &'static Kernels, allocator: Allocator, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or_else(|| Error::Buffer(format!("a device buffer of {len} elements overflows")))?;
        let block = if bytes == 0 {
            None
        } else {
            let block = allocator.allocate(kernels, bytes)?;
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
