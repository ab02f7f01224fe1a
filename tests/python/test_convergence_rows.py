"""The convergence study's rows (bench/convergence.py): each row is paired with its reference
row, a baseline trained by the same script, without training anything."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import convergence  # noqa: E402
from convergence import BASELINE, FSDP_BASELINE, ROWS, TP_BASELINE, Row, select_rows  # noqa: E402
from rank_launcher import Finished  # noqa: E402  (megatron_on_cpu, on the path convergence set)


def test_every_row_is_differenced_against_a_reference_row_of_its_own_script():
    for row in ROWS.values():
        reference = ROWS[row.reference]
        assert reference.is_reference and reference.script == row.script, row.name
    assert ROWS["SDP4Bit"].reference == BASELINE and ROWS[BASELINE].is_reference
    fsdp = [row for row in ROWS.values() if row.script == convergence.FSDP_TRAIN]
    assert {row.name for row in fsdp} == {FSDP_BASELINE, "FSDP2 QSDP", "FSDP2 SDP4Bit"}
    assert all(row.reference == FSDP_BASELINE for row in fsdp)
    assert ROWS[FSDP_BASELINE].args == ("--preset", "baseline")
    assert ROWS["FSDP2 QSDP"].args == ("--preset", "qsdp")
    assert ROWS["FSDP2 SDP4Bit"].args == ("--preset", "sdp4bit")  # TLq-HS grads, QSDP weights


def test_the_tp2_rows_pair_sdp4bit_with_megatrons_collectives_at_tp2_on_2_nodes():
    assert list(ROWS)[-7:-5] == [TP_BASELINE, "SDP4Bit TP=2"]  # after ZeRO++-style
    assert ROWS[TP_BASELINE].is_reference and ROWS["SDP4Bit TP=2"].reference == TP_BASELINE
    assert ROWS[TP_BASELINE].args == ("--preset", "baseline", *convergence.TP2)
    assert ROWS["SDP4Bit TP=2"].args == ("--preset", "sdp4bit", *convergence.TP2)
    assert convergence.TP2 == ("--tp", "2", "--batch", "16")  # 32 sequences a step, as at DP = 4
    assert ROWS["SDP4Bit TP=2"].script == convergence.TRAIN
    args = ROWS["SDP4Bit TP=2"].script_args(1, 400, [], Path("run.json"))
    assert args[:6] == ["--ranks-per-node", "2", "--preset", "sdp4bit", "--tp", "2"]
    with pytest.raises(ValueError, match="'SDP4Bit TP=2' is differenced against 'baseline TP=2'"):
        select_rows([BASELINE, "SDP4Bit TP=2"])


def test_the_hybrid_rows_pair_sdp4bit_with_megatrons_partial_distributed_optimizer():
    hybrid = convergence.HYBRID_BASELINE
    assert list(ROWS)[-5:-3] == [hybrid, "SDP4Bit hybrid"]  # after the TP = 2 rows
    assert ROWS[hybrid].is_reference and ROWS["SDP4Bit hybrid"].reference == hybrid
    assert ROWS[hybrid].args == ("--preset", "baseline", "--instances", "2")
    assert ROWS["SDP4Bit hybrid"].args == ("--preset", "sdp4bit", "--instances", "2")
    with pytest.raises(ValueError, match="'SDP4Bit hybrid' is differenced against"):
        select_rows([BASELINE, "SDP4Bit hybrid"])


def test_a_row_needs_its_reference_among_the_selected_rows():
    assert [r.name for r in select_rows(["FSDP2 QSDP", FSDP_BASELINE])] == ["FSDP2 QSDP",
                                                                           FSDP_BASELINE]
    assert [r.name for r in select_rows([FSDP_BASELINE])] == [FSDP_BASELINE]
    with pytest.raises(ValueError, match="'FSDP2 QSDP' is differenced against 'FSDP2'"):
        select_rows([BASELINE, "FSDP2 QSDP"])
    with pytest.raises(ValueError, match="'SDP4Bit' is differenced against 'baseline'"):
        select_rows([FSDP_BASELINE, "SDP4Bit"])
    with pytest.raises(ValueError, match="unknown rows"):
        select_rows([BASELINE, "nope"])
    with pytest.raises(ValueError, match="rows repeat"):
        select_rows([BASELINE, BASELINE])


def test_a_reference_must_be_a_row_of_the_same_script_whose_chain_ends_at_a_reference():
    table = {"a": Row("a", (), reference="a"), "b": Row("b", (), reference="a"),
             "c": Row("c", (), convergence.FSDP_TRAIN, reference="a"),
             "d": Row("d", (), reference="b")}
    assert [r.name for r in select_rows(["a", "b"], table)] == ["a", "b"]
    with pytest.raises(ValueError, match="must be a row of the same script"):
        select_rows(["a", "c"], table)
    # d against b against a: the null control's shape (bench/convergence_long.py)
    assert [r.name for r in select_rows(["a", "b", "d"], table)] == ["a", "b", "d"]


def _run(val_loss: float, train_loss: list[float], sent: int = 0) -> dict:
    return {"val_loss": val_loss, "train_loss": train_loss, "step_ms": [1.0] * len(train_loss),
            "sent": sent, "uncompressed": 4 * sent, "grad_rel_l2": [], "param_rel_l2": [],
            "seconds": 1.0}


def test_each_row_is_differenced_seed_by_seed_from_its_own_reference():
    # Two scripts' losses far apart; within each, a constant difference per seed.
    runs = {
        BASELINE: {1: _run(2.0, [3.0, 2.0]), 2: _run(2.2, [3.2, 2.2])},
        "SDP4Bit": {1: _run(2.01, [3.0, 2.01], 10), 2: _run(2.21, [3.2, 2.21], 10)},
        FSDP_BASELINE: {1: _run(3.0, [4.0, 3.0]), 2: _run(3.4, [4.4, 3.4])},
        "FSDP2 QSDP": {1: _run(3.03, [4.1, 3.03], 10), 2: _run(3.43, [4.5, 3.43], 10)},
    }
    rows = select_rows(list(runs))
    summary = convergence.summarize(rows, runs)
    assert summary["SDP4Bit"]["reference"] == BASELINE
    assert summary["SDP4Bit"]["difference"]["mean"] == pytest.approx(0.01)
    assert summary["SDP4Bit"]["difference"]["half_width"] == pytest.approx(0.0, abs=1e-9)
    assert summary["SDP4Bit"]["relative_difference"]["mean"] == pytest.approx(0.01 / 2.1)
    fsdp = summary["FSDP2 QSDP"]
    assert fsdp["reference"] == FSDP_BASELINE  # not +1.03 against the Megatron baseline
    assert fsdp["difference"]["mean"] == pytest.approx(0.03)
    assert fsdp["relative_difference"]["mean"] == pytest.approx(0.03 / 3.2)
    assert fsdp["bytes_ratio"] == pytest.approx(0.25)
    for name in (BASELINE, FSDP_BASELINE):
        assert summary[name]["difference"]["mean"] == 0.0
    curves = convergence.difference_curves(rows, runs, window=1)
    assert [d.mean for d in curves["FSDP2 QSDP"]] == pytest.approx([0.1, 0.03])
    assert [d.mean for d in curves["SDP4Bit"]] == pytest.approx([0.0, 0.01])


class FakeLauncher:
    """Stands in for the rank launcher without training: records each run's (preset, seed)
    and writes the run's JSON with the validation loss `loss(preset, seed)`."""

    def __init__(self, loss=lambda preset, seed: 2.0):
        self.loss, self.launched = loss, []

    def run(self, script, args, world, cwd, timeout):
        assert world == 4 and Path(cwd).is_dir() and timeout > 0
        preset, seed = args[args.index("--preset") + 1], int(args[args.index("--seed") + 1])
        self.launched.append((preset, seed))
        value = self.loss(preset, seed)
        Path(args[args.index("--json-out") + 1]).write_text(json.dumps(_run(value,
                                                                             [3.0, value])))
        return Finished(0, "")


