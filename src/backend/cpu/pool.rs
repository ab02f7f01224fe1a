//! The thread pool the host passes run on, sized so that the rank processes of one node share
//! its cores instead of oversubscribing them.

use std::sync::OnceLock;

/// The launcher's count of rank processes on this node (torchrun, Megatron, DeepSpeed set it).
const LOCAL_WORLD_SIZE_ENV: &str = "LOCAL_WORLD_SIZE";
/// rayon's own thread-count variable; when set it wins.
const RAYON_NUM_THREADS_ENV: &str = "RAYON_NUM_THREADS";

/// Threads of the passes' pool: `RAYON_NUM_THREADS` when set to a positive number; otherwise
/// the cores this process may use divided by `LOCAL_WORLD_SIZE` (1 when unset), at least one.
/// rayon's default (one thread per core in every process) puts `LOCAL_WORLD_SIZE` times more
/// workers than cores on a node, and the idle ones spin while another rank needs the core.
pub fn pass_threads() -> usize {
    let positive = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
    };
    if let Some(threads) = positive(RAYON_NUM_THREADS_ENV) {
        return threads;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ranks = positive(LOCAL_WORLD_SIZE_ENV).unwrap_or(1);
    (cores / ranks).max(1)
}

/// Runs `f` on the passes' pool (built on first use with [`pass_threads`] threads); rayon's
/// parallel iterators inside `f` use that pool. Falls back to the caller's pool if the
/// operating system refuses the threads.
pub(crate) fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    let pool = POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(pass_threads())
            .thread_name(|i| format!("sdp4bit-pass-{i}"))
            .build()
            .ok()
    });
    match pool {
        Some(pool) => pool.install(f),
        None => f(),
    }
}
