//! The kernel check of a CUDA bucket before its first step: every kernel the bucket's
//! collective will launch runs once on a small synthetic bucket of the same codec, topology
//! and rank, on the device ([`Cuda`]) and on the host ([`Host`]), and the bytes each kernel
//! writes must be equal, as the CUDA backend promises (docs/numerics.md §1.4). A difference is
//! an [`Error::Cuda`] naming the kernel, the device, the driver and the first differing byte,
//! before any real gradient or weight is trusted to the device.
//!
//! The synthetic bucket's exchanges stand for peers that are copies of this rank: an
//! all-to-all delivers this rank's own block from every peer, an all-gather this rank's slab
//! W times, and Global-QSGD's integer sum is this rank's own codes (as if every peer sent
//! zeros). The data is therefore a valid input of every later kernel, on both backends alike.
//!
//! [`check_bucket_once`] runs the check once per device, collective, config, topology and
//! rank in a process; [`KERNEL_CHECK_VAR`]`=0` turns it off.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use half::bf16;

use crate::backend::cpu::Host;
use crate::backend::cpu::buffers::HostBuffer;
use crate::backend::cuda::source::Kernel;
use crate::backend::cuda::{Cuda, Kernels, Stream, format_driver_version};
use crate::backend::{Backend, Element};
use crate::codec::int_code::IntCode;
use crate::codec::quant::QuantSpec;
use crate::codec::slab::SlabLayout;
use crate::codec::sum::SumElement;
use crate::codec::weight_encoding::WeightEncoding;
use crate::collective::{global_bits, global_k};
use crate::config::{Config, GradCodec, WeightCodec};
use crate::error::{Error, Result};
use crate::layout::{BucketPlan, GradLayout, GradRoute, Topology, peer_index};
use crate::rng::{Stage, UniformStream, stream_id};

/// The variable that turns the kernel check off when set to `0`.
pub const KERNEL_CHECK_VAR: &str = "SDP4BIT_CUDA_KERNEL_CHECK";

/// The collective a bucket runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Collective {
    /// [`crate::collective::GradReduceScatter`].
    GradReduceScatter,
    /// [`crate::collective::WeightAllGather`].
    WeightAllGather,
}

/// Elements per rank of the synthetic bucket: a few groups of every codec, and not a multiple
/// of any group size, so the padded tail is exercised too.
const SYNTHETIC_SHARD: usize = 1003;

/// The optimizer step the synthetic bucket's random streams are taken at.
const SYNTHETIC_STEP: u64 = 1;

/// [`check_bucket`], once per (device, collective, config, topology, rank) in this process,
/// unless [`KERNEL_CHECK_VAR`] is `0`. A failed check is not remembered: the next set-up checks
/// again.
pub fn check_bucket_once(
    kernels: &'static Kernels,
    collective: Collective,
    config: &Config,
    topology: &Topology,
    rank: usize,
) -> Result<()> {
    if std::env::var(KERNEL_CHECK_VAR).is_ok_and(|v| v.trim() == "0") {
        return Ok(());
    }
    type Key = (usize, Collective, u64, String, usize);
    static PASSED: OnceLock<Mutex<HashSet<Key>>> = OnceLock::new();
    let key: Key = (
        kernels.ordinal(),
        collective,
        config.fingerprint(),
        format!("{topology:?}"),
        rank,
    );
    let passed = || {
        PASSED
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    };
    if passed().contains(&key) {
        return Ok(());
    }
    check_bucket(kernels, collective, config, topology, rank)?;
    passed().insert(key);
    Ok(())
}

/// Runs every kernel `collective` uses for `config`, `topology` and `rank` on a synthetic
/// bucket on `kernels`' device (on the legacy default stream, synchronised) and on the host,
/// and fails at the first kernel whose bytes differ. A bucket that launches no kernel (W = 1,
/// uncompressed codecs) passes at once.
pub fn check_bucket(
    kernels: &'static Kernels,
    collective: Collective,
    config: &Config,
    topology: &Topology,
    rank: usize,
) -> Result<()> {
    let synthetic = Synthetic::new(config, topology, rank)?;
    // SAFETY: 0 is the legacy default stream of the current context, which always exists.
    let cuda = Cuda::new(kernels, unsafe { Stream::from_raw(0) });
    let host = synthetic.passes(&Host, collective)?;
    let device = synthetic.passes(&cuda, collective)?;
    for (on_host, on_device) in host.iter().zip(&device) {
        compare(kernels, on_host, on_device)?;
    }
    if host.len() != device.len() {
        return Err(Error::Cuda(format!(
            "kernel check: the host ran {} kernels, device {} ran {}",
            host.len(),
            kernels.ordinal(),
            device.len()
        )));
    }
    Ok(())
}

