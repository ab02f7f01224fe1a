//! Exchanges on a side stream, so that a device communicator can run pipeline chunk `p`'s
//! exchange while chunk `p + 1`'s passes run on the compute stream (docs/cuda.md).
//!
//! [`SideStream::start`] records an event on the compute stream, makes the side stream wait
//! for it (so the exchange reads what the passes enqueued before it wrote), lets the caller
//! enqueue the exchange on the side stream and records a second event after it;
//! [`DeviceExchange::complete`] makes the compute stream wait for that event, so the passes
//! enqueued after it read what the exchange wrote. Neither call blocks the host.

use cudarc::driver::result as driver;
use cudarc::driver::sys;

use super::launch::Stream;
use super::module::{Kernels, driver_error};
use crate::error::Result;

/// A non-blocking stream of one device's primary context for a communicator's exchanges,
/// destroyed when dropped (the driver finishes the work queued on it first).
#[derive(Debug)]
pub struct SideStream {
    kernels: &'static Kernels,
    raw: sys::CUstream,
}

// SAFETY: a stream handle may be used from any thread whose current context is its own.
unsafe impl Send for SideStream {}
// SAFETY: as for Send; the driver serialises the calls on one stream.
unsafe impl Sync for SideStream {}

impl SideStream {
    /// A new stream on `kernels`' device.
    pub fn new(kernels: &'static Kernels) -> Result<Self> {
        let raw = kernels.with_context(|| {
            driver::stream::create(driver::stream::StreamKind::NonBlocking)
                .map_err(driver_error("cuStreamCreate"))
        })?;
        Ok(Self { kernels, raw })
    }

    /// The stream, to enqueue on.
    pub fn stream(&self) -> Stream {
        // SAFETY: a live stream of the device's primary context, alive while `self` is.
        unsafe { Stream::from_raw(self.raw as usize) }
    }

    /// Starts an exchange: orders this side stream after the work enqueued on `main` so far,
    /// calls `issue` with the side stream (it enqueues the exchange there) and returns the
    /// exchange, whose [`complete`](DeviceExchange::complete) orders `main` after it.
    pub fn start(
        &self,
        main: Stream,
        issue: impl FnOnce(Stream) -> Result<()>,
    ) -> Result<DeviceExchange> {
        let ready = Event::record(self.kernels, main)?;
        ready.wait_on(self.stream())?;
        issue(self.stream())?;
        Ok(DeviceExchange {
            main,
            done: Event::record(self.kernels, self.stream())?,
        })
    }
}

impl Drop for SideStream {
    fn drop(&mut self) {
        let raw = self.raw;
        // A failure to destroy cannot be reported from drop; the driver only fails here when
        // the context is already gone, and the stream with it.
        let _ = self.kernels.with_context(|| {
            // SAFETY: the stream was created by `new` and is destroyed once; queued work
            // still completes.
            unsafe { driver::stream::destroy(raw) }.map_err(driver_error("cuStreamDestroy"))
        });
    }
}

/// A new non-blocking stream of `kernels`' device at the device's greatest priority, never
/// destroyed: the torch extension's side stream of a collective kind (docs/cuda.md). It is
/// sdp4bit's alone, unlike the streams of torch's pools, which hand the same streams out
/// round-robin to every caller (ProcessGroupNCCL and FSDP2 among them), so no other work
/// queues on it; at the greatest priority, as FSDP2 makes its collective streams, its kernels
/// around an exchange are not held back by the compute kernels they overlap. It is never
/// destroyed because torch's caching allocator keeps memory per stream handle, and a handle
/// the driver gave to a later stream would be taken for this one.
pub fn new_priority_stream(kernels: &'static Kernels) -> Result<Stream> {
    kernels.with_context(|| {
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: the device's primary context is current; both are written by the call.
        unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) }
            .result()
            .map_err(driver_error("cuCtxGetStreamPriorityRange"))?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: as above; `raw` receives the new stream.
        unsafe { sys::cuStreamCreateWithPriority(&mut raw, flags, greatest) }
            .result()
            .map_err(driver_error("cuStreamCreateWithPriority"))?;
        // SAFETY: a live stream of the device's primary context, never destroyed.
        Ok(unsafe { Stream::from_raw(raw as usize) })
    })
}

/// An exchange enqueued on a [`SideStream`]: `done` fires once it has run.
#[derive(Debug)]
pub struct DeviceExchange {
    main: Stream,
    done: Event,
}

impl DeviceExchange {
    /// Orders the compute stream after the exchange (its receive buffer then holds the
    /// result for every pass enqueued later), without waiting on the host. An error of the
    /// exchange itself surfaces on the stream, where the caller's next synchronisation sees it.
    /// When the stream cannot be made to wait, the host waits for the exchange before the
    /// error is returned, so that its buffers are free to reuse either way.
    pub fn complete(&mut self) -> Result<()> {
        self.done.wait_on(self.main).inspect_err(|_| {
            // The error to report is the wait's; a failing host wait means the context is
            // gone, and the buffers with it.
            let _ = self.done.synchronize();
        })
    }
}

/// A recorded event (timing disabled), destroyed when dropped.
#[derive(Debug)]
pub(super) struct Event {
    kernels: &'static Kernels,
    raw: sys::CUevent,
}

// SAFETY: an event handle may be used from any thread whose current context is its own.
unsafe impl Send for Event {}

impl Event {
    /// An event recorded on `stream` now: it fires once the work enqueued there so far has run.
    pub(super) fn record(kernels: &'static Kernels, stream: Stream) -> Result<Self> {
        kernels.with_context(|| {
            let raw = driver::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(driver_error("cuEventCreate"))?;
            let event = Self { kernels, raw };
            // SAFETY: a live event and a live stream of the current context.
            unsafe { driver::event::record(raw, stream.raw()) }
                .map_err(driver_error("cuEventRecord"))?;
            Ok(event)
        })
    }

    /// Whether the device has run the work the event follows; never blocks. An error of that
    /// work is returned as the error.
    pub(super) fn query(&self) -> Result<bool> {
        self.kernels.with_context(|| {
            // SAFETY: a live event of the current context.
            match unsafe { driver::event::query(self.raw) } {
                Ok(()) => Ok(true),
                Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
                Err(e) => Err(driver_error("cuEventQuery")(e)),
            }
        })
    }

    /// Blocks the host until the device has run the work the event follows.
    pub(super) fn synchronize(&self) -> Result<()> {
        self.kernels.with_context(|| {
            // SAFETY: a live event of the current context.
            unsafe { driver::event::synchronize(self.raw) }
                .map_err(driver_error("cuEventSynchronize"))
        })
    }

    /// Makes the work enqueued on `stream` after this call wait for the event.
    pub(super) fn wait_on(&self, stream: Stream) -> Result<()> {
        self.kernels.with_context(|| {
            // SAFETY: a live event and a live stream of the current context.
            unsafe {
                driver::stream::wait_event(
                    stream.raw(),
                    self.raw,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(driver_error("cuStreamWaitEvent"))
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let raw = self.raw;
        // As for SideStream: the driver releases a destroyed event once the work waiting for
        // it no longer needs it.
        let _ = self.kernels.with_context(|| {
            // SAFETY: the event was created by `record` and is destroyed once.
            unsafe { driver::event::destroy(raw) }.map_err(driver_error("cuEventDestroy"))
        });
    }
}
