//! The `Cuda` backend on in-process ranks: one thread per rank with its device's primary context
//! current, a stream of its own and the backend on that stream, and communicators made over a
//! [`LocalCluster`]'s ([`run_ranks`]); the [`DeviceCluster`] trait the end-to-end comparisons
//! ([`crate::cuda_end_to_end`]) run on; copies between the host and a rank's device in stream
//! order; and the skip of the GPU tests on a host without a GPU ([`gpu_kernels`]).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use sdp4bit::backend::cuda::{
    Cuda, DeviceBuffer, DeviceSpan, Kernels, Stream, device_count, probe,
};
use sdp4bit::backend::{Backend, Element};
use sdp4bit::collective::local::{LocalCluster, LocalComm};
use sdp4bit::collective::{Comm, CommGroups};
use sdp4bit::layout::{Level, Topology};
use sdp4bit::{Error, Result};

use crate::host_kernels::install_emulation_builder;

/// The kernels of device 0, or `None` after printing `skipped: <reason>` when there is no CUDA
/// driver, no device or no NVRTC (a failure instead when `SDP4BIT_REQUIRE_GPU=1`). Where the
/// driver is the emulated one, it gets its builder of host kernels first.
pub fn gpu_kernels() -> Option<&'static Kernels> {
    let reason = match device_count().and_then(|n| probe::nvrtc().map(|()| n)) {
        Err(e) => e.to_string(),
        Ok(0) => "the CUDA driver sees no device".into(),
        Ok(_) => {
            install_emulation_builder();
            return Some(Kernels::get(0).expect("the device is probed on device 0"));
        }
    };
    let required = std::env::var("SDP4BIT_REQUIRE_GPU").is_ok_and(|v| v == "1");
    assert!(!required, "SDP4BIT_REQUIRE_GPU=1 but {reason}");
    println!("skipped: {reason}");
    None
}

/// What a rank's closure gets: its backend and stream, and its communicators.
pub struct Rank<'a, C> {
    pub backend: Cuda,
    pub stream: Arc<CudaStream>,
    pub comms: CommGroups<'a, C>,
}

/// What one communicator of a rank is made from.
pub struct CommSite<'a> {
    /// The group it serves.
    pub level: Level,
    /// The rank's host communicator of that group (its rank and size).
    pub host: &'a LocalComm,
    /// The rank in the whole DP group.
    pub dp_rank: usize,
    /// The rank's backend, whose passes run on `stream`.
    pub backend: Cuda,
    pub stream: &'a Arc<CudaStream>,
}

/// Runs `f` on every rank of `host` concurrently and returns the results in rank order. Rank
/// `r` runs on its own thread with the primary context of device `device(r)` current, a new
/// stream of it, the `Cuda` backend on that stream and the communicators `comm` makes for each
/// of its groups.
pub fn run_ranks<C, R: Send>(
    host: &LocalCluster,
    device: impl Fn(usize) -> usize + Sync,
    comm: impl Fn(CommSite<'_>) -> C + Sync,
    f: impl Fn(&Rank<'_, C>) -> R + Sync,
) -> Vec<R> {
    host.run(|groups| {
        let me = groups.world.rank();
        let ordinal = device(me);
        let context = CudaContext::new(ordinal).expect("the primary context");
        context.bind_to_thread().expect("bind the context");
        // cudarc's event tracking would synchronise the whole context when this rank's first
        // stream is created, waiting for the collectives of the other ranks on the same device,
        // which may wait for this rank (as a cuCtxSynchronize would with NCCL).
        // SAFETY: no CudaSlice is used here; the collectives order their own buffers.
        unsafe { context.disable_event_tracking() };
        let stream = context.new_stream().expect("a stream");
        install_emulation_builder();
        let kernels = Kernels::get(ordinal).expect("the device is probed");
        // SAFETY: a live stream of the device's primary context, alive while `stream` is.
        let backend = Cuda::new(kernels, unsafe {
            Stream::from_raw(stream.cu_stream() as usize)
        });
        let make = |level, host| {
            comm(CommSite {
                level,
                host,
                dp_rank: me,
                backend,
                stream: &stream,
            })
        };
        let world = make(Level::World, groups.world);
        let intra = groups.intra.map(|h| make(Level::Intra, h));
        let inter = groups.inter.map(|h| make(Level::Inter, h));
        f(&Rank {
            backend,
            stream: Arc::clone(&stream),
            comms: CommGroups {
                world: &world,
                intra: intra.as_ref(),
                inter: inter.as_ref(),
            },
        })
    })
}

/// In-process ranks of the `Cuda` backend over some `Comm<Cuda>`, as the end-to-end
/// comparisons run them.
pub trait DeviceCluster: Sync {
    /// A rank's communicator of one group.
    type Comm: Comm<Cuda>;
    /// The topology of the ranks.
    fn topology(&self) -> &Topology;
    /// Runs `f` on every rank concurrently ([`run_ranks`]); the results in rank order.
    fn run<R: Send>(&self, f: impl Fn(&Rank<'_, Self::Comm>) -> R + Sync) -> Vec<R>;
    /// The calling thread's host synchronisations (waits for the device) since the last call,
    /// where the cluster counts them; `None` where it does not.
    fn take_host_syncs(&self) -> Option<Vec<String>>;
}

/// The bytes of `span`.
pub fn bytes_of<T>(span: DeviceSpan<T>) -> DeviceSpan<u8> {
    // SAFETY: the same device memory, seen as bytes.
    unsafe { DeviceSpan::from_raw(span.addr(), span.len() * size_of::<T>()) }
}

/// Copies `host` into `dst` (as long) on `stream`, whose context is current, and waits for the
/// stream: ordered after the work enqueued there before, and done on return. (A synchronous
/// copy runs on the legacy default stream, which a non-blocking stream does not wait for, and
/// from pageable memory it may return before the data has landed.)
pub fn copy_to_device<T: Element>(
    stream: &CudaStream,
    host: &[T],
    dst: DeviceSpan<T>,
) -> Result<()> {
    if dst.len() != host.len() {
        return Err(Error::Buffer(format!(
            "copy of {} elements into {}",
            host.len(),
            dst.len()
        )));
    }
    if host.is_empty() {
        return Ok(());
    }
    let failed = |e: cudarc::driver::DriverError| Error::Cuda(format!("upload: {e}"));
    // SAFETY: `dst` is `host.len()` elements of T in device memory of the current context and
    // `stream` belongs to it; `host` outlives the copy, which is waited for below.
    unsafe { cudarc::driver::result::memcpy_htod_async(dst.addr(), host, stream.cu_stream()) }
        .map_err(failed)?;
    stream.synchronize().map_err(failed)
}

/// A new device buffer of the rank holding `host`.
pub fn upload<T: Element, C>(rank: &Rank<'_, C>, host: &[T]) -> DeviceBuffer<T> {
    let mut buffer = rank.backend.alloc::<T>(host.len()).expect("device buffer");
    overwrite(rank, &mut buffer, host);
    buffer
}

/// Copies `host` into `buffer` (as long) in the rank's stream order ([`copy_to_device`]).
pub fn overwrite<T: Element, C>(rank: &Rank<'_, C>, buffer: &mut DeviceBuffer<T>, host: &[T]) {
    copy_to_device(&rank.stream, host, Cuda::dst(buffer)).expect("upload");
}

/// The contents of `buffer` once the rank's stream has run the work enqueued on it.
pub fn download<T: Element, C>(rank: &Rank<'_, C>, buffer: &DeviceBuffer<T>) -> Vec<T> {
    rank.backend.download(Cuda::src(buffer)).expect("download")
}
