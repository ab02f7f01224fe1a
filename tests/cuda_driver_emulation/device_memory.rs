//! Where the CUDA backend's buffers come from and how long they are held: with an allocator
//! given ([`Allocator::Given`], as the torch extension gives torch's caching allocator) every
//! buffer of both collectives comes from it, none from the driver directly; a bucket keeps only
//! what must outlive a call, and the exchange buffers of a call go back to the allocator once
//! the call is enqueued, so that the next bucket on the same stream reuses their memory (the
//! stream-ordered reuse of torch's caching allocator, modelled by [`StreamOrderedPool`]) with
//! the same bytes as the host's; and the device memory per parameter that the sdp4bit
//! preset's collectives keep per bucket, and take while a call is in flight, counted from
//! what they allocate.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use sdp4bit::backend::Backend;
use sdp4bit::backend::cuda::{
    Allocator, Cuda, DeviceAllocator, DeviceBlock, DeviceBuffer, DeviceSpan, Kernels, Stream,
};
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{BucketElement, Comm, GradReduceScatter, WeightAllGather};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset, Result};
use sdp4bit_test_support::cuda_cluster::{DeviceCluster, download, upload};
use sdp4bit_test_support::random::SplitMix64;
use sdp4bit_test_support::setups::cfg;

use super::child::{assert_child_passed, run_isolated};
use super::comm::{EmulatedCluster, Rank};
use super::library::emulation;

/// Driver memory, counted: blocks and bytes handed out and still live.
#[derive(Debug, Default)]
struct CountingAllocator {
    blocks: AtomicUsize,
    bytes: AtomicUsize,
    live_blocks: AtomicUsize,
}

/// A counted block of driver memory.
#[derive(Debug)]
struct CountedBlock {
    inner: Box<dyn DeviceBlock>,
    owner: &'static CountingAllocator,
}

impl DeviceBlock for CountedBlock {
    fn addr(&self) -> u64 {
        self.inner.addr()
    }
}

impl Drop for CountedBlock {
    fn drop(&mut self) {
        self.owner.live_blocks.fetch_sub(1, Ordering::SeqCst);
    }
}

impl DeviceAllocator for &'static CountingAllocator {
    fn allocate(&self, kernels: &'static Kernels, bytes: usize) -> Result<Box<dyn DeviceBlock>> {
        let inner = Allocator::Driver.allocate(kernels, bytes)?;
        self.blocks.fetch_add(1, Ordering::SeqCst);
        self.bytes.fetch_add(bytes, Ordering::SeqCst);
        self.live_blocks.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(CountedBlock { inner, owner: self }))
    }
}

/// A backend on device 0 of the emulation whose buffers come from a new counting allocator.
fn counted_backend() -> (Cuda, &'static CountingAllocator) {
    emulation();
    let kernels = Kernels::get(0).expect("the kernels load");
    let counter: &'static CountingAllocator = Box::leak(Box::default());
    let allocator: &'static dyn DeviceAllocator = Box::leak(Box::new(counter));
    // SAFETY: the legacy default stream; nothing is enqueued on it here but the first qWD
    // reference copy, synchronised by the driver calls that follow.
    let stream = unsafe { Stream::from_raw(0) };
    let backend = Cuda::new(kernels, stream).with_allocator(Allocator::Given(allocator));
    (backend, counter)
}

/// The two collectives of one bucket of `numel` elements for rank 0 of `topology`, planned on
/// `backend`, and the params bucket (in memory of the backend's allocator too), once the
/// backend's stream has run the first qWD reference copy.
fn plan_bucket(
    backend: &Cuda,
    config: &Config,
    topology: &Topology,
    numel: usize,
) -> (
    GradReduceScatter<Cuda>,
    WeightAllGather<Cuda>,
    DeviceBuffer<bf16>,
) {
    let grads = GradReduceScatter::with_backend(backend, config, topology, 0, numel, 3)
        .expect("plan the gradient bucket");
    let params = backend.alloc::<bf16>(numel).expect("params");
    let span: DeviceSpan<bf16> = Cuda::src(&params);
    let weights = WeightAllGather::with_backend(backend, config, topology, 0, 3, span)
        .expect("plan the weight bucket");
    backend
        .download(Cuda::src(&params))
        .expect("synchronise the stream");
    (grads, weights, params)
}