/// What one kernel launch wrote.
struct Pass {
    kernel: Kernel,
    bytes: Vec<u8>,
}

/// Fails naming the first byte where `device` differs from `host`.
fn compare(kernels: &Kernels, host: &Pass, device: &Pass) -> Result<()> {
    let first = host
        .bytes
        .iter()
        .zip(&device.bytes)
        .position(|(h, d)| h != d);
    let differs = first.is_some() || host.bytes.len() != device.bytes.len();
    if host.kernel == device.kernel && !differs {
        return Ok(());
    }
    let index = first.unwrap_or(host.bytes.len().min(device.bytes.len()));
    let byte = |bytes: &[u8]| {
        bytes
            .get(index)
            .map_or("nothing".to_string(), |b| format!("{b:#04x}"))
    };
    let count = host
        .bytes
        .iter()
        .zip(&device.bytes)
        .filter(|(h, d)| h != d)
        .count();
    Err(Error::Cuda(format!(
        "kernel check failed: kernel {} on CUDA device {} ({}, driver {}) wrote {} at byte {index} \
         of its output, the host backend {} ({count} of {} bytes differ); the device's results \
         cannot be trusted ({KERNEL_CHECK_VAR}=0 skips this check)",
        device.kernel.name(),
        kernels.ordinal(),
        kernels.arch(),
        format_driver_version(kernels.driver_version()),
        byte(&device.bytes),
        byte(&host.bytes),
        host.bytes.len()
    )))
}

/// Buffers a backend can fill from, and read back to, host memory.
trait Staging: Backend {
    /// A new buffer holding `data`.
    fn stage<T: Element>(&self, data: &[T]) -> Result<Self::Buffer<T>>;
    /// The contents of `buffer` once the passes enqueued so far have run.
    fn fetch<T: Element>(&self, buffer: &Self::Buffer<T>) -> Result<Vec<T>>;
}

impl Staging for Host {
    fn stage<T: Element>(&self, data: &[T]) -> Result<HostBuffer<T>> {
        Ok(HostBuffer::from(data.to_vec()))
    }

    fn fetch<T: Element>(&self, buffer: &HostBuffer<T>) -> Result<Vec<T>> {
        Ok(buffer.to_vec())
    }
}

impl Staging for Cuda {
    fn stage<T: Element>(&self, data: &[T]) -> Result<Self::Buffer<T>> {
        let buffer = self.alloc(data.len())?;
        self.upload(data, Cuda::src(&buffer))?;
        Ok(buffer)
    }

    fn fetch<T: Element>(&self, buffer: &Self::Buffer<T>) -> Result<Vec<T>> {
        self.download(Cuda::src(buffer))
    }
}

/// The bytes of `values`.
fn bytes_of<T: Element>(values: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(values).to_vec()
}

/// The synthetic bucket of one rank and what its passes need.
struct Synthetic {
    config: Config,
    topology: Topology,
    rank: usize,
    plan: BucketPlan,
    /// The gradient bucket (and, rounded to bf16, the new params).
    values: Vec<f32>,
}

impl Synthetic {
    fn new(config: &Config, topology: &Topology, rank: usize) -> Result<Self> {
        let world = topology.world();
        if rank >= world {
            return Err(Error::Topology(format!(
                "rank {rank} outside the {world}-rank DP group"
            )));
        }
        let plan = BucketPlan::new(SYNTHETIC_SHARD * world, world, config)?;
        Ok(Self {
            config: *config,
            topology: topology.clone(),
            rank,
            plan,
            values: synthetic_values(plan.numel, 0x5e1f_c4ec ^ rank as u64),
        })
    }

    /// The random stream of `stage` at the synthetic step.
    fn rng(&self, stage: Stage) -> Result<UniformStream> {
        Ok(UniformStream::new(
            self.config.seed,
            SYNTHETIC_STEP,
            stream_id(0, self.rank, stage)?,
        ))
    }

