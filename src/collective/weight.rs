//! The parameter all-gather of one bucket after the optimizer step (SPEC §4, §5).

use half::bf16;

use crate::backend::cpu::weight::{WeightEncoding, apply_shards, encode_shard};
use crate::codec::slab::SlabLayout;
use crate::collective::{Comm, WireBytes};
use crate::config::{Config, WeightCodec};
use crate::error::{Error, Result};
use crate::plan::{BucketPlan, Topology};
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
#[derive(Debug)]
pub struct WeightAllGather {
    config: Config,
    topology: Topology,
    rank: usize,
    bucket_id: u32,
    plan: BucketPlan,
    engine: Engine,
}

#[derive(Debug)]
enum Engine {
    Exact {
        send: Vec<bf16>,
    },
    Quantized {
        layout: SlabLayout,
        encoding: WeightEncoding,
        reference: Vec<bf16>,
        send: Vec<u8>,
        recv: Vec<u8>,
    },
}

impl WeightAllGather {
    /// Plans bucket `bucket_id` for DP rank `rank` of `topology`. `params` is the bucket as
    /// every replica holds it now (before the first optimizer step writes new values); qWD
    /// copies this rank's shard of it as its first reference.
    pub fn new(
        config: &Config,
        topology: &Topology,
        rank: usize,
        bucket_id: u32,
        params: &[bf16],
    ) -> Result<Self> {
        config.validate()?;
        let w = topology.world();
        if rank >= w {
            return Err(Error::Topology(format!(
                "rank {rank} outside the {w}-rank DP group"
            )));
        }
        stream_id(bucket_id, rank, Stage::Weight)?;
        let plan = BucketPlan::new(params.len(), w, config)?;
        let engine = match config.weight.quant_spec() {
            None => Engine::Exact {
                send: vec![bf16::ZERO; plan.shard_len],
            },
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
                let reference = match encoding {
                    WeightEncoding::Difference => own_shard(&plan, rank, params).to_vec(),
                    WeightEncoding::Direct => Vec::new(),
                };
                Engine::Quantized {
                    layout,
                    encoding,
                    reference,
                    send: vec![0; layout.byte_len()],
                    recv: vec![0; w * layout.byte_len()],
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
        })
    }

    /// Shard sizes and padding of this bucket.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// Bytes this rank sends per call.
    pub fn wire_bytes(&self) -> WireBytes {
        let per_peer = match &self.engine {
            Engine::Exact { .. } => self.plan.shard_len * 2,
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

    /// All-gathers `params` (the whole bucket) over `world` at optimizer step `step`.
    pub fn run<C: Comm>(&mut self, world: &C, params: &mut [bf16], step: u64) -> Result<()> {
        if params.len() != self.plan.numel {
            return Err(Error::Buffer(format!(
                "param bucket has {} elements, the plan expects {}",
                params.len(),
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
        match &mut self.engine {
            Engine::Exact { send } => {
                send.copy_from_slice(own_shard(&plan, rank, params));
                world.all_gather(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(params))
            }
            Engine::Quantized {
                layout,
                encoding,
                reference,
                send,
                recv,
            } => {
                if plan.world > 1 {
                    let stream = stream_id(self.bucket_id, rank, Stage::Weight)?;
                    let rng = UniformStream::new(self.config.seed, step, stream);
                    let new = own_shard(&plan, rank, params);
                    let first = plan.padded_index(rank, 0);
                    encode_shard(*layout, *encoding, first, new, reference, &rng, send);
                    world.all_gather(send, recv)?;
                    apply_shards(*layout, *encoding, &plan, rank, recv, reference, params)?;
                }
                if *encoding == WeightEncoding::Difference {
                    reference.copy_from_slice(own_shard(&plan, rank, params));
                }
                Ok(())
            }
        }
    }
}

fn own_shard<'a>(plan: &BucketPlan, rank: usize, params: &'a [bf16]) -> &'a [bf16] {
    &params[rank * plan.shard_len..(rank + 1) * plan.shard_len]
}