/// In a process of its own, so that the driver's counts of allocations and frees are this
/// test's alone.
#[test]
fn every_buffer_comes_from_the_given_allocator() {
    let Some(output) = run_isolated(
        "device_memory::every_buffer_comes_from_the_given_allocator",
        &[],
        || {
            let topology = Topology::uniform(2, 2).expect("two nodes of two");
            for preset in [
                Preset::Sdp4bit,
                Preset::Qsdp,
                Preset::GlobalQsgd,
                Preset::Zeropp,
            ] {
                for chunks in ["1", "3"] {
                    let config = cfg(preset, &[("pipeline_chunks", chunks)]);
                    let (backend, counter) = counted_backend();
                    let driver_allocations = emulation().completed(c"allocation");
                    let driver_frees = emulation().completed(c"free");
                    let collectives = plan_bucket(&backend, &config, &topology, 4 * 3001);
                    let blocks = counter.blocks.load(Ordering::SeqCst);
                    let what = format!("{preset} P={chunks}");
                    assert!(blocks > 1, "{what}: {blocks} blocks given");
                    assert_eq!(
                        emulation().completed(c"allocation") - driver_allocations,
                        blocks as u64,
                        "{what}: the driver allocated memory the allocator did not give"
                    );
                    drop(collectives);
                    assert_eq!(counter.live_blocks.load(Ordering::SeqCst), 0, "{what}");
                    assert_eq!(
                        emulation().completed(c"free") - driver_frees,
                        blocks as u64,
                        "{what}: every block goes back when the collectives are dropped"
                    );
                }
            }
            let faults = emulation().take_faults(-1);
            assert!(faults.is_empty(), "the emulation reported:\n{faults}");
        },
    ) else {
        return;
    };
    assert_child_passed(&output);
}

/// One rank's stream-ordered caching allocator over driver memory, as torch's caching
/// allocator is for one stream: a block given back goes at once into a free list and to the
/// next allocation of its size, without waiting for the device, since everything that
/// allocates from it enqueues on that one stream (and orders the rank's other streams' uses
/// of a block before the stream's later work). Counts the bytes handed out and still live,
/// their peak, and the driver memory held.
#[derive(Debug, Default)]
struct StreamOrderedPool {
    free: Mutex<HashMap<usize, Vec<Box<dyn DeviceBlock>>>>,
    live: AtomicUsize,
    peak: AtomicUsize,
    reserved: AtomicUsize,
}

impl StreamOrderedPool {
    /// A new pool, alive for the rest of the process (its blocks are never freed).
    fn leak() -> &'static Self {
        Box::leak(Box::default())
    }

    /// Bytes handed out and not yet given back.
    fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// The most bytes live at once since the last [`reset_peak`](Self::reset_peak).
    fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    fn reset_peak(&self) {
        self.peak.store(self.live(), Ordering::SeqCst);
    }

    /// Driver memory the pool holds, handed out or free.
    fn reserved(&self) -> usize {
        self.reserved.load(Ordering::SeqCst)
    }
}

/// A block of a [`StreamOrderedPool`], back in its free list when dropped.
#[derive(Debug)]
struct PoolBlock {
    inner: Option<Box<dyn DeviceBlock>>,
    bytes: usize,
    pool: &'static StreamOrderedPool,
}

impl DeviceBlock for PoolBlock {
    fn addr(&self) -> u64 {
        self.inner.as_ref().map_or(0, |b| b.addr())
    }
}

