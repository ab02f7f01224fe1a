//! The core's [`Comm`] over the process groups the torch extension provides, for host and
//! CUDA buffers.

use std::cell::RefCell;
use std::marker::PhantomData;

use cxx::UniquePtr;

use super::bridge::{CommLevel, PendingExchange as CxxPending, SumDtype, TorchComms};
use crate::backend::cpu::Host;
use crate::backend::cuda::{Cuda, DeviceSpan};
use crate::collective::{
    Comm, CommGroups, InFlight, PendingExchange, SumElement, sum_in_rank_order,
};
use crate::error::{Error, Result, check_len};

/// One level (world, intra- or inter-node) of a [`TorchComms`] as a [`Comm`].
///
/// Reduce-scatters run as an all-to-all followed by [`sum_in_rank_order`], so the sums are
/// the same bits as the in-process collective's whatever the backend's own reduction order;
/// the bytes on the wire are those of a direct-send reduce-scatter.
pub(super) struct TorchLevel<'a> {
    comms: &'a TorchComms,
    level: CommLevel,
    rank: usize,
    size: usize,
    /// Receive buffer of the reduce-scatter's all-to-all, kept across calls.
    scratch: RefCell<Vec<u8>>,
}

impl<'a> TorchLevel<'a> {
    /// The level's communicator, if the extension created one.
    fn new(comms: &'a TorchComms, level: CommLevel) -> Option<Self> {
        comms.has_level(level).then(|| Self {
            comms,
            level,
            rank: comms.rank(level),
            size: comms.size(level),
            scratch: RefCell::default(),
        })
    }
}

/// The world, intra- and inter-node levels of `comms`.
pub(super) struct TorchLevels<'a> {
    world: TorchLevel<'a>,
    intra: Option<TorchLevel<'a>>,
    inter: Option<TorchLevel<'a>>,
}

impl<'a> TorchLevels<'a> {
    /// Wraps every level `comms` has; the world level is required.
    pub(super) fn new(comms: &'a TorchComms) -> Result<Self> {
        let world = TorchLevel::new(comms, CommLevel::World).ok_or_else(|| {
            Error::Comm("the extension provided no world process group".to_string())
        })?;
        Ok(Self {
            world,
            intra: TorchLevel::new(comms, CommLevel::Intra),
            inter: TorchLevel::new(comms, CommLevel::Inter),
        })
    }

    /// The levels as the collectives take them.
    pub(super) fn groups(&self) -> CommGroups<'_, TorchLevel<'a>> {
        CommGroups {
            world: &self.world,
            intra: self.intra.as_ref(),
            inter: self.inter.as_ref(),
        }
    }

    /// The world level.
    pub(super) fn world(&self) -> &TorchLevel<'a> {
        &self.world
    }
}

fn comm_error(what: &str, level: CommLevel, error: cxx::Exception) -> Error {
    let level = match level {
        CommLevel::Intra => "intra-node",
        CommLevel::Inter => "inter-node",
        _ => "world",
    };
    Error::Comm(format!("{what} over the {level} group: {}", error.what()))
}

/// An error unless an all-gather of `send` bytes into `recv` bytes fits `size` ranks.
fn check_gather(size: usize, send: usize, recv: usize) -> Result<()> {
    if recv == size * send {
        return Ok(());
    }
    Err(Error::Comm(format!(
        "all_gather: {recv} bytes out must be {size} x the {send} bytes in"
    )))
}

/// An error unless an all-to-all of `send` into `recv` bytes fits `size` ranks.
fn check_all_to_all(size: usize, send: usize, recv: usize) -> Result<()> {
    if send == recv && send.is_multiple_of(size) {
        return Ok(());
    }
    Err(Error::Comm(format!(
        "all_to_all: {send} bytes in and {recv} bytes out must be equal multiples of {size} ranks"
    )))
}

/// An error unless a reduce-scatter of `send` into `recv` elements fits `size` ranks.
fn check_reduce_scatter<T: SumElement>(size: usize, send: usize, recv: usize) -> Result<()> {
    if send == size * recv {
        return Ok(());
    }
    Err(Error::Comm(format!(
        "reduce_scatter ({}): {send} elements in must be {size} x the {recv} elements out",
        T::DTYPE
    )))
}

/// The bridge's name of the element type `T`.
fn sum_dtype<T: SumElement>() -> Result<SumDtype> {
    match T::DTYPE {
        "float32" => Ok(SumDtype::Float32),
        "int8" => Ok(SumDtype::Int8),
        "int16" => Ok(SumDtype::Int16),
        other => Err(Error::Comm(format!(
            "reduce_scatter: no process-group sum for {other}"
        ))),
    }
}

/// An all-to-all the process group is running on buffers borrowed for `'a` (host slices, or
/// device spans of buffers the collective keeps for at least that long).
struct TorchPending<'a> {
    pending: UniquePtr<CxxPending>,
    level: CommLevel,
    _buffers: PhantomData<&'a mut [u8]>,
}

impl TorchPending<'_> {
    /// The exchange the extension started, as an [`InFlight`].
    fn in_flight<'a>(
        pending: std::result::Result<UniquePtr<CxxPending>, cxx::Exception>,
        level: CommLevel,
    ) -> Result<InFlight<'a>> {
        let pending = pending.map_err(|e| comm_error("all_to_all", level, e))?;
        Ok(InFlight::new(TorchPending::<'a> {
            pending,
            level,
            _buffers: PhantomData,
        }))
    }
}

