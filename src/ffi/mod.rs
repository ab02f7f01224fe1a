//! The only surface C++ sees: a `cxx` bridge used by the torch extension in `cpp/`.
//!
//! Rust keeps every algorithm; C++ supplies the exchanges. The extension hands Rust a
//! [`bridge::TorchComms`] (the private torch.distributed process groups of one DP group) and
//! Rust calls back into it for each all-gather and all-to-all, so the collectives of
//! [`crate::collective`] run unchanged over gloo or NCCL, on host buffers (the CPU backend)
//! or on CUDA buffers (the CUDA backend, kernels on torch's current stream). Every entry point catches panics and
//! returns errors as values, which cxx turns into C++ exceptions and the extension into Python
//! exceptions.
//!
//! Built only with the `ffi` feature (`pip install .` turns it on); the tests' in-process
//! references (`simulate_*`) only with `test-ops` as well.

mod buckets;
mod cross_group;
mod schema;
#[cfg(feature = "test-ops")]
mod simulate;
mod torch_comm;
mod torch_memory;

use buckets::{
    GradBucket, ParsedConfig, WeightBucket, agree_on_setup, cuda_bucket_problem,
    cuda_device_problem, cuda_device_report, cuda_kernel_check, cuda_new_side_stream,
    new_cuda_grad_bucket, new_cuda_weight_bucket, new_grad_bucket, new_weight_bucket, nvrtc_report,
    parse_config,
};
use cross_group::{CrossGroupBucket, new_cross_group_bucket, new_cuda_cross_group_bucket};
use schema::{max_bucket_id, schema_json};
#[cfg(feature = "test-ops")]
use simulate::{
    simulate_cross_group_all_reduce, simulate_grad_reduce_scatter, simulate_weight_all_gather,
};

#[cxx::bridge(namespace = "sdp4bit::ffi")]
mod bridge {
    /// One of the communicators of a rank's DP group.
    #[derive(Debug, Clone, Copy)]
    #[repr(u8)]
    enum CommLevel {
        /// All ranks of the DP group.
        World,
        /// The ranks on this rank's node.
        Intra,
        /// The ranks with this rank's local index, one per node.
        Inter,
    }

    /// Element type of a reduce-scatter sum.
    #[derive(Debug, Clone, Copy)]
    #[repr(u8)]
    enum SumDtype {
        Float32,
        Int8,
        Int16,
    }

    /// Bytes one rank sends, split by where they travel.
    #[derive(Debug, Clone, Copy, Default)]
    struct WireBytes {
        intra_node: u64,
        inter_node: u64,
    }

