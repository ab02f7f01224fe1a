//! `Comm<Cuda>` over the emulated driver: every exchange is an operation on the rank's stream
//! (`sdp4bit_emu_comm_enqueue`), met by the same call of the other ranks on their streams and
//! matched by call order, as NCCL's collectives are; `all_reduce_max_in_place` too (a MAX
//! all-reduce of a device word). `all_reduce_max` exchanges a host value and goes through an
//! in-process host communicator.
//!
//! [`EmulatedCluster`] runs one closure per rank ([`run_ranks`]: its own thread, device
//! `r % devices`, a stream, the `Cuda` backend on it) with the world / intra-node / inter-node
//! communicators of the topology.

use std::ffi::c_void;

use sdp4bit::backend::cuda::{Cuda, DeviceSpan, SideStream, Stream};
use sdp4bit::collective::local::{LocalCluster, LocalComm};
use sdp4bit::collective::{Comm, InFlight, SumElement};
use sdp4bit::layout::{Level, Topology};
use sdp4bit::{Error, Result};
use sdp4bit_test_support::cuda_cluster::{self, CommSite, DeviceCluster, run_ranks};

use super::library::emulation;

/// One communicator of the emulation, shared by its ranks.
#[derive(Clone, Copy)]
struct Handle(*mut c_void);

// SAFETY: the communicator is an object of the emulation that its entry points lock.
unsafe impl Send for Handle {}
// SAFETY: as for Send.
unsafe impl Sync for Handle {}

/// One rank's handle on an emulated communicator.
pub struct EmulatedComm {
    comm: Handle,
    /// The rank's compute stream, where the passes and the blocking exchanges run.
    stream: *mut c_void,
    /// Where the exchanges `start_all_to_all` starts run, ordered by events.
    side: SideStream,
    /// Whether waiting for a started exchange orders the compute stream after it (false only
    /// to show that the emulation catches the race).
    order_completion: bool,
    /// The same ranks on the host (rank and size), for `all_reduce_max`.
    host: LocalComm,
}

/// The collective kinds and element types of collectives.cpp.
const ALL_GATHER: i32 = 0;
const ALL_TO_ALL: i32 = 1;
const REDUCE_SCATTER_SUM: i32 = 2;
const ALL_REDUCE_MAX: i32 = 3;
/// The element type of float collectives.
const F32: i32 = 0;

impl EmulatedComm {
    fn enqueue(&self, kind: i32, dtype: i32, send: (u64, usize), recv: (u64, usize)) -> Result<()> {
        self.enqueue_on(self.stream, kind, dtype, send, recv)
    }

    fn enqueue_on(
        &self,
        stream: *mut c_void,
        kind: i32,
        dtype: i32,
        send: (u64, usize),
        recv: (u64, usize),
    ) -> Result<()> {
        // SAFETY: the handle comes from comm_create; the stream is this rank's live stream and
        // its context is current on this thread; the driver checks the buffers.
        let code = unsafe {
            emulation().comm_enqueue(
                self.comm.0,
                self.host.rank(),
                kind,
                dtype,
                send,
                recv,
                stream,
            )
        };
        if code != 0 {
            return Err(Error::Comm(format!(
                "emulated collective {kind} on rank {} of {}: CUresult {code}",
                self.host.rank(),
                self.host.size()
            )));
        }
        Ok(())
    }
}

fn bytes<T>(span: DeviceSpan<T>) -> (u64, usize) {
    (span.addr(), span.len() * size_of::<T>())
}

impl Comm<Cuda> for EmulatedComm {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn size(&self) -> usize {
        self.host.size()
    }

    fn all_gather(&self, send: DeviceSpan<u8>, recv: DeviceSpan<u8>) -> Result<()> {
        self.enqueue(ALL_GATHER, 0, bytes(send), bytes(recv))
    }

    fn all_to_all(&self, send: DeviceSpan<u8>, recv: DeviceSpan<u8>) -> Result<()> {
        self.enqueue(ALL_TO_ALL, 0, bytes(send), bytes(recv))
    }

