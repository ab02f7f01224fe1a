//! The autotune on an architecture the variant table lacks (`variants::TABLE`), on an
//! emulated sm_80 device: a bucket's set-up times every candidate variant and chooses one,
//! not while a CUDA graph is being captured on its stream; the kernels then match the host with
//! the chosen variants; the choice is recorded, and a new process takes it from the record
//! without tuning or compiling candidates again. `SDP4BIT_KERNEL_AUTOTUNE=0` and an
//! architecture of the table keep the defaults. Each scenario runs in a child process: the
//! chosen variants live as long as the process.

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use sdp4bit::backend::Backend;
use sdp4bit::backend::cuda::abi::{SdpWeightApply, SdpWeightEncode};
use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::backend::cuda::tuned::{self, read_record};
use sdp4bit::backend::cuda::variants::default_variant;
use sdp4bit::backend::cuda::{Constants, Cuda, KernelSpec, Kernels, Stream};
use sdp4bit::codec::quant::QuantSpec;
use sdp4bit::codec::slab::SlabLayout;
use sdp4bit::codec::weight_encoding::WeightEncoding;
use sdp4bit::kernel_check::{Collective, check_bucket};
use sdp4bit::layout::BucketPlan;
use sdp4bit::rng::UniformStream;
use sdp4bit::{Config, Preset};
use sdp4bit_test_support::cuda_end_to_end::topologies;
use sdp4bit_test_support::setups::cfg;

use super::child::{assert_child_passed, run_isolated};
use super::library::emulation;

const COMPUTE_CAPABILITY: &str = "SDP4BIT_CUDA_EMULATION_COMPUTE_CAPABILITY";
const CACHE_DIR: &str = "SDP4BIT_KERNEL_CACHE_DIR";
const AUTOTUNE: &str = "SDP4BIT_KERNEL_AUTOTUNE";
/// An architecture the table lacks, so tuned at first use.
const UNTABLED: &str = "8.0";

/// The weight all-gather of the sdp4bit preset (qWD) on 4 ranks: what its set-up prepares.
struct WeightBucket {
    config: Config,
    layout: SlabLayout,
    plan: BucketPlan,
    /// The constants of its encode and apply kernels.
    encode: Constants,
    apply: Constants,
}

impl WeightBucket {
    fn new() -> Self {
        let config: Config = cfg(Preset::Sdp4bit, &[]);
        let plan = BucketPlan::new(4 * 1000, 4, &config).expect("a plan");
        let spec = QuantSpec::of_weights(&config.weight).expect("quantized weights");
        let layout = SlabLayout {
            spec,
            groups: plan.padded_shard_len / spec.group_size,
        };
        let rng = UniformStream::new(0, 0, 0);
        let encoding = WeightEncoding::Difference;
        let encode = SdpWeightEncode::new(&layout, encoding, plan.shard_len, 0, &rng)
            .and_then(|p| Constants::encode(&p))
            .expect("encode constants");
        let apply = SdpWeightApply::new(&layout, encoding, &plan, 0)
            .and_then(|p| Constants::apply(&p))
            .expect("apply constants");
        Self {
            config,
            layout,
            plan,
            encode,
            apply,
        }
    }

    /// The bucket's set-up on `backend`.
    fn prepare(&self, backend: &Cuda) {
        backend
            .prepare_weights(&self.layout, WeightEncoding::Difference, &self.plan)
            .expect("the weight bucket sets up");
    }

    fn kernels(&self) -> [(Kernel, Constants); 2] {
        [
            (Kernel::WeightEncode, self.encode),
            (Kernel::WeightApply, self.apply),
        ]
    }

    /// The entries of the variants `kernels` launches the bucket's kernels with.
    fn launched(&self, kernels: &Kernels) -> Vec<String> {
        let mut entries: Vec<String> = self
            .kernels()
            .into_iter()
            .map(|(k, c)| {
                KernelSpec::new(k, c, kernels.variant(k, c))
                    .expect("a spec")
                    .entry()
            })
            .collect();
        entries.sort();
        entries
    }

    /// The kernels match the host's (`kernel_check`), with the variants they launch now.
    fn check(&self, kernels: &'static Kernels) {
        let (_, topology) = topologies().remove(0);
        assert_eq!(topology.world(), 4, "the check's topology is the bucket's");
        check_bucket(
            kernels,
            Collective::WeightAllGather,
            &self.config,
            &topology,
            1,
        )
        .unwrap_or_else(|e| panic!("the weight kernels after tuning: {e}"));
    }
}

/// Device 0's kernels, a stream and the backend on it.
fn backend() -> (&'static Kernels, Arc<CudaStream>, Cuda) {
    emulation();
    let context = CudaContext::new(0).expect("the primary context of device 0");
    context.bind_to_thread().expect("bind it");
    let kernels = Kernels::get(0).expect("the kernels load");
    let stream = context.new_stream().expect("a stream");
    // SAFETY: a live stream of device 0's primary context, kept alive by the caller.
    let cuda = Cuda::new(kernels, unsafe {
        Stream::from_raw(stream.cu_stream() as usize)
    });
    (kernels, stream, cuda)
}

/// A fresh directory for the kernel cache and the record of tuned variants.
fn cache_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sdp4bit-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the cache directory");
    dir
}

