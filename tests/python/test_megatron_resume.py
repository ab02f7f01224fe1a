"""A resumed megatron-core run continues as if never stopped, and weights loaded outside the
optimizer step never make the replicas diverge silently (gloo on CPU)."""

import megatron_resume_scenarios as rs
from harness import run_ranks

ENV = {"LOCAL_WORLD_SIZE": "2"}
STEPS, SAVE_AT = 4, 2


def test_a_resumed_run_continues_bit_for_bit_from_fresh_processes(tmp_path):
    # W = 2: train 2 steps and save through dist_checkpointing (the model chunk's sharded state
    # dict holds sdp4bit's step counters); fresh processes from another seed load it and train
    # 2: losses and every parameter on every rank equal the uninterrupted 4-step run's, replicas
    # identical after every step. The control leaves sdp4bit's entry out of the load: the
    # counters restart at 0, the random streams replay the first steps', and the run differs.
    directory = str(tmp_path)
    straight = run_ranks(2, rs.resume, STEPS, SAVE_AT, directory, "straight", env=ENV)
    resumed = run_ranks(2, rs.resume, STEPS, SAVE_AT, directory, "resume", env=ENV)
    dropped = run_ranks(2, rs.resume, STEPS, SAVE_AT, directory, "resume without steps", env=ENV)
    for (losses, same, params), (r_losses, r_same, r_params), (d_losses, d_same, d_params) in zip(
            straight, resumed, dropped):
        assert all(same) and all(r_same) and all(d_same), (same, r_same, d_same)
        assert r_losses == losses[SAVE_AT:] and r_params == params
        assert d_params != params and d_losses != losses[SAVE_AT:]


def test_weights_loaded_outside_the_step_re_establish_the_references():
    # W = 2, the weights after step 0 loaded again before step 2 (a best-model reload): through
    # load_state_dict, sdp4bit sees it and re-establishes qWD's references, so the replicas
    # stay identical; the control copies them in behind its back, and the stale references
    # make the replicas differ; loading different weights on one rank is a clear error.
    for identical, error in run_ranks(2, rs.reload_weights, "load_state_dict", 4, 2, env=ENV):
        assert identical == [True] * 4 and error is None, (identical, error)
    for identical, error in run_ranks(2, rs.reload_weights, "behind its back", 4, 2, env=ENV):
        assert identical[:2] == [True] * 2 and not all(identical[2:]) and error is None
    for identical, error in run_ranks(2, rs.reload_weights, "different on rank 1", 4, 2,
                                      env=ENV):
        assert identical == [True] * 2, identical
        assert error and "DP ranks [1] hold different parameters than DP rank 0 after its " \
            "parameters were loaded outside the optimizer step (load_state_dict)" in error, error
