//! The size of the host passes' thread pool (`backend::cpu::pool::pass_threads`): rayon's
//! variable wins, else the cores divided among the node's rank processes. Its own test binary,
//! because it changes the process environment.

use sdp4bit::backend::cpu::pool::pass_threads;

#[test]
fn pass_threads_share_the_cores_among_the_ranks_of_a_node() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY (every set_var/remove_var below): this binary's only test, one thread.
    unsafe {
        std::env::remove_var("RAYON_NUM_THREADS");
        std::env::remove_var("LOCAL_WORLD_SIZE");
    }
    assert_eq!(pass_threads(), cores, "one process per node: every core");
    for ranks in [1, 2, 3, 4, 64] {
        unsafe { std::env::set_var("LOCAL_WORLD_SIZE", ranks.to_string()) };
        assert_eq!(
            pass_threads(),
            (cores / ranks).max(1),
            "{ranks} ranks per node"
        );
    }
    for bad in ["0", "x", ""] {
        unsafe { std::env::set_var("LOCAL_WORLD_SIZE", bad) };
        assert_eq!(pass_threads(), cores, "LOCAL_WORLD_SIZE={bad:?} is ignored");
    }
    unsafe { std::env::set_var("RAYON_NUM_THREADS", "3") };
    assert_eq!(pass_threads(), 3, "RAYON_NUM_THREADS wins");
}
