//! The gradient all-reduce across the groups of hybrid sharding (docs/numerics.md §7.6).

use std::marker::PhantomData;

use crate::backend::cpu::Host;
use crate::backend::{Backend, Element, GradElement};
use crate::codec::int_code::IntCode;
use crate::collective::phases::{CollectiveKind, Phase, PhaseClock};
use crate::collective::{Comm, SumElement, global_k};
use crate::config::{Config, Rounding};
use crate::error::{Error, Result, check_len};
use crate::rng::{Stage, UniformStream, stream_id};

/// All-reduces one gradient buffer (fp32 or bf16) over a communicator whose `size` ranks hold
/// the same shard in different groups (Megatron's distributed-optimizer instances, FSDP2's
/// replicate dimension) with Global-QSGD: the absmax is all-reduced (MAX), every rank rounds
/// its values stochastically to integers at the global scale `absmax / K`,
/// `K = floor((2^(bits-1) - 1) / size)`, the integers are summed exactly by a reduce-scatter
/// and an all-gather of the sums, and every rank dequantizes the same sums, so every group
/// ends with the same bits. `bits` is the config's `cross_group_bits` (the exact setting is the
/// framework's own all-reduce, not this collective).
#[derive(Debug)]
pub struct CrossGroupAllReduce<B: Backend = Host> {
    seed: u64,
    bits: u8,
    size: usize,
    rank: usize,
    numel: usize,
    stream: u32,
    _backend: PhantomData<B>,
}

impl<B: Backend> CrossGroupAllReduce<B> {
    /// Plans the all-reduce of `numel` elements (a multiple of `size`) by rank `rank` of
    /// `size`, its random streams those of bucket `bucket_id` and `stream_rank` (the rank's
    /// index in the whole data-parallel world, so that no two ranks share them).
    pub fn new(
        config: &Config,
        size: usize,
        rank: usize,
        numel: usize,
        bucket_id: u32,
        stream_rank: usize,
    ) -> Result<Self> {
        let bits = config.cross_group_bits.ok_or_else(|| {
            Error::Plan(
                "cross_group_bits=exact: the groups' all-reduce is the framework's own, \
                 uncompressed"
                    .into(),
            )
        })?;
        if size == 0 || rank >= size {
            return Err(Error::Plan(format!(
                "rank {rank} of a {size}-rank cross-group communicator"
            )));
        }
        if numel == 0 || !numel.is_multiple_of(size) {
            return Err(Error::Plan(format!(
                "a cross-group all-reduce of {numel} elements over {size} groups: the buffer \
                 must be a positive multiple of the group count (pad it)"
            )));
        }
        if global_k(bits, size) == 0 {
            return Err(Error::Plan(format!(
                "cross_group_bits={bits} serves at most {} groups, there are {size}",
                (1usize << (bits - 1)) - 1
            )));
        }
        Ok(Self {
            seed: config.seed,
            bits,
            size,
            rank,
            numel,
            stream: stream_id(bucket_id, stream_rank, Stage::CrossGroup)?,
            _backend: PhantomData,
        })
    }

    /// Readies `backend`'s passes of this all-reduce (compiles them, for a backend that does),
    /// at set-up.
    pub fn prepare(&self, backend: &B) -> Result<()> {
        backend.prepare_global(self.bits, Rounding::Stochastic)
    }

    /// Elements all-reduced per call.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Bytes this rank sends per call: the reduce-scatter and the all-gather of the integers,
    /// `(size - 1) / size` of the buffer each, and the absmax word.
    pub fn wire_bytes(&self) -> usize {
        let integers = self.numel / self.size * (self.size - 1) * usize::from(self.bits / 8);
        2 * integers + 4 * (self.size - 1)
    }

    /// Bytes the framework's fp32 ring all-reduce of the buffer sends per rank.
    pub fn baseline_wire_bytes(&self) -> usize {
        2 * (self.size - 1) * self.numel / self.size * 4
    }

    /// All-reduces `data` in place over `comm` (this plan's ranks) for optimizer step `step`,
    /// with buffers from `backend`.
    pub fn run_on<C: Comm<B>, G: GradElement>(
        &self,
        backend: &B,
        comm: &C,
        data: B::Dst<'_, G>,
        step: u64,
    ) -> Result<()> {
        check_len("cross-group buffer", B::len(B::read(&data)), self.numel)?;
        if comm.rank() != self.rank || comm.size() != self.size {
            return Err(Error::Comm(format!(
                "the cross-group communicator has rank {} of {}, the all-reduce was planned \
                 for rank {} of {}",
                comm.rank(),
                comm.size(),
                self.rank,
                self.size
            )));
        }
        let rng = UniformStream::new(self.seed, step, self.stream);
        let mut clock = PhaseClock::start(CollectiveKind::CrossGroupAllReduce, None);
        let result = match self.bits {
            8 => self.run_with::<C, i8, G>(backend, comm, data, &rng, &mut clock),
            16 => self.run_with::<C, i16, G>(backend, comm, data, &rng, &mut clock),
            bits => Err(Error::Plan(format!("cross_group_bits={bits}"))),
        };
        clock.finish(1);
        result
    }

    fn run_with<C: Comm<B>, T: IntCode + Element + SumElement, G: GradElement>(
        &self,
        backend: &B,
        comm: &C,
        data: B::Dst<'_, G>,
        rng: &UniformStream,
        clock: &mut PhaseClock<'_>,
    ) -> Result<()> {
        let mut word = backend.call_buffer::<f32>(1)?;
        let mut codes = backend.call_buffer::<T>(self.numel)?;
        let mut sums = backend.call_buffer::<T>(self.numel / self.size)?;
        let k = global_k(self.bits, self.size);
        clock.time(Phase::FirstPass, || {
            backend.global_absmax(B::read(&data), B::dst(&mut word))
        })?;
        clock.time(Phase::FirstWait, || {
            comm.all_reduce_max_in_place(B::dst(&mut word))
        })?;
        clock.time(Phase::FirstPass, || {
            backend.global_quantize(
                B::read(&data),
                B::src(&word),
                k,
                Rounding::Stochastic,
                rng,
                B::dst(&mut codes),
            )
        })?;
        clock.time(Phase::SecondWait, || {
            comm.reduce_scatter_sum(B::src(&codes), B::dst(&mut sums))?;
            comm.all_gather(
                B::as_bytes(B::src(&sums)),
                B::as_bytes_mut(B::dst(&mut codes)),
            )
        })?;
        clock.time(Phase::LastPass, || {
            backend.global_dequantize(B::src(&codes), B::src(&word), k, data)
        })
    }
}
