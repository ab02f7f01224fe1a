//! `GradReduceScatter<Cuda>` and `WeightAllGather<Cuda>` end to end on the CUDA driver: several
//! ranks in one process, all on device 0, each on its own thread and stream, must write on
//! every rank the bytes the `Host` backend writes over `LocalCluster`
//! (`sdp4bit_test_support::cuda_end_to_end`): every preset and the ablations, P = 1 and 3, the
//! 2x2, 1x4, 4x1 and two unequal topologies, fp32 and bf16 gradient buckets, three steps
//! reusing the objects, odd shard sizes, NaN / Inf in one step.
//!
//! NCCL cannot run two ranks on one GPU, so the ranks' `Comm<Cuda>` ([`StagedComm`]) stages
//! every exchange through the host. The collectives therefore wait for the device inside,
//! which this test does not check (the emulated driver's tests do): it checks bytes.
//!
//! Needs a CUDA driver, a device and NVRTC. Without them each test prints `skipped: <reason>`
//! and passes, unless `SDP4BIT_REQUIRE_GPU=1` turns the skip into a failure.
//! `SDP4BIT_GPU_TEST_QUICK=1` runs a small sweep instead (one preset per codec family, the 2x2
//! topology, a few hundred elements per rank), e.g. under compute-sanitizer;
//! `SDP4BIT_TEST_SEED` changes the data. The tests of the emulated CUDA driver run the quick
//! sweep on it (`tests/cuda_driver_emulation/gpu_suite.rs`).

use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::CudaStream;
use sdp4bit::Preset;
use sdp4bit::Result;
use sdp4bit::backend::cuda::{Cuda, DeviceSpan};
use sdp4bit::collective::local::{LocalCluster, LocalComm};
use sdp4bit::collective::{Comm, SumElement};
use sdp4bit::layout::Topology;
use sdp4bit_test_support::cuda_cluster::{
    CommSite, DeviceCluster, Rank, bytes_of, copy_to_device, gpu_kernels, run_ranks,
};
use sdp4bit_test_support::cuda_end_to_end::{ABLATIONS, Sweep, data_seed, topologies};

/// A rank's communicator that runs every collective of its host communicator on the device
/// buffers' contents: it waits for the rank's stream, copies the send buffer to the host, runs
/// the collective there (sums in rank order), and copies the result into the receive buffer on
/// the stream, waiting for the copy. `start_all_to_all` is the trait's blocking default.
struct StagedComm {
    host: LocalComm,
    backend: Cuda,
    stream: Arc<CudaStream>,
}

impl StagedComm {
    /// Runs `collective` on the host copy of `send`, then copies its output into `recv`.
    fn staged<S: Pod, R: Pod>(
        &self,
        send: DeviceSpan<S>,
        recv: DeviceSpan<R>,
        collective: impl FnOnce(&[S], &mut [R]) -> Result<()>,
    ) -> Result<()> {
        let send: Vec<S> = bytemuck::pod_collect_to_vec(&self.backend.download(bytes_of(send))?);
        let mut out = vec![R::zeroed(); recv.len()];
        collective(&send, &mut out)?;
        copy_to_device(&self.stream, bytemuck::cast_slice(&out), bytes_of(recv))
    }
}

impl Comm<Cuda> for StagedComm {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn size(&self) -> usize {
        self.host.size()
    }

    fn all_gather(&self, send: DeviceSpan<u8>, recv: DeviceSpan<u8>) -> Result<()> {
        self.staged(send, recv, |send, recv| self.host.all_gather(send, recv))
    }

    fn all_to_all(&self, send: DeviceSpan<u8>, recv: DeviceSpan<u8>) -> Result<()> {
        self.staged(send, recv, |send, recv| self.host.all_to_all(send, recv))
    }

    fn all_reduce_max(&self, value: f32) -> Result<f32> {
        self.host.all_reduce_max(value)
    }

