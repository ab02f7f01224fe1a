//! Torch's CUDA caching allocator as the CUDA backend's [`DeviceAllocator`]: the extension's
//! CUDA buckets take their buffers from torch's pool (so they count in
//! `torch.cuda.memory_allocated`), allocated with the bucket's side stream current. What a
//! bucket keeps is reused by torch after the bucket is gone; the exchange buffers of a call go
//! back to the pool once the call is enqueued, and torch gives them only to later allocations
//! on the side stream (the next bucket's call), which run after the call's work: c10d's
//! exchanges on its own stream are waited for on the side stream before the buffers go back.

use cxx::UniquePtr;

use super::bridge::{TorchDeviceMemory, allocate_torch_device_memory};
use crate::backend::cuda::{DeviceAllocator, DeviceBlock, Kernels};
use crate::error::{Error, Result};

/// Torch's CUDA caching allocator.
#[derive(Debug)]
pub(super) struct TorchCachingAllocator;

// SAFETY: the block is a c10::DataPtr of torch's caching allocator, which may be freed from any
// thread.
unsafe impl Send for TorchDeviceMemory {}

/// A block of torch's caching allocator.
struct TorchBlock(UniquePtr<TorchDeviceMemory>);

impl std::fmt::Debug for TorchBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TorchBlock({:#x})", self.addr())
    }
}

impl DeviceBlock for TorchBlock {
    fn addr(&self) -> u64 {
        self.0.as_ref().map_or(0, TorchDeviceMemory::addr)
    }
}

impl DeviceAllocator for TorchCachingAllocator {
    fn allocate(&self, kernels: &'static Kernels, bytes: usize) -> Result<Box<dyn DeviceBlock>> {
        let memory = allocate_torch_device_memory(kernels.ordinal(), bytes).map_err(|e| {
            Error::Cuda(format!(
                "torch's CUDA allocator could not give {bytes} bytes on device {}: {}",
                kernels.ordinal(),
                e.what()
            ))
        })?;
        if memory.is_null() {
            return Err(Error::Cuda(format!(
                "torch's CUDA allocator returned no block for {bytes} bytes"
            )));
        }
        Ok(Box::new(TorchBlock(memory)))
    }
}