impl Drop for PoolBlock {
    fn drop(&mut self) {
        if let Some(block) = self.inner.take() {
            self.pool.live.fetch_sub(self.bytes, Ordering::SeqCst);
            let mut free = self.pool.free.lock().expect("the pool's lock");
            free.entry(self.bytes).or_default().push(block);
        }
    }
}

impl DeviceAllocator for &'static StreamOrderedPool {
    fn allocate(&self, kernels: &'static Kernels, bytes: usize) -> Result<Box<dyn DeviceBlock>> {
        let reused = self
            .free
            .lock()
            .expect("the pool's lock")
            .get_mut(&bytes)
            .and_then(Vec::pop);
        let inner = match reused {
            Some(block) => block,
            None => {
                self.reserved.fetch_add(bytes, Ordering::SeqCst);
                Allocator::Driver.allocate(kernels, bytes)?
            }
        };
        let live = self.live.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(live, Ordering::SeqCst);
        Ok(Box::new(PoolBlock {
            inner: Some(inner),
            bytes,
            pool: self,
        }))
    }
}

/// The rank's backend with buffers from a new [`StreamOrderedPool`] (the rank's data buffers
/// stay on `rank.backend`, outside the pool's counts).
fn pooled_backend(rank: &Rank<'_>) -> (Cuda, &'static StreamOrderedPool) {
    let pool = StreamOrderedPool::leak();
    let allocator: &'static dyn DeviceAllocator = Box::leak(Box::new(pool));
    (
        rank.backend.with_allocator(Allocator::Given(allocator)),
        pool,
    )
}

/// A rank's gradient bucket of `numel` gaussian values for bucket `bucket` at step `step`.
fn gradients(seed: u64, rank: usize, bucket: u32, step: u64, numel: usize) -> Vec<f32> {
    let tag = (rank as u64) << 40 | u64::from(bucket) << 20 | step;
    let mut rng = SplitMix64::derive(seed, tag);
    (0..numel).map(|_| rng.gaussian() as f32).collect()
}

