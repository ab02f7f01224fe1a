//! Where the CUDA backend's buffers come from: with an allocator given
//! ([`Allocator::Given`], as the torch extension gives torch's caching allocator) every buffer
//! of both collectives comes from it and goes back to it when the collectives are dropped,
//! none from the driver directly; and the device memory the sdp4bit preset's collectives keep
//! per parameter of a bucket, counted from what they allocate.

use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;
use sdp4bit::backend::Backend;
use sdp4bit::backend::cuda::{
    Allocator, Cuda, DeviceAllocator, DeviceBlock, DeviceBuffer, DeviceSpan, Kernels, Stream,
};
use sdp4bit::collective::{GradReduceScatter, WeightAllGather};
use sdp4bit::plan::Topology;
use sdp4bit::{Config, Preset, Result};
use sdp4bit_test_support::setups::cfg;

use super::child::{assert_child_passed, run_isolated};
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

/// The bytes of device memory per parameter that the sdp4bit preset's two collectives keep
/// for a bucket, besides the bucket itself: 2 nodes of 8 GPUs, a bucket of 4 Mi parameters
/// (Megatron's buckets hold 40 M; the buffers scale with the bucket), the default pipeline
/// chunks. Printed for the docs (docs/cuda.md); the sum over the gradient and weight
/// collectives must stay below one fp32 copy of the bucket (4 B/param).
#[test]
fn device_bytes_per_parameter_of_the_sdp4bit_preset() {
    let topology = Topology::uniform(2, 8).expect("two nodes of eight");
    let numel = 16 << 18;
    let config = cfg(Preset::Sdp4bit, &[]);
    let (backend, counter) = counted_backend();
    let bytes = || counter.bytes.load(Ordering::SeqCst);
    let grads = GradReduceScatter::with_backend(&backend, &config, &topology, 0, numel, 3)
        .expect("plan the gradient bucket");
    let grad_bytes = bytes();
    let params = backend.alloc::<bf16>(numel).expect("params");
    let before_weights = bytes();
    let weights =
        WeightAllGather::with_backend(&backend, &config, &topology, 0, 3, Cuda::src(&params))
            .expect("plan the weight bucket");
    let weight_bytes = bytes() - before_weights;
    backend
        .download(Cuda::src(&params))
        .expect("synchronise the stream");
    let per_param = |bytes: usize| bytes as f64 / numel as f64;
    let total = per_param(grad_bytes + weight_bytes);
    println!(
        "sdp4bit preset, W = 16 (2 x 8), {numel} parameters per bucket, P = {}: gradient \
         reduce-scatter {:.3} B/param, weight all-gather {:.3} B/param, total {total:.3} \
         B/param",
        grads.plan().chunks,
        per_param(grad_bytes),
        per_param(weight_bytes),
    );
    assert!(total > 0.0 && total < 4.0, "{total} B/param");
    drop((grads, weights, params));
    assert_eq!(counter.live_blocks.load(Ordering::SeqCst), 0);
    let faults = emulation().take_faults(-1);
    assert!(faults.is_empty(), "the emulation reported:\n{faults}");
}