/// While a graph is captured on its stream, the set-up keeps the defaults; then it tunes:
/// both kernels chosen (and candidates beside the defaults compiled), recorded, and matching
/// the host. A second process takes the record: the variants are chosen before any set-up, and
/// the set-up compiles those two kernels and nothing else.
#[test]
fn an_untabled_architecture_is_tuned_once_and_recorded() {
    let dir = cache_dir("autotune");
    let dir_text = dir.to_string_lossy().into_owned();
    let env = [
        (COMPUTE_CAPABILITY, Some(UNTABLED)),
        (CACHE_DIR, Some(dir_text.as_str())),
    ];

    let tuning = run_isolated(
        "autotune::an_untabled_architecture_is_tuned_once_and_recorded",
        &[&env[..], &[("SDP4BIT_AUTOTUNE_STEP", Some("tune"))]].concat(),
        || match std::env::var("SDP4BIT_AUTOTUNE_STEP").as_deref() {
            Ok("tune") => tune_and_record(),
            Ok("reuse") => reuse_record(),
            other => panic!("unknown step {other:?}"),
        },
    );
    let Some(tuning) = tuning else { return };
    assert_child_passed(&tuning);
    let reuse = run_isolated(
        "autotune::an_untabled_architecture_is_tuned_once_and_recorded",
        &[&env[..], &[("SDP4BIT_AUTOTUNE_STEP", Some("reuse"))]].concat(),
        || unreachable!("the parent runs no scenario"),
    )
    .expect("the parent runs a child");
    assert_child_passed(&reuse);
    let _ = std::fs::remove_dir_all(&dir);
}

fn tune_and_record() {
    let bucket = WeightBucket::new();
    let (kernels, stream, cuda) = backend();
    let record = record_file(kernels);

    let raw_stream: *mut c_void = stream.cu_stream().cast();
    emulation().set_capturing(raw_stream, true);
    bucket.prepare(&cuda);
    for (kernel, constants) in bucket.kernels() {
        assert!(
            !kernels.is_chosen(kernel, constants),
            "{kernel:?} was tuned while a graph was captured"
        );
    }
    assert!(!record.exists(), "a record written while capturing");

    emulation().set_capturing(raw_stream, false);
    bucket.prepare(&cuda);
    let recorded = read_record(&record);
    for (kernel, constants) in bucket.kernels() {
        assert!(kernels.is_chosen(kernel, constants), "{kernel:?} not tuned");
        assert_eq!(
            recorded.get(&(kernel, constants)),
            Some(&kernels.variant(kernel, constants)),
            "{kernel:?}: the record holds another variant than the chosen one"
        );
        let compiled = kernels
            .loaded()
            .iter()
            .filter(|e| e.starts_with(&format!("{}__", kernel.name())))
            .count();
        assert!(compiled > 1, "{kernel:?}: only {compiled} variant timed");
    }
    bucket.check(kernels);
    assert_eq!(
        emulation().take_faults(-1),
        "",
        "the emulation reported faults"
    );
    println!("tuned: {:?}", bucket.launched(kernels));
}

fn reuse_record() {
    let bucket = WeightBucket::new();
    let (kernels, _stream, cuda) = backend();
    for (kernel, constants) in bucket.kernels() {
        assert!(
            kernels.is_chosen(kernel, constants),
            "{kernel:?}: the record was not read at load"
        );
    }
    assert!(kernels.loaded().is_empty(), "compiled before any set-up");
    bucket.prepare(&cuda);
    assert_eq!(
        kernels.loaded(),
        bucket.launched(kernels),
        "the set-up compiled more than the recorded variants (tuned again?)"
    );
    bucket.check(kernels);
}

/// With `SDP4BIT_KERNEL_AUTOTUNE=0` on an untabled architecture, and on sm_90 (in the table),
/// the set-up chooses nothing, records nothing and compiles only the defaults.
#[test]
fn the_switch_and_the_table_keep_the_defaults() {
    for (name, cc, autotune) in [("switch", UNTABLED, Some("0")), ("table", "9.0", None)] {
        let dir = cache_dir(&format!("autotune-{name}"));
        let dir_text = dir.to_string_lossy().into_owned();
        let Some(output) = run_isolated(
            "autotune::the_switch_and_the_table_keep_the_defaults",
            &[
                (COMPUTE_CAPABILITY, Some(cc)),
                (CACHE_DIR, Some(dir_text.as_str())),
                (AUTOTUNE, autotune),
            ],
            keeps_defaults,
        ) else {
            return;
        };
        assert_child_passed(&output);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn keeps_defaults() {
    let bucket = WeightBucket::new();
    let (kernels, _stream, cuda) = backend();
    bucket.prepare(&cuda);
    let mut defaults = Vec::new();
    for (kernel, constants) in bucket.kernels() {
        assert!(
            !kernels.is_chosen(kernel, constants),
            "{kernel:?} was tuned"
        );
        let default = default_variant(kernel, constants);
        assert_eq!(kernels.variant(kernel, constants), default);
        defaults.push(
            KernelSpec::new(kernel, constants, default)
                .expect("a spec")
                .entry(),
        );
    }
    defaults.sort();
    assert_eq!(
        kernels.loaded(),
        defaults,
        "compiled more than the defaults"
    );
    let record = record_file(kernels);
    assert!(!record.exists(), "a record was written");
}

/// The file `kernels`' device records its tuned variants in.
fn record_file(kernels: &Kernels) -> std::path::PathBuf {
    tuned::record_file(
        kernels.device_name(),
        kernels.target().target,
        kernels.nvrtc_version(),
        kernels.driver_version(),
    )
    .expect("a cache directory")
}