    extern "Rust" {
        /// A config spec as the core parsed it: the validated config, or why it is invalid.
        type ParsedConfig;
        /// Parses `preset[;knob=value]*`, e.g. `sdp4bit;weight_bits=4;seed=7`. Never fails:
        /// an invalid spec keeps its error, which `check` and every function given it
        /// return, except the set-up agreement, which takes part with it.
        fn parse_config(spec: &str) -> Box<ParsedConfig>;
        /// Why the spec is invalid, as an error.
        fn check(self: &ParsedConfig) -> Result<()>;
        /// The config as front ends use it, JSON: the codecs (`weight_codec`, `grad_codec`),
        /// whether each side is compressed, whether ranks keep a reference copy of the
        /// weights (`keeps_reference`), `grad_quant_start_step`, `exact_params`, every knob's
        /// value in the knob table's order (`values`: `[name, text or null where the codecs
        /// do not use it]`), the canonical text (`canonical`) and its `fingerprint`.
        fn record_json(self: &ParsedConfig) -> Result<String>;
        /// The presets, knobs (name, accepted values, doc) and limits, as JSON text.
        fn schema_json() -> String;
        /// The largest bucket id the random streams can number.
        fn max_bucket_id() -> u32;

        /// The gradient reduce-scatter of one bucket.
        type GradBucket;
        /// Plans bucket `bucket_id` of `numel` elements (fp32 or bf16, chosen per call) for DP
        /// rank `rank`; DP rank `z` lives on node `node_labels[z]`.
        fn new_grad_bucket(
            config: &ParsedConfig,
            node_labels: &[u64],
            rank: usize,
            numel: usize,
            bucket_id: u32,
        ) -> Result<Box<GradBucket>>;
        /// Elements of this rank's shard.
        fn shard_len(self: &GradBucket) -> usize;
        /// Whether step `step` sends quantized gradients (false for the uncompressed codec and
        /// before `grad_quant_start_step`).
        fn quantizes_at(self: &GradBucket, step: u64) -> bool;
        /// Bytes sent at step `step`.
        fn wire_bytes(self: &GradBucket, step: u64) -> WireBytes;
        /// Bytes the uncompressed fp32 reduce-scatter sends.
        fn baseline_wire_bytes(self: &GradBucket) -> WireBytes;
        /// Why the route was degraded (unequal nodes), or empty.
        fn notice(self: &GradBucket) -> String;
        /// Reduce-scatters `bucket` into `shard` at optimizer step `step` (a host bucket).
        fn run(
            self: &mut GradBucket,
            comms: &TorchComms,
            bucket: &[f32],
            shard: &mut [f32],
            step: u64,
        ) -> Result<()>;
        /// [`run`](GradBucket::run) of a bf16 bucket into a bf16 shard (bf16 bit patterns;
        /// docs/numerics.md §7.5).
        fn run_bf16(
            self: &mut GradBucket,
            comms: &TorchComms,
            bucket: &[u16],
            shard: &mut [u16],
            step: u64,
        ) -> Result<()>;
        /// Plans a bucket like `new_grad_bucket` with its buffers on CUDA device `device`,
        /// allocated for the current stream, the raw CUDA stream `stream`, and its tables
        /// uploaded on that stream.
        fn new_cuda_grad_bucket(
            config: &ParsedConfig,
            node_labels: &[u64],
            rank: usize,
            numel: usize,
            bucket_id: u32,
            device: usize,
            stream: u64,
        ) -> Result<Box<GradBucket>>;
        /// Reduce-scatters the CUDA tensor at device address `bucket` into the one at `shard`
        /// (both fp32, or both bf16 when `bf16`), enqueuing every pass on the raw CUDA stream
        /// `stream` (a CUDA bucket), then (Global-QSGD) a copy of its integer-sum status to
        /// pinned host memory.
        #[allow(clippy::too_many_arguments)]
        fn run_cuda(
            self: &mut GradBucket,
            comms: &TorchComms,
            bucket: u64,
            shard: u64,
            bf16: bool,
            stream: u64,
            step: u64,
        ) -> Result<()>;

        /// Whether the bucket reads Global-QSGD's integer-sum status back after each step (a
        /// CUDA Global-QSGD bucket).
        fn reads_back_integer_sums(self: &GradBucket) -> bool;
        /// The integer-sum status word a CUDA bucket's copy after an earlier step read, once
        /// that copy has completed, else 0 (also for other buckets); never waits for the
        /// device.
        fn take_integer_sum_status(self: &mut GradBucket) -> Result<u32>;
        /// The host path's error for DP rank `rank`'s integer-sum status word `status` (as
        /// `take_integer_sum_status` returns it on that rank), or empty when it records no
        /// overflow.
        fn integer_sum_error(self: &GradBucket, rank: usize, status: u32) -> String;

        /// The parameter all-gather of one bf16 bucket.
        type WeightBucket;
        /// Plans bucket `bucket_id` for DP rank `rank`; `params` (bf16 bit patterns) is the
        /// bucket as every replica holds it now.
        fn new_weight_bucket(
            config: &ParsedConfig,
            node_labels: &[u64],
            rank: usize,
            bucket_id: u32,
            params: &[u16],
        ) -> Result<Box<WeightBucket>>;
        /// Elements of this rank's shard.
        fn shard_len(self: &WeightBucket) -> usize;
        /// Bytes sent per call.
        fn wire_bytes(self: &WeightBucket) -> WireBytes;
        /// Bytes the uncompressed bf16 all-gather sends.
        fn baseline_wire_bytes(self: &WeightBucket) -> WireBytes;
        /// All-gathers `params` (bf16 bit patterns) at optimizer step `step` (a host bucket).
        fn run(
            self: &mut WeightBucket,
            comms: &TorchComms,
            params: &mut [u16],
            step: u64,
        ) -> Result<()>;
        /// Plans a bucket like `new_weight_bucket` on CUDA device `device`, from the bf16 CUDA
        /// tensor of `numel` elements at device address `params`; the first qWD reference is
        /// copied on the raw CUDA stream `stream`.
        #[allow(clippy::too_many_arguments)]
        fn new_cuda_weight_bucket(
            config: &ParsedConfig,
            node_labels: &[u64],
            rank: usize,
            bucket_id: u32,
            device: usize,
            params: u64,
            numel: usize,
            stream: u64,
        ) -> Result<Box<WeightBucket>>;
        /// All-gathers the bf16 CUDA tensor at device address `params` on the raw CUDA stream
        /// `stream` (a CUDA bucket).
        fn run_cuda(
            self: &mut WeightBucket,
            comms: &TorchComms,
            params: u64,
            stream: u64,
            step: u64,
        ) -> Result<()>;

        /// The Global-QSGD all-reduce of one buffer across the groups of hybrid sharding
        /// (docs/numerics.md §7.6), over the world communicator of the groups' ranks.
        type CrossGroupBucket;
        /// Plans the all-reduce of `numel` elements (a multiple of `size`) by rank `rank` of
        /// the `size` ranks holding the same shard, its random streams those of bucket
        /// `bucket_id` and DP-world rank `stream_rank`, on host buffers.
        fn new_cross_group_bucket(
            config: &ParsedConfig,
            size: usize,
            rank: usize,
            numel: usize,
            bucket_id: u32,
            stream_rank: usize,
        ) -> Result<Box<CrossGroupBucket>>;
        /// Plans it like `new_cross_group_bucket` on buffers of CUDA device `device`, whose
        /// kernels are loaded on the raw CUDA stream `stream`.
        #[allow(clippy::too_many_arguments)]
        fn new_cuda_cross_group_bucket(
            config: &ParsedConfig,
            size: usize,
            rank: usize,
            numel: usize,
            bucket_id: u32,
            stream_rank: usize,
            device: usize,
            stream: u64,
        ) -> Result<Box<CrossGroupBucket>>;
        /// Bytes one rank sends per call.
        fn wire_bytes(self: &CrossGroupBucket) -> u64;
        /// Bytes the fp32 ring all-reduce of the buffer sends per rank.
        fn baseline_wire_bytes(self: &CrossGroupBucket) -> u64;
        /// All-reduces the host buffer `data` in place at optimizer step `step`.
        fn run(
            self: &CrossGroupBucket,
            comms: &TorchComms,
            data: &mut [f32],
            step: u64,
        ) -> Result<()>;
        /// [`run`](CrossGroupBucket::run) of a bf16 buffer (bf16 bit patterns).
        fn run_bf16(
            self: &CrossGroupBucket,
            comms: &TorchComms,
            data: &mut [u16],
            step: u64,
        ) -> Result<()>;
        /// All-reduces the CUDA tensor at device address `data` (fp32, or bf16 when `bf16`)
        /// in place, enqueuing every pass on the raw CUDA stream `stream`.
        fn run_cuda(
            self: &CrossGroupBucket,
            comms: &TorchComms,
            data: u64,
            bf16: bool,
            stream: u64,
            step: u64,
        ) -> Result<()>;

        /// Why CUDA device `device` cannot run the collectives (no driver, no such device,
        /// a kernel that fails to compile), or an empty string when its kernels are ready.
        fn cuda_device_problem(device: usize) -> String;
        /// A new stream of CUDA device `device` (its raw `CUstream`), non-blocking, at the
        /// device's greatest priority and never destroyed: a side stream of the extension's
        /// process groups, used by nothing else.
        fn cuda_new_side_stream(device: usize) -> Result<u64>;
        /// One line on CUDA device `device`: its architecture, the driver, the NVRTC and the
        /// image the kernels loaded as (CUBIN or PTX) and why; or why it cannot run them.
        fn cuda_device_report(device: usize) -> String;
        /// The NVRTC the kernels compile with (its version and path), or why none loads and
        /// where it was looked for.
        fn nvrtc_report() -> String;
        /// Why the kernels of a CUDA bucket of `config` on `device` (a weight bucket when
        /// `weights`, else a gradient bucket) fail their kernel check for the DP group of
        /// `node_labels` and `rank`, or an empty string (also when `config` or the group is
        /// invalid, which the set-up agreement reports). Once per set-up key and process.
        fn cuda_bucket_problem(
            device: usize,
            config: &ParsedConfig,
            node_labels: &[u64],
            rank: usize,
            weights: bool,
        ) -> String;
        /// The kernel check of both collectives' kernels for `config`, the DP group of
        /// `node_labels` and `rank`, on CUDA device `device` (not cached, whatever
        /// `SDP4BIT_CUDA_KERNEL_CHECK` says): an error names the first kernel whose bytes
        /// differ from the host's.
        fn cuda_kernel_check(
            device: usize,
            config: &ParsedConfig,
            node_labels: &[u64],
            rank: usize,
        ) -> Result<()>;

        /// The set-up check, run by every rank of the world communicator before it plans a
        /// bucket: fails on every rank unless all parsed the same valid config and agree on
        /// the bucket id and size. `local_error`, when not empty, is a problem this rank
        /// already found in its inputs: the rank still takes part (as with an invalid
        /// `config`), so its peers fail at once naming it, and it fails with that message.
        fn agree_on_setup(
            comms: &TorchComms,
            config: &ParsedConfig,
            local_error: &str,
            bucket_id: u32,
            numel: usize,
        ) -> Result<()>;

        /// Runs the cross-group all-reduce of `stream_ranks.len()` ranks in this process
        /// (threads, in-process exchanges): `data` is their buffers back to back, each
        /// replaced by that rank's result.
        #[cfg(feature = "test-ops")]
        fn simulate_cross_group_all_reduce(
            config: &ParsedConfig,
            bucket_id: u32,
            step: u64,
            stream_ranks: &[u64],
            data: &mut [f32],
        ) -> Result<()>;

        /// Runs the gradient reduce-scatter of all W ranks in this process (threads, in-process
        /// exchanges): `inputs` is W buckets back to back, `outputs` receives W shards.
        #[cfg(feature = "test-ops")]
        fn simulate_grad_reduce_scatter(
            config: &ParsedConfig,
            node_labels: &[u64],
            bucket_id: u32,
            step: u64,
            inputs: &[f32],
            outputs: &mut [f32],
        ) -> Result<()>;
        /// Runs T parameter all-gathers of all W ranks in this process: every replica starts
        /// from `initial`; at step `first_step + t` rank z writes its shard of `targets[t]`
        /// and all-gather; `outputs` receives every rank's bucket after every step (T x W
        /// buckets).
        #[cfg(feature = "test-ops")]
        fn simulate_weight_all_gather(
            config: &ParsedConfig,
            node_labels: &[u64],
            bucket_id: u32,
            first_step: u64,
            initial: &[u16],
            targets: &[u16],
            outputs: &mut [u16],
        ) -> Result<()>;
    }