def test_the_study_runs_seed_after_seed_and_resumes_from_kept_runs(tmp_path):
    launcher = FakeLauncher()
    rows = select_rows([BASELINE, "SDP4Bit"])
    common = convergence.common_args(2, 4096)
    seeds = convergence.row_seeds(rows, [1, 2], [1, 2])
    runs = convergence.run_study(rows, seeds, 2, common, tmp_path, launcher)
    # whole seeds first
    assert launcher.launched == [("baseline", 1), ("sdp4bit", 1), ("baseline", 2),
                                 ("sdp4bit", 2)]
    assert set(runs) == {BASELINE, "SDP4Bit"} and set(runs["SDP4Bit"]) == {1, 2}
    assert runs["SDP4Bit"][2]["ran_with"][:3] == ["examples/gpt_cpu/train.py", "--preset",
                                                  "sdp4bit"]
    launcher.launched.clear()
    convergence.run_study(rows, seeds, 2, common, tmp_path, launcher)
    assert launcher.launched == []  # every result kept with the same arguments is reused
    convergence.run_study(rows, seeds, 3, convergence.common_args(3, 4096), tmp_path, launcher)
    assert len(launcher.launched) == 4  # other arguments: run again


def test_a_failed_run_stops_the_study_with_its_ranks_output(tmp_path):
    class Failing:
        def run(self, script, args, world, cwd, timeout):
            return Finished(3, "--- rank 1 ---\nrank 1 gives up\n")

    rows = select_rows([BASELINE])
    with pytest.raises(SystemExit, match="baseline seed 1 failed \\(exit 3\\)"
                                         ":\n--- rank 1 ---\nrank 1 gives up"):
        convergence.run_study(rows, {BASELINE: [1]}, 2, convergence.common_args(2, 4096),
                              tmp_path, Failing())