    /// Runs the kernels of `collective` with `backend`, in the collective's order.
    fn passes<B: Staging>(&self, backend: &B, collective: Collective) -> Result<Vec<Pass>> {
        if self.plan.world == 1 {
            return Ok(Vec::new());
        }
        match collective {
            Collective::GradReduceScatter if self.config.grad.codec.is_grouped() => {
                self.grad_grouped(backend)
            }
            Collective::GradReduceScatter if self.config.grad.codec == GradCodec::GlobalQsgd => {
                match global_bits(&self.config, self.plan.world)? {
                    8 => self.global::<B, i8>(backend, 8),
                    bits => self.global::<B, i16>(backend, bits),
                }
            }
            Collective::GradReduceScatter => Ok(Vec::new()),
            Collective::WeightAllGather => self.weight(backend),
        }
    }

    /// Quantize; per chunk: (requantize,) reduce.
    fn grad_grouped<B: Staging>(&self, backend: &B) -> Result<Vec<Pass>> {
        let route = GradRoute::new(&self.config, &self.topology);
        let layout = GradLayout::new(&self.config, &self.topology, &route, self.plan)
            .ok_or_else(|| Error::Plan("a route over W > 1 ranks has no exchange".into()))?;
        let tables = backend.grad_tables(&layout)?;
        let bucket = backend.stage(&self.values)?;
        let first_slab = layout.first.slab.byte_len();
        let chunk_bytes = layout.first.peers * first_slab;
        let mut send = backend.alloc::<u8>(chunk_bytes * self.plan.chunks)?;
        backend.quantize_first(
            &layout,
            &tables,
            B::src(&bucket),
            &self.rng(Stage::GradFirst)?,
            B::dst(&mut send),
        )?;
        let sent = backend.fetch(&send)?;
        let mut passes = vec![Pass {
            kernel: Kernel::GradQuantizeFirst,
            bytes: sent.clone(),
        }];
        let my_x1 = peer_index(&self.topology, layout.first.level, self.rank);
        let mut shard = backend.stage(&vec![0f32; self.plan.shard_len])?;
        for p in 0..self.plan.chunks {
            let chunk = &sent[p * chunk_bytes..(p + 1) * chunk_bytes];
            let received = backend.stage(&mirror(chunk, my_x1, first_slab))?;
            let last = match layout.second {
                Some(second) => {
                    let second_slab = second.slab.byte_len();
                    let mut send_second = backend.alloc::<u8>(second.peers * second_slab)?;
                    backend.requantize_second(
                        &layout,
                        &tables,
                        my_x1,
                        p,
                        B::src(&received),
                        &self.rng(Stage::GradSecond)?,
                        B::dst(&mut send_second),
                    )?;
                    let sent_second = backend.fetch(&send_second)?;
                    let my_x2 = peer_index(&self.topology, second.level, self.rank);
                    let received_second =
                        backend.stage(&mirror(&sent_second, my_x2, second_slab))?;
                    passes.push(Pass {
                        kernel: Kernel::GradRequantizeSecond,
                        bytes: sent_second,
                    });
                    received_second
                }
                None => received,
            };
            backend.reduce_final(&layout, p, B::src(&last), B::dst(&mut shard))?;
            passes.push(Pass {
                kernel: Kernel::GradReduceFinal,
                bytes: bytes_of(&backend.fetch(&shard)?),
            });
        }
        Ok(passes)
    }

