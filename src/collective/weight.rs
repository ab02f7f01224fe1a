//! The parameter all-gather of one bucket after the optimizer step (docs/numerics.md §7.3).

use half::bf16;

use crate::backend::Backend;
use crate::backend::cpu::Host;
use crate::codec::quant::QuantSpec;
use crate::codec::slab::SlabLayout;
use crate::codec::weight_encoding::WeightEncoding;
use crate::collective::phases::{CollectiveKind, Phase, PhaseClock, PhaseLog};
use crate::collective::{Comm, WireBytes};
use crate::config::{Config, WeightCodec};
use crate::error::{Error, Result};
use crate::layout::{BucketPlan, Topology};
use crate::rng::{Stage, UniformStream, stream_id};

/// All-gathers one bf16 param bucket with the configured weight codec.
///
/// Contract of [`run`](Self::run): on entry this rank's shard of `params` holds the new values
/// the optimizer wrote and the other shards hold the previous step's values (identical on
/// every replica); on exit every replica holds the same bucket, bit for bit.
///
/// qWD keeps this rank's previous shard (1/W of the bucket) as the reference of its own
/// difference; every other shard's reference is already in `params`. Since each difference
/// is taken against the reconstructed parameters, one step's quantization error is folded
/// into the next difference and never accumulates.
///
/// `B` is where the bucket lives: host memory ([`new`](WeightAllGather::new),
/// [`run`](WeightAllGather::run)) or any other [`Backend`]
/// ([`with_backend`](Self::with_backend), [`run_on`](Self::run_on)).
#[derive(Debug)]
pub struct WeightAllGather<B: Backend = Host> {
    config: Config,
    topology: Topology,
    rank: usize,
    bucket_id: u32,
    plan: BucketPlan,
    engine: Engine<B>,
    phase_log: Option<PhaseLog>,
}

/// What a bucket keeps; the send and receive buffers are taken per call
/// ([`Backend::call_buffer`]) and given back once the call's last pass is enqueued.
#[derive(Debug)]
enum Engine<B: Backend> {
    Exact,
    Quantized {
        layout: SlabLayout,
        encoding: WeightEncoding,
        /// This rank's previous shard (qWD); empty for direct encodings.
        reference: B::Buffer<bf16>,
    },
}

impl WeightAllGather<Host> {
    /// Plans bucket `bucket_id` for DP rank `rank` of `topology` in host memory. `params` is
    /// the bucket as every replica holds it now (before the first optimizer step writes new
    /// values); qWD copies this rank's shard of it as its first reference.
    pub fn new(
        config: &Config,
        topology: &Topology,
        rank: usize,
        bucket_id: u32,
        params: &[bf16],
    ) -> Result<Self> {
        Self::with_backend(&Host, config, topology, rank, bucket_id, params)
    }

    /// All-gathers `params` (the whole bucket) over `world` at optimizer step `step`.
    pub fn run<C: Comm>(&mut self, world: &C, params: &mut [bf16], step: u64) -> Result<()> {
        self.run_on(&Host, world, params, step)
    }
}

impl<B: Backend> WeightAllGather<B> {
    /// [`WeightAllGather::new`] with the buffers allocated, and the first reference copied,
    /// by `backend`.
    pub fn with_backend(
        backend: &B,
        config: &Config,
        topology: &Topology,
        rank: usize,
        bucket_id: u32,
        params: B::Src<'_, bf16>,
    ) -> Result<Self> {
        config.validate()?;
        let w = topology.world();
        if rank >= w {
            return Err(Error::Topology(format!(
                "rank {rank} outside the {w}-rank DP group"
            )));
        }
        stream_id(bucket_id, rank, Stage::Weight)?;
        let plan = BucketPlan::new(B::len(params), w, config)?;
        let engine = match QuantSpec::of_weights(&config.weight) {
            None => Engine::Exact,
            Some(spec) => {
                let layout = SlabLayout {
                    spec,
                    groups: plan.padded_shard_len / spec.group_size,
                };
                let encoding = if config.weight.codec == WeightCodec::Qwd {
                    WeightEncoding::Difference
                } else {
                    WeightEncoding::Direct
                };
                backend.prepare_weights(&layout, encoding, &plan)?;
                let mut reference = backend.alloc(match encoding {
                    WeightEncoding::Difference => plan.shard_len,
                    WeightEncoding::Direct => 0,
                })?;
                if encoding == WeightEncoding::Difference {
                    backend.copy(own_shard::<B>(&plan, rank, params), B::dst(&mut reference))?;
                }
                Engine::Quantized {
                    layout,
                    encoding,
                    reference,
                }
            }
        };
        Ok(Self {
            config: *config,
            topology: topology.clone(),
            rank,
            bucket_id,
            plan,
            engine,
            phase_log: PhaseLog::from_env(CollectiveKind::AllGather, bucket_id, rank),
        })
    }