/// Two gradient buckets (ids 3 and 4) reduce-scattered one after the other on each rank's
/// stream for `STEPS` steps give the host's shards, both with the buffers of a stream-ordered
/// caching allocator (each call's buffers reused by the next call at once) and with the
/// driver's (`Allocator::Driver`: a pool of driver blocks ordered by events); the second
/// bucket and later steps take no new memory from the stream-ordered allocator; the pipelined
/// chunks (P = 3) run their exchanges on a second stream, so a buffer given back before its
/// exchange had completed would be a race the emulation reports.
#[test]
fn buckets_share_call_buffers_in_stream_order() {
    const STEPS: u64 = 2;
    let topology = Topology::uniform(2, 2).expect("two nodes of two");
    let numel = 4 * 3001;
    let seed = 0x6d65_6d6f;
    for (preset, chunks) in [
        (Preset::Sdp4bit, "3"),
        (Preset::Sdp4bit, "1"),
        (Preset::GlobalQsgd, "1"),
    ] {
        let config = cfg(preset, &[("pipeline_chunks", chunks)]);
        let what = format!("{preset} P={chunks}");
        let host = LocalCluster::new(topology.clone()).run(|c| {
            let me = c.world.rank();
            let mut shards = Vec::new();
            for bucket in [3, 4] {
                let mut rs = GradReduceScatter::new(&config, &topology, me, numel, bucket)
                    .expect("host plan");
                let mut shard = vec![f32::NAN; rs.plan().shard_len];
                for step in 0..STEPS {
                    let data = gradients(seed, me, bucket, step, numel);
                    rs.run(c, &data, &mut shard, step).expect("host step");
                    shards.push(shard.clone());
                }
            }
            shards
        });
        for pooled in [true, false] {
            let device = EmulatedCluster::new(&topology).run(|rank| {
                let me = rank.comms.world.rank();
                let (backend, pool) = if pooled {
                    let (backend, pool) = pooled_backend(rank);
                    (backend, Some(pool))
                } else {
                    (rank.backend, None)
                };
                let mut buckets: Vec<GradReduceScatter<Cuda>> = [3, 4]
                    .into_iter()
                    .map(|bucket| {
                        GradReduceScatter::with_backend(
                            &backend, &config, &topology, me, numel, bucket,
                        )
                        .expect("device plan")
                    })
                    .collect();
                let kept = pool.map(|p| p.live());
                let mut reserved_after_first_call = None;
                let mut shards = Vec::new();
                for (rs, bucket) in buckets.iter_mut().zip([3, 4]) {
                    let mut shard = upload(rank, &vec![f32::NAN; rs.plan().shard_len]);
                    for step in 0..STEPS {
                        let data = upload(rank, &gradients(seed, me, bucket, step, numel));
                        rs.run_on(
                            &backend,
                            &rank.comms,
                            Cuda::src(&data),
                            Cuda::dst(&mut shard),
                            step,
                        )
                        .unwrap_or_else(|e| panic!("{what}: bucket {bucket} step {step}: {e}"));
                        rs.check_integer_sums(&backend).expect("no overflow");
                        shards.push(download(rank, &shard));
                        if let Some(pool) = pool {
                            assert_eq!(Some(pool.live()), kept, "{what}: a call kept memory");
                            let reserved =
                                *reserved_after_first_call.get_or_insert(pool.reserved());
                            assert_eq!(
                                pool.reserved(),
                                reserved,
                                "{what}: bucket {bucket} step {step} took new memory instead of \
                                 the previous call's"
                            );
                        }
                    }
                }
                shards
            });
            for (r, (want, got)) in host.iter().zip(&device).enumerate() {
                for (i, (want, got)) in want.iter().zip(got).enumerate() {
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(got),
                        bits(want),
                        "{what} (stream-ordered pool: {pooled}): rank {r} call {i}: the device \
                         shard differs from the host's"
                    );
                }
            }
            let faults = emulation().take_faults(-1);
            assert!(
                faults.is_empty(),
                "{what}: the emulation reported:\n{faults}"
            );
        }
    }
}

/// What one rank's sdp4bit collectives hold, in bytes.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// Kept by the gradient and the weight bucket between calls.
    grad_kept: usize,
    weight_kept: usize,
    /// The most taken at once by one call, besides what the buckets keep (0 when not run).
    grad_call: usize,
    weight_call: usize,
    /// The same for the gradient call of a bf16 bucket into a bf16 shard (Megatron's bf16
    /// gradient buffers, reduce-scattered straight from bf16).
    grad_call_bf16: usize,
}

impl Held {
    /// Kept by both buckets, per parameter of a bucket of `numel`.
    fn kept_per_param(&self, numel: usize) -> f64 {
        (self.grad_kept + self.weight_kept) as f64 / numel as f64
    }
}

/// Plans the sdp4bit collectives of a bucket of `numel` parameters for rank `me` of
/// `topology` on `backend` (buffers from `pool`); `params` is the rank's param bucket. Set-up
/// takes nothing beyond what the buckets keep: no temporary that grows with the bucket.
fn plan_sdp4bit(
    backend: &Cuda,
    pool: &StreamOrderedPool,
    topology: &Topology,
    me: usize,
    params: DeviceSpan<bf16>,
) -> (GradReduceScatter<Cuda>, WeightAllGather<Cuda>, Held) {
    let config = cfg(Preset::Sdp4bit, &[]);
    pool.reset_peak();
    let before = pool.live();
    let grads = GradReduceScatter::with_backend(backend, &config, topology, me, params.len(), 3)
        .expect("plan the gradient bucket");
    let grad_kept = pool.live() - before;
    let weights = WeightAllGather::with_backend(backend, &config, topology, me, 3, params)
        .expect("plan the weight bucket");
    let weight_kept = pool.live() - before - grad_kept;
    assert_eq!(
        pool.peak(),
        pool.live(),
        "set-up took device memory beyond what the buckets keep"
    );
    let held = Held {
        grad_kept,
        weight_kept,
        grad_call: 0,
        weight_call: 0,
        grad_call_bf16: 0,
    };
    (grads, weights, held)
}

