//! The collective algorithms of docs/numerics.md §7, each written once over the [`Comm`] and
//! [`Backend`] traits (host memory by default, CUDA device memory in the extension).
//!
//! - [`GradReduceScatter`]: the gradient reduce-scatter of one bucket (baseline, the grouped
//!   codecs' one- and two-level all-to-all paths, Global-QSGD's integer reduce-scatter);
//! - [`WeightAllGather`]: the parameter all-gather of one bucket (baseline, qWD and the direct
//!   weight codecs);
//! - [`CrossGroupAllReduce`]: Global-QSGD's all-reduce of a shard across the groups of hybrid
//!   sharding;
//! - [`check_ranks_agree`]: the set-up check that all ranks use the same config and bucket;
//! - [`local`]: an in-process [`Comm`] running W ranks as threads, for tests and benchmarks.
//!
//! Each per-bucket object keeps only what must outlive a call (qWD's reference shard, the
//! backend's tables of a bucket, Global-QSGD's overflow status); the exchange buffers are taken
//! from the backend at the start of every call ([`Backend::call_buffer`]) and given back once
//! the call's last pass is enqueued and every exchange on them has completed, so the buckets
//! that run one after another reuse the same memory (docs/cuda.md, "Device memory").

mod agreement;
mod cross_group;
mod gradient;
mod in_flight;
pub mod local;
mod phases;
mod weight;
mod wire;

pub use agreement::{check_ranks_agree, check_setup_agrees};
pub use cross_group::CrossGroupAllReduce;
pub use gradient::{BucketElement, GradReduceScatter, global_bits, global_k};
pub use in_flight::{InFlight, PendingExchange};
pub use phases::{PHASE_LOG_ENV, ProfilerRanges, set_profiler_ranges};
pub use weight::WeightAllGather;
pub use wire::WireBytes;

// Defined beside the codecs, below the backends, which need it too.
pub use crate::codec::sum::SumElement;

use crate::backend::Backend;
use crate::backend::cpu::Host;
use crate::error::{Error, Result};
use crate::layout::{Level, Topology};

/// Sums `blocks` (one per rank, each `recv.len()` little-endian `T`s, in rank order) into
/// `recv`, left to right: `((b0 + b1) + b2) + ...`. Every [`Comm`] sums in this order, so a
/// reduce-scatter gives the same bits in-process, over gloo and over NCCL. Integer overflow
/// is an error naming the element (`first_index` is the global index of `recv[0]`).
pub fn sum_in_rank_order<'a, T: SumElement>(
    blocks: impl IntoIterator<Item = &'a [u8]>,
    recv: &mut [T],
    first_index: usize,
) -> Result<()> {
    let len = recv.len();
    for (rank, block) in blocks.into_iter().enumerate() {
        if block.len() != std::mem::size_of_val(recv) {
            return Err(Error::Comm(format!(
                "reduce_scatter ({}): rank {rank} sent {} bytes for a {len}-element block",
                T::DTYPE,
                block.len()
            )));
        }
        let part: Vec<T> = bytemuck::pod_collect_to_vec(block);
        if rank == 0 {
            recv.copy_from_slice(&part);
            continue;
        }
        for (i, (acc, v)) in recv.iter_mut().zip(part).enumerate() {
            *acc =
                T::checked_sum(*acc, v).ok_or_else(|| sum_overflow::<T>(first_index + i, len))?;
        }
    }
    Ok(())
}

/// The error of a sum of `T`s (a `len`-element block) that overflows at global element
/// `element`, whether the host or a device found it.
pub(crate) fn sum_overflow<T: SumElement>(element: usize, len: usize) -> Error {
    Error::Comm(format!(
        "reduce_scatter ({}): sum overflows at element {element} of {len}",
        T::DTYPE
    ))
}