    fn all_reduce_max_in_place(&self, word: DeviceSpan<f32>) -> Result<()> {
        self.staged(word, word, |send, recv| {
            recv.copy_from_slice(send);
            self.host.all_reduce_max_in_place(recv)
        })
    }

    fn reduce_scatter_sum<T: SumElement>(
        &self,
        send: DeviceSpan<T>,
        recv: DeviceSpan<T>,
    ) -> Result<()> {
        self.staged(send, recv, |send, recv| {
            self.host.reduce_scatter_sum(send, recv)
        })
    }
}

/// The ranks of a topology on device 0 with [`StagedComm`]s.
struct StagedCluster {
    host: LocalCluster,
}

impl StagedCluster {
    fn new(topology: &Topology) -> Self {
        Self {
            host: LocalCluster::new(topology.clone()),
        }
    }
}

impl DeviceCluster for StagedCluster {
    type Comm = StagedComm;

    fn topology(&self) -> &Topology {
        self.host.topology()
    }

    fn run<R: Send>(&self, f: impl Fn(&Rank<'_, StagedComm>) -> R + Sync) -> Vec<R> {
        let comm = |site: CommSite<'_>| StagedComm {
            host: site.host.clone(),
            backend: site.backend,
            stream: Arc::clone(site.stream),
        };
        run_ranks(&self.host, |_| 0, comm, f)
    }

    /// Not counted: the communicator waits for the device by design.
    fn take_host_syncs(&self) -> Option<Vec<String>> {
        None
    }
}

/// Whether `SDP4BIT_GPU_TEST_QUICK=1` asks for the small sweep.
fn quick() -> bool {
    std::env::var("SDP4BIT_GPU_TEST_QUICK").is_ok_and(|v| v == "1")
}

/// The presets of the quick sweep, one per codec family: TLq-HS with qWD, QSDP's asymmetric
/// codes with direct weights, Global-QSGD's integer sums.
const QUICK_PRESETS: [Preset; 3] = [Preset::Sdp4bit, Preset::Qsdp, Preset::GlobalQsgd];

/// Both collectives of the preset with `overrides` against the host, on the sweep of this run
/// (a few thousand to a hundred thousand elements per bucket, or the quick one).
fn sweep(name: &str, preset: Preset, overrides: &[(&str, &str)]) {
    let Some(kernels) = gpu_kernels() else {
        return;
    };
    let seed = data_seed();
    println!(
        "{name} on {}: data seed {seed} (SDP4BIT_TEST_SEED={seed} repeats it)",
        kernels.describe()
    );
    let (topologies, grad_shard, weight_shard) = if quick() {
        (topologies().into_iter().take(1).collect(), 307, 197)
    } else {
        (topologies(), 20011, 12347)
    };
    let sweep = Sweep {
        topologies,
        grad_shard,
        weight_shard,
        seed,
    };
    sweep.run(StagedCluster::new, name, preset, overrides);
}

/// The sweep of `preset`, unless the quick sweep leaves it out.
fn sweep_preset(preset: Preset) {
    if quick() && !QUICK_PRESETS.contains(&preset) {
        println!("{preset}: left out of the quick sweep (SDP4BIT_GPU_TEST_QUICK=1)");
        return;
    }
    sweep(preset.name(), preset, &[]);
}

#[test]
fn sdp4bit() {
    sweep_preset(Preset::Sdp4bit);
}

#[test]
fn qsdp() {
    sweep_preset(Preset::Qsdp);
}

#[test]
fn global_qsgd() {
    sweep_preset(Preset::GlobalQsgd);
}

#[test]
fn zeropp() {
    sweep_preset(Preset::Zeropp);
}

#[test]
fn baseline() {
    sweep_preset(Preset::Baseline);
}

#[test]
fn ablations() {
    if quick() {
        println!("ablations: left out of the quick sweep (SDP4BIT_GPU_TEST_QUICK=1)");
        return;
    }
    for (name, preset, overrides) in ABLATIONS {
        sweep(name, preset, overrides);
    }
}