/// The bytes of device memory per parameter that the sdp4bit preset's two collectives hold
/// for a bucket, besides the bucket itself, on 2 nodes of 8 GPUs with the default pipeline
/// chunks (P = 1). What the buckets keep between calls, planned for a bucket of 4 Mi
/// parameters (Megatron's buckets hold 40 M; the buffers scale with the bucket), must stay at
/// or below 0.6 B/param. What a call takes while in flight, given back once the call is
/// enqueued and shared by the buckets of a stream, is counted over one step of each collective
/// on the emulated cluster with buckets of 128 Ki parameters (4 Mi would keep the emulated
/// ranks waiting for each other past the emulation's deadlock limit), which also keep the
/// same per parameter; and what a Megatron job with bf16 gradient buffers holds besides its
/// own buffers, its bf16 buckets reduce-scattered straight from bf16 (one bf16 step). Printed
/// for the docs (docs/cuda.md).
/// The device bytes one gradient reduce-scatter of `values` (as a bucket of `G`) takes from
/// `pool` beyond the `kept` bytes of the buckets, asserting that it gives all of them back.
fn gradient_call_bytes<G: BucketElement + Default>(
    rank: &Rank<'_>,
    backend: &Cuda,
    pool: &StreamOrderedPool,
    kept: usize,
    grads: &mut GradReduceScatter<Cuda>,
    values: &[f32],
    step: u64,
) -> usize {
    let bucket = upload(
        rank,
        &values.iter().map(|&v| G::from_f32(v)).collect::<Vec<_>>(),
    );
    let mut shard = upload(rank, &vec![G::default(); grads.plan().shard_len]);
    pool.reset_peak();
    grads
        .run_on(
            backend,
            &rank.comms,
            Cuda::src(&bucket),
            Cuda::dst(&mut shard),
            step,
        )
        .expect("the gradient step");
    let taken = pool.peak() - kept;
    assert_eq!(pool.live(), kept, "the gradient call kept memory");
    download(rank, &shard);
    taken
}