impl PendingExchange for TorchPending<'_> {
    fn complete(&mut self) -> Result<()> {
        let level = self.level;
        match self.pending.as_mut() {
            Some(pending) => pending
                .wait()
                .map_err(|e| comm_error("all_to_all", level, e)),
            None => Err(Error::Comm(
                "all_to_all: the extension returned no pending exchange".to_string(),
            )),
        }
    }
}

impl Comm for TorchLevel<'_> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        check_gather(self.size, send.len(), recv.len())?;
        self.comms
            .all_gather(self.level, send, recv)
            .map_err(|e| comm_error("all_gather", self.level, e))
    }

    fn all_to_all(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        check_all_to_all(self.size, send.len(), recv.len())?;
        self.comms
            .all_to_all(self.level, send, recv)
            .map_err(|e| comm_error("all_to_all", self.level, e))
    }

    /// Issues the all-to-all on the process group (gloo runs it on its own threads) and
    /// returns; waiting waits for c10d's work.
    fn start_all_to_all<'a>(&'a self, send: &'a [u8], recv: &'a mut [u8]) -> Result<InFlight<'a>> {
        check_all_to_all(self.size, send.len(), recv.len())?;
        TorchPending::in_flight(
            self.comms.start_all_to_all(self.level, send, recv),
            self.level,
        )
    }

    fn all_reduce_max(&self, value: f32) -> Result<f32> {
        self.comms
            .all_reduce_max(self.level, value)
            .map_err(|e| comm_error("all_reduce_max", self.level, e))
    }

    fn all_reduce_max_in_place(&self, word: &mut [f32]) -> Result<()> {
        check_len("all_reduce_max word", word.len(), 1)?;
        word[0] = Comm::<Host>::all_reduce_max(self, word[0])?;
        Ok(())
    }

    fn reduce_scatter_sum<T: SumElement>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        check_reduce_scatter::<T>(self.size, send.len(), recv.len())?;
        let mut scratch = self.scratch.borrow_mut();
        let send: &[u8] = bytemuck::cast_slice(send);
        scratch.resize(send.len(), 0);
        Comm::<Host>::all_to_all(self, send, &mut scratch)?;
        let block = std::mem::size_of_val(recv);
        let first = self.rank * recv.len();
        sum_in_rank_order(scratch.chunks_exact(block), recv, first)
    }
}

/// The same process groups exchanging CUDA buffers: the extension issues the c10d collective
/// with the current stream of the buffers' device (the side stream) current (NCCL directly;
/// gloo through host copies). Reduce-scatters are an all-to-all and a sum in rank order on
/// the device, so they give the host path's bits.
impl Comm<Cuda> for TorchLevel<'_> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, send: DeviceSpan<u8>, recv: DeviceSpan<u8>) -> Result<()> {
        check_gather(self.size, send.len(), recv.len())?;
        self.comms
            .all_gather_device(self.level, send.addr(), send.len(), recv.addr(), recv.len())
            .map_err(|e| comm_error("all_gather", self.level, e))
    }

    fn all_to_all(&self, send: DeviceSpan<u8>, recv: DeviceSpan<u8>) -> Result<()> {
        check_all_to_all(self.size, send.len(), recv.len())?;
        self.comms
            .all_to_all_device(self.level, send.addr(), send.len(), recv.addr(), recv.len())
            .map_err(|e| comm_error("all_to_all", self.level, e))
    }

    /// Issues the all-to-all asynchronously (c10d's async_op): over NCCL it runs on the
    /// process group's stream after the passes enqueued so far on the current stream (the
    /// one that wrote `send`), while the caller enqueues the neighbouring chunk's passes;
    /// waiting makes the current stream wait for it, without blocking the host
    /// (`cpp/stream_order.h`). The buffers are the collective's own, kept until the wait is
    /// enqueued; gloo stages through the host and blocks in the wait.
    fn start_all_to_all<'a>(
        &'a self,
        send: DeviceSpan<u8>,
        recv: DeviceSpan<u8>,
    ) -> Result<InFlight<'a>> {
        check_all_to_all(self.size, send.len(), recv.len())?;
        TorchPending::in_flight(
            self.comms.start_all_to_all_device(
                self.level,
                send.addr(),
                send.len(),
                recv.addr(),
                recv.len(),
            ),
            self.level,
        )
    }

    fn all_reduce_max(&self, value: f32) -> Result<f32> {
        Comm::<Host>::all_reduce_max(self, value)
    }

    fn all_reduce_max_in_place(&self, word: DeviceSpan<f32>) -> Result<()> {
        check_len("all_reduce_max word", word.len(), 1)?;
        self.comms
            .all_reduce_max_device(self.level, word.addr())
            .map_err(|e| comm_error("all_reduce_max", self.level, e))
    }

    fn reduce_scatter_sum<T: SumElement>(
        &self,
        send: DeviceSpan<T>,
        recv: DeviceSpan<T>,
    ) -> Result<()> {
        check_reduce_scatter::<T>(self.size, send.len(), recv.len())?;
        self.comms
            .reduce_scatter_device(
                self.level,
                sum_dtype::<T>()?,
                send.addr(),
                send.len(),
                recv.addr(),
                recv.len(),
            )
            .map_err(|e| comm_error("reduce_scatter", self.level, e))
    }
}