/// A communicator of `size()` ranks exchanging buffers of backend `B` (host memory unless
/// said otherwise). All calls are collective: every rank of the group makes the same sequence
/// of calls with the same buffer sizes. Implementations: [`local::LocalComm`] here,
/// torch.distributed process groups (host and CUDA buffers) in the extension.
pub trait Comm<B: Backend = Host> {
    /// This rank's index in the communicator.
    fn rank(&self) -> usize;
    /// Ranks in the communicator.
    fn size(&self) -> usize;
    /// Gathers every rank's `send` into `recv` (`size() * send.len()` bytes) in rank order.
    fn all_gather(&self, send: B::Src<'_, u8>, recv: B::Dst<'_, u8>) -> Result<()>;
    /// Equal-split all-to-all: block `j` of `send` goes to rank `j`; block `i` of `recv` comes
    /// from rank `i`.
    fn all_to_all(&self, send: B::Src<'_, u8>, recv: B::Dst<'_, u8>) -> Result<()>;
    /// Starts [`all_to_all`](Self::all_to_all) and returns while it may still run, so the
    /// caller can compute meanwhile; [`InFlight::wait`] completes it. The buffers stay
    /// borrowed until then. Callers keep at most one exchange of a communicator in flight
    /// and make no other call on it before waiting (an implementation may reject both);
    /// exchanges of different communicators may be in flight together.
    ///
    /// The default runs the exchange before returning: correct for every communicator,
    /// without overlap. Host communicators over threads or sockets override it; a device
    /// communicator issues the exchange on a side stream ordered after the passes that wrote
    /// `send`, and waiting orders the compute stream after it, so the host never blocks
    /// ([`SideStream`](crate::backend::cuda::SideStream)).
    fn start_all_to_all<'a>(
        &'a self,
        send: B::Src<'a, u8>,
        recv: B::Dst<'a, u8>,
    ) -> Result<InFlight<'a>> {
        self.all_to_all(send, recv)?;
        Ok(InFlight::completed())
    }
    /// The maximum of `value` over all ranks (+Inf wins; callers map NaN to +Inf first).
    fn all_reduce_max(&self, value: f32) -> Result<f32>;
    /// Replaces the one f32 of `word` by its maximum over all ranks (+Inf wins; callers map
    /// NaN to +Inf first), as a collective on `B`'s memory: a device communicator orders it
    /// after the passes that wrote `word` and before those enqueued after the call, without
    /// waiting on the host (c10d's MAX all-reduce of a tensor over that memory).
    fn all_reduce_max_in_place(&self, word: B::Dst<'_, f32>) -> Result<()>;
    /// Sums `send` over all ranks and keeps block `rank()` in `recv`
    /// (`send.len() == size() * recv.len()`). Host communicators sum in rank order
    /// ([`sum_in_rank_order`]); integer sums are exact in any order.
    fn reduce_scatter_sum<T: SumElement>(
        &self,
        send: B::Src<'_, T>,
        recv: B::Dst<'_, T>,
    ) -> Result<()>;
}

/// The communicators one rank uses: the whole DP group and, when nodes hold equal numbers of
/// ranks, its intra-node and inter-node groups.
#[derive(Debug)]
pub struct CommGroups<'a, C> {
    /// All W ranks; rank = DP rank.
    pub world: &'a C,
    /// This node's ranks; rank = local index.
    pub intra: Option<&'a C>,
    /// The ranks with this local index; rank = node index.
    pub inter: Option<&'a C>,
}

impl<C> CommGroups<'_, C> {
    /// The communicator of `level`, checked against the topology.
    fn level<B: Backend>(&self, level: Level, topology: &Topology) -> Result<&C>
    where
        C: Comm<B>,
    {
        let me = self.world.rank();
        let (comm, name, rank, size) = match level {
            Level::World => (Some(self.world), "world", me, topology.world()),
            Level::Intra => (
                self.intra,
                "intra-node",
                topology.local_of(me),
                topology.intra_group(me).len(),
            ),
            Level::Inter => (
                self.inter,
                "inter-node",
                topology.node_of(me),
                topology.nodes(),
            ),
        };
        let comm = comm.ok_or_else(|| {
            Error::Comm(format!(
                "the {name} communicator is needed by this route but was not provided"
            ))
        })?;
        if comm.rank() != rank || comm.size() != size {
            return Err(Error::Comm(format!(
                "the {name} communicator has rank {} of {}, but the topology puts DP rank {me} \
                 at {rank} of {size}",
                comm.rank(),
                comm.size()
            )));
        }
        Ok(comm)
    }
}