#[test]
fn device_bytes_per_parameter_of_the_sdp4bit_preset() {
    let topology = Topology::uniform(2, 8).expect("two nodes of eight");
    let planned_numel = 16 << 18;
    let planned = {
        emulation();
        let kernels = Kernels::get(0).expect("the kernels load");
        // SAFETY: the legacy default stream; nothing is enqueued on it here but the first qWD
        // reference copy, synchronised by the download that follows.
        let stream = unsafe { Stream::from_raw(0) };
        let pool = StreamOrderedPool::leak();
        let allocator: &'static dyn DeviceAllocator = Box::leak(Box::new(pool));
        let backend = Cuda::new(kernels, stream).with_allocator(Allocator::Given(allocator));
        let params = Cuda::new(kernels, stream)
            .alloc::<bf16>(planned_numel)
            .expect("params");
        let (grads, weights, held) = plan_sdp4bit(&backend, pool, &topology, 0, Cuda::src(&params));
        backend
            .download(Cuda::src(&params))
            .expect("synchronise the stream");
        drop((grads, weights));
        held
    };
    let run_numel = 16 << 13;
    let seed = 0x6279_7465;
    let held = EmulatedCluster::new(&topology).run(|rank| {
        let me = rank.comms.world.rank();
        let (backend, pool) = pooled_backend(rank);
        let mut params = upload(rank, &vec![bf16::ONE; run_numel]);
        let (mut grads, mut weights, held) =
            plan_sdp4bit(&backend, pool, &topology, me, Cuda::src(&params));
        let kept = pool.live();
        let grad_call = gradient_call_bytes::<f32>(
            rank,
            &backend,
            pool,
            kept,
            &mut grads,
            &gradients(seed, me, 3, 0, run_numel),
            0,
        );
        pool.reset_peak();
        weights
            .run_on(&backend, rank.comms.world, Cuda::dst(&mut params), 0)
            .expect("the weight step");
        let weight_call = pool.peak() - kept;
        assert_eq!(pool.live(), kept, "the weight call kept memory");
        let grad_call_bf16 = gradient_call_bytes::<bf16>(
            rank,
            &backend,
            pool,
            kept,
            &mut grads,
            &gradients(seed, me, 3, 1, run_numel),
            1,
        );
        Held {
            grad_call,
            weight_call,
            grad_call_bf16,
            ..held
        }
    });
    let per_param = |bytes: usize, numel: usize| bytes as f64 / numel as f64;
    let run = held[0];
    println!(
        "sdp4bit preset, W = 16 (2 x 8), P = 1: kept per bucket {:.3} B/param (gradient \
         reduce-scatter {} bytes, weight all-gather {:.3} B/param; planned for {planned_numel} \
         parameters); \
         taken by a call in flight and given back once it is enqueued {:.3} B/param (gradient \
         reduce-scatter {:.3}, weight all-gather {:.3}; one step with {run_numel} parameters, \
         which keep {:.3} B/param)",
        planned.kept_per_param(planned_numel),
        planned.grad_kept,
        per_param(planned.weight_kept, planned_numel),
        per_param(run.grad_call.max(run.weight_call), run_numel),
        per_param(run.grad_call, run_numel),
        per_param(run.weight_call, run_numel),
        run.kept_per_param(run_numel),
    );
    // A Megatron job with bf16 gradient buffers: its bf16 buckets go in as they are, so
    // besides Megatron's own buffers (bf16 params and gradients) sdp4bit keeps what the
    // buckets keep, with no 4 B/param fp32 copy of the gradient buffer; a call in flight takes
    // what a bf16 bucket's gradient call takes, plus the extension's bf16 scratch shard for
    // Megatron's shard inside the bucket (2 / W B/param).
    let w = topology.world() as f64;
    let megatron_kept = planned.kept_per_param(planned_numel);
    let megatron_call = per_param(run.grad_call_bf16.max(run.weight_call), run_numel) + 2.0 / w;
    println!(
        "Megatron bf16 job, sdp4bit preset, W = 16: kept besides Megatron's own buffers \
         {megatron_kept:.3} B/param (no fp32 copy of the bf16 gradient buffer: it was \
         {:.3} with the 4 B/param copy); taken by a call in flight {megatron_call:.3} B/param \
         (bf16 gradient reduce-scatter {:.3}, the extension's bf16 scratch shard {:.3})",
        megatron_kept + 4.0,
        per_param(run.grad_call_bf16, run_numel),
        2.0 / w,
    );
    let kept = planned.kept_per_param(planned_numel);
    assert!(
        kept > 0.0 && kept <= 0.6,
        "the buckets keep {kept:.3} B/param"
    );
    for (r, h) in held.iter().enumerate() {
        let kept = h.kept_per_param(run_numel);
        assert!(
            kept > 0.0 && kept <= 0.6,
            "rank {r}: the buckets keep {kept:.3} B/param"
        );
        assert!(h.grad_call > 0 && h.weight_call > 0, "rank {r}: {h:?}");
        // A bf16 bucket takes no more than an fp32 one: no fp32 copy of it anywhere.
        assert!(
            h.grad_call_bf16 > 0 && h.grad_call_bf16 <= h.grad_call,
            "rank {r}: a bf16 gradient call takes {} bytes, an fp32 one {}",
            h.grad_call_bf16,
            h.grad_call
        );
    }
    let faults = emulation().take_faults(-1);
    assert!(faults.is_empty(), "the emulation reported:\n{faults}");
}