    /// On the side stream, ordered after the compute stream's work by an event; waiting
    /// orders the compute stream after it (`SideStream`), so the next chunk's passes run
    /// meanwhile.
    fn start_all_to_all<'a>(
        &'a self,
        send: DeviceSpan<u8>,
        recv: DeviceSpan<u8>,
    ) -> Result<InFlight<'a>> {
        // SAFETY: the rank's live compute stream, of the context the side stream belongs to.
        let main = unsafe { Stream::from_raw(self.stream as usize) };
        let exchange = self.side.start(main, |side| {
            self.enqueue_on(
                side.handle() as *mut c_void,
                ALL_TO_ALL,
                0,
                bytes(send),
                bytes(recv),
            )
        })?;
        if !self.order_completion {
            return Ok(InFlight::completed());
        }
        Ok(InFlight::new(exchange))
    }

    fn all_reduce_max(&self, value: f32) -> Result<f32> {
        self.host.all_reduce_max(value)
    }

    fn all_reduce_max_in_place(&self, word: DeviceSpan<f32>) -> Result<()> {
        if word.len() != 1 {
            return Err(Error::Comm(format!(
                "all_reduce_max word of {} elements, not 1",
                word.len()
            )));
        }
        self.enqueue(ALL_REDUCE_MAX, F32, bytes(word), bytes(word))
    }

    fn reduce_scatter_sum<T: SumElement>(
        &self,
        send: DeviceSpan<T>,
        recv: DeviceSpan<T>,
    ) -> Result<()> {
        let dtype = match T::DTYPE {
            "float32" => F32,
            "int8" => 1,
            "int16" => 2,
            other => return Err(Error::Comm(format!("no emulated sum of {other}"))),
        };
        self.enqueue(REDUCE_SCATTER_SUM, dtype, bytes(send), bytes(recv))
    }
}

/// What a rank's closure gets, with the emulated communicators.
pub type Rank<'a> = cuda_cluster::Rank<'a, EmulatedComm>;

/// The communicators of a topology, as [`LocalCluster`] builds them, in the emulation.
pub struct EmulatedCluster {
    order_completion: bool,
    world: Handle,
    intra: Vec<Handle>,
    inter: Vec<Handle>,
    host: LocalCluster,
}

/// Devices the ranks are spread over.
pub fn device_count() -> usize {
    sdp4bit::backend::cuda::device_count().expect("the emulated driver counts its devices")
}

impl EmulatedCluster {
    pub fn new(topology: &Topology) -> Self {
        let e = emulation();
        let (intra, inter) = match topology.per_node() {
            Some(d) => (
                (0..topology.nodes())
                    .map(|_| Handle(e.comm_create(d)))
                    .collect(),
                (0..d)
                    .map(|_| Handle(e.comm_create(topology.nodes())))
                    .collect(),
            ),
            None => (Vec::new(), Vec::new()),
        };
        Self {
            order_completion: true,
            world: Handle(e.comm_create(topology.world())),
            intra,
            inter,
            host: LocalCluster::new(topology.clone()),
        }
    }

    /// The same cluster whose started exchanges complete without ordering the compute stream
    /// after them: a broken communicator, whose races the emulation must report.
    pub fn without_exchange_waits(self) -> Self {
        Self {
            order_completion: false,
            ..self
        }
    }

    /// The emulated communicator of `site`'s group.
    fn comm(&self, site: CommSite<'_>) -> EmulatedComm {
        let t = self.host.topology();
        let comm = match site.level {
            Level::World => self.world,
            Level::Intra => self.intra[t.node_of(site.dp_rank)],
            Level::Inter => self.inter[t.local_of(site.dp_rank)],
        };
        EmulatedComm {
            comm,
            stream: site.stream.cu_stream().cast(),
            side: SideStream::new(site.backend.kernels()).expect("a side stream"),
            order_completion: self.order_completion,
            host: site.host.clone(),
        }
    }
}

impl DeviceCluster for EmulatedCluster {
    type Comm = EmulatedComm;

    fn topology(&self) -> &Topology {
        self.host.topology()
    }

    /// Rank `r` on device `r % devices`.
    fn run<R: Send>(&self, f: impl Fn(&Rank<'_>) -> R + Sync) -> Vec<R> {
        let devices = device_count();
        run_ranks(&self.host, |r| r % devices, |site| self.comm(site), f)
    }

    fn take_host_syncs(&self) -> Option<Vec<String>> {
        Some(emulation().take_host_syncs())
    }
}
