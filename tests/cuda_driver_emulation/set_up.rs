//! A bucket's set-up is ordered on its stream: with a stream-ordered caching allocator like
//! torch's (a dropped block is handed out again at once to the next allocation, while work
//! queued on the stream may still use it), a gradient bucket re-created right after its
//! predecessor's step was enqueued gets the predecessor's memory, and its table upload, on
//! the stream, comes after the predecessor's kernels: no race, and the same bytes. A
//! synchronous upload into such memory (on the legacy default stream, which a non-blocking
//! stream does not wait for) is the race the emulation reports.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use sdp4bit::backend::Backend;
use sdp4bit::backend::cuda::{Allocator, Cuda, DeviceAllocator, DeviceBlock, Kernels};
use sdp4bit::collective::{Comm, GradReduceScatter};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset, Result};
use sdp4bit_test_support::cuda_cluster::{DeviceCluster, download, upload};
use sdp4bit_test_support::setups::cfg;

use super::child::{assert_child_passed, run_isolated};
use super::comm::{EmulatedCluster, device_count};
use super::library::emulation;

/// Driver memory cached for one stream: a dropped block goes to a free list, and an
/// allocation of the same size takes the block freed first, without any synchronisation.
/// The driver memory is never freed (the process ends first).
#[derive(Debug, Default)]
struct StreamCache {
    /// (bytes, address) of the free blocks, in the order they were freed.
    free: Mutex<Vec<(usize, u64)>>,
    reused: AtomicUsize,
}

#[derive(Debug)]
struct CachedBlock {
    addr: u64,
    bytes: usize,
    owner: &'static StreamCache,
}

impl DeviceBlock for CachedBlock {
    fn addr(&self) -> u64 {
        self.addr
    }
}

impl Drop for CachedBlock {
    fn drop(&mut self) {
        let mut free = self.owner.free.lock().expect("free list");
        free.push((self.bytes, self.addr));
    }
}

impl StreamCache {
    /// The size of the block freed first, if any.
    fn first_free(&self) -> Option<usize> {
        self.free
            .lock()
            .expect("free list")
            .first()
            .map(|&(b, _)| b)
    }
}

impl DeviceAllocator for &'static StreamCache {
    fn allocate(&self, kernels: &'static Kernels, bytes: usize) -> Result<Box<dyn DeviceBlock>> {
        let mut free = self.free.lock().expect("free list");
        let addr = match free.iter().position(|&(b, _)| b == bytes) {
            Some(i) => {
                self.reused.fetch_add(1, Ordering::SeqCst);
                free.remove(i).1
            }
            None => {
                let block = Allocator::Driver.allocate(kernels, bytes)?;
                let addr = block.addr();
                std::mem::forget(block);
                addr
            }
        };
        Ok(Box::new(CachedBlock {
            addr,
            bytes,
            owner: self,
        }))
    }
}

/// A gradient bucket re-created while its predecessor's step may still run takes the
/// predecessor's memory and uploads its tables after it (the same shard bytes, no race); a
/// synchronous upload into the memory of a bucket dropped the same way races.
#[test]
fn a_recreated_bucket_sets_up_after_its_predecessor() {
    let Some(output) = run_isolated(
        "set_up::a_recreated_bucket_sets_up_after_its_predecessor",
        &[],
        recreated_bucket_scenario,
    ) else {
        return;
    };
    assert_child_passed(&output);
}

fn recreated_bucket_scenario() {
    let topo = Topology::uniform(1, 2).expect("one node of two");
    let config: Config = cfg(Preset::Sdp4bit, &[("pipeline_chunks", "3")]);
    let numel = 2 * 307;
    let grads: Vec<Vec<f32>> = (0..2)
        .map(|r| {
            (0..numel)
                .map(|i| ((i * 7 + r * 3) % 11) as f32 * 0.125 - 0.625)
                .collect()
        })
        .collect();
    let results = EmulatedCluster::new(&topo).run(|rank| {
        let me = rank.comms.world.rank();
        // The ranks' devices differ (two emulated devices), so each takes its own faults.
        let device = i32::try_from(me % device_count()).expect("a device ordinal");
        let cache: &'static StreamCache = Box::leak(Box::default());
        let allocator: &'static dyn DeviceAllocator = Box::leak(Box::new(cache));
        let backend = rank.backend.with_allocator(Allocator::Given(allocator));
        let bucket = upload(rank, &grads[me]);
        let step = |rs: &mut GradReduceScatter<Cuda>| {
            let mut shard = upload(rank, &vec![0.0f32; rs.plan().shard_len]);
            rs.run_on(
                &backend,
                &rank.comms,
                Cuda::src(&bucket),
                Cuda::dst(&mut shard),
                0,
            )
            .expect("a step is enqueued");
            shard
        };
        let plan = || {
            GradReduceScatter::with_backend(&backend, &config, &topo, me, numel, 5)
                .expect("device plan")
        };
        // Correct: the new bucket's uploads are ordered after the old bucket's queued step.
        let mut first = plan();
        let first_shard = step(&mut first);
        drop(first);
        let reused_before = cache.reused.load(Ordering::SeqCst);
        let mut second = plan();
        let reused = cache.reused.load(Ordering::SeqCst) - reused_before;
        let second_shard = step(&mut second);
        let clean = emulation().take_faults(device);
        // Broken: the old bucket's memory written synchronously, on the legacy stream.
        let third_shard = step(&mut second);
        drop(second);
        let bytes = cache
            .first_free()
            .expect("the tables went back to the cache");
        let mut taken = backend.alloc::<u8>(bytes).expect("the tables' memory");
        let racing = backend.upload(&vec![0u8; bytes], Cuda::dst(&mut taken));
        rank.stream.synchronize().expect("stream synchronize");
        drop(third_shard);
        let faults = emulation().take_faults(device);
        // Before the buffers are dropped (the peers' reads of them included).
        rank.comms.world.all_reduce_max(0.0).expect("meet");
        (
            download(rank, &first_shard),
            download(rank, &second_shard),
            reused,
            clean,
            racing.map_err(|e| e.to_string()),
            faults,
        )
    });
    for (r, (first, second, reused, clean, racing, faults)) in results.iter().enumerate() {
        assert!(
            *reused > 0,
            "rank {r}: the new bucket got none of the old one's memory"
        );
        assert!(
            clean.is_empty(),
            "rank {r}: the re-created bucket raced:\n{clean}"
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(first), bits(second), "rank {r}: the shards differ");
        assert!(
            racing.is_err(),
            "rank {r}: the synchronous upload was not refused"
        );
        assert!(
            faults.contains("race on") && faults.contains("legacy default stream"),
            "rank {r}: no race reported for the synchronous upload:\n{faults}"
        );
    }
}