def test_the_report_says_how_many_seeds_a_half_percent_interval_needs(tmp_path):
    import argparse
    import datetime

    from convergence_stats import seeds_for_width

    runs = {BASELINE: {s: _run(2.0, [3.0, 2.0]) for s in (1, 2, 3)},
            "SDP4Bit": {1: _run(2.01, [3.0, 2.01], 10), 2: _run(1.99, [3.0, 1.99], 10),
                        3: _run(2.03, [3.0, 2.03], 10)}}
    rows = select_rows(list(runs))
    summary = convergence.summarize(rows, runs)
    assert summary["SDP4Bit"]["difference_spread"] == pytest.approx(0.02)
    args = argparse.Namespace(steps=2, seeds="1,2,3", deciding_seeds="1,2,3", val_tokens=4096,
                              out=tmp_path)
    text = convergence.report(args, rows, runs, summary,
                              datetime.datetime.now(datetime.timezone.utc), 6.0)
    needed = seeds_for_width(0.02, 0.005 * 2.0)
    assert needed > 3
    assert (f"(standard deviation 0.0200), a full width under 0.5% needs {needed} seeds "
            "(this run has 3)" in text)
    assert "half-width NOT under 0.5%" in text
    # Differences +0.5%, -0.5%, +1.5%: mean +0.5%, bound +0.5% + t(0.95, 2) 1% / sqrt(3).
    assert "| SDP4Bit | 3 | baseline (2.0000) | +0.50% | +2.19% | no |" in text


def test_non_inferiority_separates_a_row_inside_the_margin_from_one_outside():
    # The control: the same spread, shifted by a full margin, must be refused.
    spread = [-0.001, 0.0, 0.001, -0.0005, 0.0005]
    inside = {s: _run(2.0 * (1 + d), [3.0], 10) for s, d in enumerate(spread, 1)}
    outside = {s: _run(2.0 * (1 + d + convergence.MARGIN), [3.0], 10)
               for s, d in enumerate(spread, 1)}
    base = {s: _run(2.0, [3.0]) for s in inside}
    for by_seed, verdict in ((inside, "yes"), (outside, "no")):
        runs = {BASELINE: base, "SDP4Bit": by_seed}
        (line,) = convergence.non_inferiority(select_rows(list(runs)), runs)[2:]
        assert line.endswith(f"| {verdict} |"), line


def test_the_committed_non_inferiority_table_is_the_one_its_runs_give():
    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    runs = json.loads((results / "convergence.json").read_text())["runs"]
    table = convergence.non_inferiority(select_rows(list(runs)), runs)
    assert "\n".join(table) in (results / "convergence.md").read_text()


def test_the_deciding_rows_run_more_seeds_and_every_row_pairs_over_its_own(tmp_path):
    launcher = FakeLauncher(
        lambda preset, seed: 2.0 + 0.01 * seed + (0.001 * seed if preset == "sdp4bit" else 0.0))
    rows = select_rows([BASELINE, "SDP4Bit", "QSDP"])
    with pytest.raises(ValueError, match=r"lacks seeds \[3\]"):
        convergence.row_seeds(rows, [1, 2, 3], [1, 2, 4])
    seeds = convergence.row_seeds(rows, [1, 2], [1, 2, 3, 4])
    assert seeds == {BASELINE: [1, 2, 3, 4], "SDP4Bit": [1, 2, 3, 4], "QSDP": [1, 2]}
    runs = convergence.run_study(rows, seeds, 2, convergence.common_args(2, 4096), tmp_path,
                                 launcher)
    # Seed after seed; the extra seeds only for the deciding rows.
    assert launcher.launched == [("baseline", 1), ("sdp4bit", 1), ("qsdp", 1),
                                 ("baseline", 2), ("sdp4bit", 2), ("qsdp", 2),
                                 ("baseline", 3), ("sdp4bit", 3), ("baseline", 4),
                                 ("sdp4bit", 4)]
    summary = convergence.summarize(rows, runs)
    assert [summary[n]["seeds"] for n in (BASELINE, "SDP4Bit", "QSDP")] == [4, 4, 2]
    # SDP4Bit is 0.001 x seed above the baseline: its mean difference over seeds 1-4 is
    # 0.0025; QSDP equals the baseline on its own seeds, though the baseline has more.
    assert summary["SDP4Bit"]["difference"]["mean"] == pytest.approx(0.0025)
    assert summary["QSDP"]["difference"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert summary["QSDP"]["difference"]["half_width"] == pytest.approx(0.0, abs=1e-12)