    unsafe extern "C++" {
        include!("sdp4bit/cpp/torch_comms.h");

        /// A block of torch's CUDA caching allocator, returned to it when dropped.
        type TorchDeviceMemory;
        /// The block's device address.
        fn addr(self: &TorchDeviceMemory) -> u64;
        /// `bytes` bytes of CUDA device `device` (the calling thread's current device) from
        /// torch's caching allocator, associated with that device's current stream.
        fn allocate_torch_device_memory(
            device: usize,
            bytes: usize,
        ) -> Result<UniquePtr<TorchDeviceMemory>>;

        /// Opens a torch.profiler range named `name` on the calling thread.
        fn open_profiler_range(name: &str);
        /// Closes the innermost profiler range the calling thread opened.
        fn close_profiler_range();

        /// The process groups of one DP group (world, and intra/inter when nodes are equal).
        type TorchComms;
        /// Whether this level's communicator exists.
        fn has_level(self: &TorchComms, level: CommLevel) -> bool;
        /// This rank's index in the level's communicator.
        fn rank(self: &TorchComms, level: CommLevel) -> usize;
        /// Ranks in the level's communicator.
        fn size(self: &TorchComms, level: CommLevel) -> usize;
        /// All-gather of equal byte blocks, blocking.
        fn all_gather(
            self: &TorchComms,
            level: CommLevel,
            send: &[u8],
            recv: &mut [u8],
        ) -> Result<()>;
        /// Equal-split all-to-all of bytes, blocking.
        fn all_to_all(
            self: &TorchComms,
            level: CommLevel,
            send: &[u8],
            recv: &mut [u8],
        ) -> Result<()>;
        /// An all-to-all issued and not yet waited for.
        type PendingExchange;
        /// Equal-split all-to-all of bytes, issued without waiting: `send` and `recv` must
        /// stay alive and untouched until the result's `wait` has returned.
        fn start_all_to_all(
            self: &TorchComms,
            level: CommLevel,
            send: &[u8],
            recv: &mut [u8],
        ) -> Result<UniquePtr<PendingExchange>>;
        /// Completes the exchange as c10d's `Work::wait` does (host buffers: blocks until it
        /// has run; CUDA buffers over NCCL: the current stream waits for it); its c10d error,
        /// if any.
        fn wait(self: Pin<&mut PendingExchange>) -> Result<()>;
        /// MAX all-reduce of one float, blocking.
        fn all_reduce_max(self: &TorchComms, level: CommLevel, value: f32) -> Result<f32>;
        /// All-gather of equal byte blocks of CUDA memory (device addresses) on the current
        /// stream of the current CUDA device.
        fn all_gather_device(
            self: &TorchComms,
            level: CommLevel,
            send: u64,
            send_bytes: usize,
            recv: u64,
            recv_bytes: usize,
        ) -> Result<()>;
        /// Equal-split all-to-all of CUDA memory, as `all_gather_device`.
        fn all_to_all_device(
            self: &TorchComms,
            level: CommLevel,
            send: u64,
            send_bytes: usize,
            recv: u64,
            recv_bytes: usize,
        ) -> Result<()>;
        /// Equal-split all-to-all of CUDA memory issued after the work of the current stream
        /// of the current CUDA device and not waited for: the result's `wait` makes that stream
        /// wait for it (NCCL; gloo blocks). The buffers must not be reused before `wait`.
        fn start_all_to_all_device(
            self: &TorchComms,
            level: CommLevel,
            send: u64,
            send_bytes: usize,
            recv: u64,
            recv_bytes: usize,
        ) -> Result<UniquePtr<PendingExchange>>;
        /// MAX all-reduce of the one f32 at device address `word`, in place, as
        /// `all_gather_device`.
        fn all_reduce_max_device(self: &TorchComms, level: CommLevel, word: u64) -> Result<()>;
        /// Sum reduce-scatter of `dtype` elements of CUDA memory, as `all_gather_device`.
        fn reduce_scatter_device(
            self: &TorchComms,
            level: CommLevel,
            dtype: SumDtype,
            send: u64,
            send_numel: usize,
            recv: u64,
            recv_numel: usize,
        ) -> Result<()>;
    }
}

/// What bridge functions return: cxx turns the message into a C++ exception.
type FfiResult<T> = Result<T, String>;

/// Makes every collective call of this process open torch.profiler ranges (its phases, see
/// `crate::collective::ProfilerRanges`); once, from the first bucket built.
fn register_profiler_ranges() {
    crate::collective::set_profiler_ranges(crate::collective::ProfilerRanges {
        open: |name| bridge::open_profiler_range(name),
        close: bridge::close_profiler_range,
    });
}

/// Runs `f`, turning a panic into an error so that no unwind crosses the FFI.
fn guard<T>(what: &str, f: impl FnOnce() -> crate::error::Result<T>) -> FfiResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(error.to_string()),
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(format!(
                "internal error in {what} (a bug in sdp4bit): {message}"
            ))
        }
    }
}

impl From<crate::collective::WireBytes> for bridge::WireBytes {
    fn from(bytes: crate::collective::WireBytes) -> Self {
        Self {
            intra_node: bytes.intra_node,
            inter_node: bytes.inter_node,
        }
    }
}