    /// Absmax, integer rounding, dequantization of this rank's own codes.
    fn global<B: Staging, T: IntCode + SumElement + Element>(
        &self,
        backend: &B,
        bits: u8,
    ) -> Result<Vec<Pass>> {
        let (quantize, dequantize) = if bits == 8 {
            (Kernel::GlobalQuantizeI8, Kernel::GlobalDequantizeI8)
        } else {
            (Kernel::GlobalQuantizeI16, Kernel::GlobalDequantizeI16)
        };
        let bucket = backend.stage(&self.values)?;
        let mut word = backend.alloc::<f32>(1)?;
        backend.global_absmax(B::src(&bucket), B::dst(&mut word))?;
        // The peers are copies of this rank, so the all-reduced maximum is this rank's.
        let mut passes = vec![Pass {
            kernel: Kernel::GlobalAbsmax,
            bytes: bytes_of(&backend.fetch(&word)?),
        }];
        let k = global_k(bits, self.plan.world);
        let mut codes = backend.alloc::<T>(self.plan.numel)?;
        backend.global_quantize(
            B::src(&bucket),
            B::src(&word),
            k,
            self.config.grad.rounding,
            &self.rng(Stage::GlobalQsgd)?,
            B::dst(&mut codes),
        )?;
        let codes = backend.fetch(&codes)?;
        passes.push(Pass {
            kernel: quantize,
            bytes: bytes_of(&codes),
        });
        // What the all-to-all delivers from W copies of this rank: its own shard's codes W
        // times, summed (and checked) by the dequantization as on a device.
        let shard_len = self.plan.shard_len;
        let own = &codes[self.rank * shard_len..(self.rank + 1) * shard_len];
        let blocks = backend.stage(&own.repeat(self.plan.world))?;
        let mut status = backend.alloc::<u32>(1)?;
        backend.take_sum_status(B::dst(&mut status))?;
        let mut shard = backend.alloc::<f32>(shard_len)?;
        backend.global_sum_dequantize(
            B::src(&blocks),
            self.plan.world,
            B::src(&word),
            k,
            B::dst(&mut status),
            B::dst(&mut shard),
        )?;
        passes.push(Pass {
            kernel: dequantize,
            bytes: bytes_of(&backend.fetch(&shard)?),
        });
        Ok(passes)
    }

    /// Encode this rank's shard (against a previous one for qWD), apply W copies of it.
    fn weight<B: Staging>(&self, backend: &B) -> Result<Vec<Pass>> {
        let Some(spec) = QuantSpec::of_weights(&self.config.weight) else {
            return Ok(Vec::new());
        };
        let plan = self.plan;
        let layout = SlabLayout {
            spec,
            groups: plan.padded_shard_len / spec.group_size,
        };
        let encoding = if self.config.weight.codec == WeightCodec::Qwd {
            WeightEncoding::Difference
        } else {
            WeightEncoding::Direct
        };
        let params: Vec<bf16> = self.values.iter().map(|&v| bf16::from_f32(v)).collect();
        let own = self.rank * plan.shard_len..(self.rank + 1) * plan.shard_len;
        let previous: Vec<bf16> = match encoding {
            WeightEncoding::Difference => params[own.clone()]
                .iter()
                .zip(synthetic_values(
                    plan.shard_len,
                    0x9e37_79b9 ^ self.rank as u64,
                ))
                .map(|(&p, d)| bf16::from_f32(p.to_f32() - 0.01 * d))
                .collect(),
            WeightEncoding::Direct => Vec::new(),
        };
        let mut params = backend.stage(&params)?;
        let reference = backend.stage(&previous)?;
        let mut send = backend.alloc::<u8>(layout.byte_len())?;
        backend.weight_encode(
            &layout,
            encoding,
            plan.padded_index(self.rank, 0),
            B::sub(B::src(&params), own),
            B::src(&reference),
            &self.rng(Stage::Weight)?,
            B::dst(&mut send),
        )?;
        let slab = backend.fetch(&send)?;
        let received = backend.stage(&slab.repeat(plan.world))?;
        backend.weight_apply(
            &layout,
            encoding,
            &plan,
            self.rank,
            B::src(&received),
            B::src(&reference),
            B::dst(&mut params),
        )?;
        Ok(vec![
            Pass {
                kernel: Kernel::WeightEncode,
                bytes: slab,
            },
            Pass {
                kernel: Kernel::WeightApply,
                bytes: bytes_of(&backend.fetch(&params)?),
            },
        ])
    }
}

/// What an all-to-all delivers when every peer is a copy of this rank: block `me` of `sent`
/// (blocks of `block` bytes) from each of the `sent.len() / block` peers.
fn mirror(sent: &[u8], me: usize, block: usize) -> Vec<u8> {
    sent[me * block..(me + 1) * block].repeat(sent.len() / block)
}

/// `len` gradient-like values from `seed`: magnitudes spread over six decades, with exact
/// zeros, a negative zero and one outlier per 257 elements.
fn synthetic_values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    let mut next = move || {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..len)
        .map(|i| {
            let r = next();
            let unit = (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let decade = 10f32.powi((r % 6) as i32 - 4);
            match i % 257 {
                13 => 0.0,
                31 => -0.0,
                101 => 40.0 * unit.signum(),
                _ => unit * decade,
            }
        })
        .collect()
}
