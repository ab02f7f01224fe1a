//! Reading Global-QSGD's integer-sum status word on the host without waiting for the device:
//! the word is copied on the stream into pinned host memory and cleared after the copy, an
//! event is recorded after both, and the host reads the copy only once a query of the event
//! says the device has passed it (docs/cuda.md). Nothing here blocks the host, except dropping
//! a readback whose copy is still queued.

use cudarc::driver::result as driver;
use cudarc::driver::sys;

use super::exchange::Event;
use super::launch::{DeviceSpan, Stream};
use super::module::{Kernels, driver_error};
use crate::error::{Error, Result, check_len};

/// A status word's readback into one pinned host word.
#[derive(Debug)]
pub struct StatusReadback {
    kernels: &'static Kernels,
    /// The pinned host word the copies land in.
    host: *mut u32,
    /// The event after the copy not yet read, if any.
    copied: Option<Event>,
}

// SAFETY: the pinned word is only touched through `&mut self` (and by copies the event
// orders); driver handles may be used from any thread whose current context is their own.
unsafe impl Send for StatusReadback {}

impl StatusReadback {
    /// A readback on `kernels`' device, with its pinned host word.
    pub fn new(kernels: &'static Kernels) -> Result<Self> {
        let host = kernels.with_context(|| {
            // SAFETY: the device's primary context is current; 4 bytes of pinned memory.
            unsafe { driver::malloc_host(size_of::<u32>(), 0) }
                .map_err(driver_error("cuMemHostAlloc"))
        })?;
        if host.is_null() || !(host as usize).is_multiple_of(align_of::<u32>()) {
            return Err(Error::Cuda(format!(
                "cuMemHostAlloc returned {host:?} for a 4-byte word"
            )));
        }
        Ok(Self {
            kernels,
            host: host.cast(),
            copied: None,
        })
    }

    /// Enqueues on `stream`, after the passes enqueued there so far: a copy of `status` (one
    /// u32 of the device's memory, written only by passes on `stream`) into the pinned word,
    /// then `status` set to 0, then an event. Returns `false`, enqueuing nothing, while the
    /// previous copy has not been read ([`take`](Self::take)): the status word keeps what the
    /// passes record meanwhile, and a later copy reads it.
    pub fn start(&mut self, stream: Stream, status: DeviceSpan<u32>) -> Result<bool> {
        check_len("integer sum status word", status.len(), 1)?;
        if self.copied.is_some() {
            return Ok(false);
        }
        let raw = stream.raw();
        let host = self.host;
        self.kernels.with_context(|| {
            // SAFETY: `status` is one u32 of device memory of this context and `raw` a stream
            // of it; the pinned word outlives the copy (drop waits for it), and nothing reads
            // or writes it until the event after the copy has completed.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(host.cast(), status.addr(), size_of::<u32>(), raw)
                    .result()
                    .map_err(driver_error("cuMemcpyDtoHAsync"))?;
                sys::cuMemsetD32Async(status.addr(), 0, 1, raw)
                    .result()
                    .map_err(driver_error("cuMemsetD32Async"))
            }
        })?;
        self.copied = Some(Event::record(self.kernels, stream)?);
        Ok(true)
    }

    /// The word the last [`start`](Self::start) copied, once the device has run the copy
    /// (`Some`, and the next `start` copies again); `None` while it has not, or when nothing
    /// was started. Queries an event; never blocks.
    pub fn take(&mut self) -> Result<Option<u32>> {
        let Some(copied) = &self.copied else {
            return Ok(None);
        };
        if !copied.query()? {
            return Ok(None);
        }
        self.copied = None;
        // SAFETY: the copy into the word has completed (the event after it has), and no other
        // copy is queued.
        Ok(Some(unsafe { self.host.read_volatile() }))
    }
}

impl Drop for StatusReadback {
    fn drop(&mut self) {
        // A copy still queued writes the pinned word: wait for it before freeing. Failures
        // cannot be reported from drop; the driver fails here only when the context is gone.
        if let Some(copied) = self.copied.take() {
            let _ = copied.synchronize();
        }
        let host = self.host;
        let _ = self.kernels.with_context(|| {
            // SAFETY: `host` came from cuMemHostAlloc and is freed once, no copy pending.
            unsafe { driver::free_host(host.cast()) }.map_err(driver_error("cuMemFreeHost"))
        });
    }
}
