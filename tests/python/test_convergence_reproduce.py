"""The reproduction check of the kept convergence study (bench/convergence_reproduce.py): its
comparison sees a one-ulp difference, and its verdicts follow the probe, without training
anything (the test command runs the real check on the kept runs)."""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import convergence_reproduce as reproduce  # noqa: E402

KEPT = Path(__file__).resolve().parents[2] / "bench/results/convergence.json"


def test_a_one_ulp_difference_is_found_at_its_step():
    kept = [5.375684976577759, 5.395283222198486, 5.266354560852051]
    assert reproduce.first_difference(list(kept), kept) is None
    assert reproduce.first_difference(kept[:2], kept) is None  # a shorter rerun
    nudged = [kept[0], math.nextafter(kept[1], math.inf), kept[2]]
    assert reproduce.first_difference(nudged, kept).startswith("step 1:")
    assert "4 steps" in reproduce.first_difference(kept + [1.0], kept)


def test_the_kept_pairs_and_their_arguments_are_in_the_study():
    runs = json.loads(KEPT.read_text())["runs"]
    for pair in (*reproduce.PAIRS, ("baseline", "SDP4Bit")):  # the default and the TP = 1 pair
        for name in pair:
            script, args = reproduce.kept_arguments(runs[name][reproduce.SEED])
            assert script.exists(), script
            assert args[args.index("--seed") + 1] == reproduce.SEED, name
            assert args[args.index("--data-seeding") + 1] == "offset", name


def _runs(reference_losses, compressed_losses):
    run = {"ran_with": ["examples/gpt_cpu/train.py", "--seed", "1"]}
    return {"ref": {"1": {**run, "train_loss": reference_losses}},
            "cmp": {"1": {**run, "train_loss": compressed_losses}}}


def _fake_reruns(monkeypatch, results):
    """Replaces the reruns by `results`, popped in order; returns the steps asked for."""
    asked = []

    def rerun(launcher, kept_run, steps, work):
        asked.append(steps)
        return results.pop(0)[:steps]

    monkeypatch.setattr(reproduce, "rerun", rerun)
    return asked


def test_a_differing_first_loss_makes_the_pair_not_comparable(monkeypatch):
    asked = _fake_reruns(monkeypatch, [[5.0]])
    verdict = reproduce.check_pair(_runs([5.5, 5.4], [5.5, 5.3]), ("ref", "cmp"), 2, None, None)
    assert asked == [1]
    assert not verdict.comparable and not verdict.problems
    assert "not comparable" in verdict.note


def test_a_rerun_that_differs_later_is_a_problem_named_by_row_and_step(monkeypatch):
    asked = _fake_reruns(monkeypatch, [[5.5], [5.5, 5.4], [5.5, 5.31]])
    verdict = reproduce.check_pair(_runs([5.5, 5.4], [5.5, 5.3]), ("ref", "cmp"), 2, None, None)
    assert asked == [1, 2, 2]
    assert verdict.comparable
    assert verdict.problems == ("cmp seed 1: step 1: loss 5.31 against the kept 5.3",)


def test_the_exit_status_fails_on_a_difference_and_on_nothing_comparable_when_required(
        monkeypatch, tmp_path, capsys):
    kept = tmp_path / "kept.json"
    kept.write_text(json.dumps({"runs": _runs([5.5, 5.4], [5.5, 5.3])}))
    monkeypatch.setattr(reproduce, "study_launcher", lambda: None)
    args = ["--kept", str(kept), "--steps", "2", "--pairs", "ref,cmp"]
    _fake_reruns(monkeypatch, [[5.5], [5.5, 5.4], [5.5, 5.3]])
    assert reproduce.main(args) == 0
    _fake_reruns(monkeypatch, [[5.5], [5.5, 5.4], [5.5, 5.31]])
    assert reproduce.main(args) == 1
    _fake_reruns(monkeypatch, [[5.0]])
    assert reproduce.main(args) == 0
    _fake_reruns(monkeypatch, [[5.0]])
    assert reproduce.main([*args, "--require"]) == 1
    assert "does not reproduce" in capsys.readouterr().out