    /// Shard sizes and padding of this bucket.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// Bytes this rank sends per call.
    pub fn wire_bytes(&self) -> WireBytes {
        let per_peer = match &self.engine {
            Engine::Exact => self.plan.shard_len * 2,
            Engine::Quantized { layout, .. } => layout.byte_len(),
        };
        if self.topology.world() == 1 {
            return WireBytes::default();
        }
        WireBytes::to_every_peer(&self.topology, self.rank, per_peer)
    }

    /// Bytes the uncompressed bf16 all-gather of this bucket sends.
    pub fn baseline_wire_bytes(&self) -> WireBytes {
        if self.topology.world() == 1 {
            return WireBytes::default();
        }
        WireBytes::to_every_peer(&self.topology, self.rank, self.plan.shard_len * 2)
    }

    /// All-gathers `params` (the whole bucket) over `world` at optimizer step `step`, running
    /// the passes with `backend` (the one the buffers were allocated with).
    pub fn run_on<C: Comm<B>>(
        &mut self,
        backend: &B,
        world: &C,
        mut params: B::Dst<'_, bf16>,
        step: u64,
    ) -> Result<()> {
        let numel = B::len(B::read(&params));
        if numel != self.plan.numel {
            return Err(Error::Buffer(format!(
                "param bucket has {numel} elements, the plan expects {}",
                self.plan.numel
            )));
        }
        if world.rank() != self.rank || world.size() != self.topology.world() {
            return Err(Error::Comm(format!(
                "communicator is rank {} of {}, this all-gather is rank {} of {}",
                world.rank(),
                world.size(),
                self.rank,
                self.topology.world()
            )));
        }
        let (plan, rank) = (self.plan, self.rank);
        let mut clock = PhaseClock::start(CollectiveKind::AllGather, self.phase_log.as_ref());
        let result = match &mut self.engine {
            Engine::Exact => {
                let mut send = backend.call_buffer(plan.shard_len)?;
                clock.time(Phase::FirstPass, || {
                    let own = own_shard::<B>(&plan, rank, B::read(&params));
                    backend.copy(own, B::dst(&mut send))
                })?;
                clock.time(Phase::FirstWait, || {
                    world.all_gather(B::as_bytes(B::src(&send)), B::as_bytes_mut(params))
                })
            }
            Engine::Quantized {
                layout,
                encoding,
                reference,
            } => {
                if plan.world > 1 {
                    let mut send = backend.call_buffer(layout.byte_len())?;
                    let mut recv = backend.call_buffer(plan.world * layout.byte_len())?;
                    let stream = stream_id(self.bucket_id, rank, Stage::Weight)?;
                    let rng = UniformStream::new(self.config.seed, step, stream);
                    let new = own_shard::<B>(&plan, rank, B::read(&params));
                    let first = plan.padded_index(rank, 0);
                    clock.time(Phase::FirstPass, || {
                        backend.weight_encode(
                            layout,
                            *encoding,
                            first,
                            new,
                            B::src(reference),
                            &rng,
                            B::dst(&mut send),
                        )
                    })?;
                    clock.time(Phase::FirstWait, || {
                        world.all_gather(B::src(&send), B::dst(&mut recv))
                    })?;
                    clock.time(Phase::LastPass, || {
                        backend.weight_apply(
                            layout,
                            *encoding,
                            &plan,
                            rank,
                            B::src(&recv),
                            B::src(reference),
                            B::reborrow(&mut params),
                        )
                    })?;
                }
                if *encoding == WeightEncoding::Difference {
                    let own = own_shard::<B>(&plan, rank, B::read(&params));
                    clock.time(Phase::LastPass, || backend.copy(own, B::dst(reference)))?;
                }
                Ok(())
            }
        };
        clock.finish(1);
        result
    }
}

fn own_shard<'a, B: Backend>(
    plan: &BucketPlan,
    rank: usize,
    params: B::Src<'a, bf16>,
) -> B::Src<'a, bf16> {
    B::sub(params, rank * plan.shard_len..(rank + 1) * plan.shard_len)
}
