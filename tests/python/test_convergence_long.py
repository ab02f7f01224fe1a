"""The long convergence study (bench/convergence_long.py): its rows and controls, the verdicts
its report draws from runs, and the committed report, without training anything."""

import argparse
import datetime
import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import convergence  # noqa: E402
import convergence_long as study  # noqa: E402
from convergence import BASELINE, Row, select_rows  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "long"


def test_the_null_control_changes_only_the_rounding_seed_of_sdp4bit():
    null, sdp4bit = study.ROWS[study.NULL], study.ROWS[study.SDP4BIT]
    assert null.reference == study.SDP4BIT and sdp4bit.reference == BASELINE
    first, second = null.run_args(1), null.run_args(2)
    assert first[:-2] == sdp4bit.run_args(1) == ("--preset", "sdp4bit")
    assert first[-2] == "--knob" and first[-1].startswith("seed=")
    rounding = {int(args[-1].split("=")[1]) for args in (first, second)}
    assert len(rounding) == 2 and not rounding & {1, 2}  # neither the run's seed nor shared
    assert null.script_args(1, 5, [], Path("r.json"))[2:6] == [*first][:4]


def test_every_row_is_judged_against_the_baseline_but_the_null_control():
    for name, row in study.ROWS.items():
        assert row.script == convergence.TRAIN
        assert row.reference == (study.SDP4BIT if name == study.NULL else BASELINE)
    for name, group in ((study.POSITIVE_SHARD, 65536), (study.POSITIVE_4096, 4096)):
        assert study.ROWS[name].args == ("--preset", "sdp4bit", "--knob", "weight_codec=qw",
                                         "--knob", "grad_codec=none", "--knob", "weight_bits=8",
                                         "--knob", f"weight_group_size={group}")
    assert set(study.POSITIVE_CONTROLS) == {study.POSITIVE_SHARD, study.POSITIVE_4096}
    # A reference may be a compared row, if the chain ends at a reference row ...
    assert [r.name for r in select_rows([BASELINE, study.SDP4BIT, study.NULL], study.ROWS)]
    with pytest.raises(ValueError, match="add 'SDP4Bit' to --rows"):
        select_rows([BASELINE, study.NULL], study.ROWS)
    # ... and never a circle.
    table = {"a": Row("a", (), reference="b"), "b": Row("b", (), reference="a")}
    with pytest.raises(ValueError, match="circle: a -> b -> a"):
        select_rows(["a", "b"], table)


def _run(val_loss: float, steps: int = 12) -> dict:
    return {"val_loss": val_loss, "train_loss": [3.0 - 0.1 * i for i in range(steps)],
            "step_ms": [1.0] * steps, "sent": 10, "uncompressed": 40, "grad_rel_l2": [0.1],
            "param_rel_l2": [0.01], "seconds": 80.0}


def _runs(small: float, large: float = 0.02, seeds: int = 12, spread: float = 0.002) -> dict:
    """Fake runs: each row's loss the baseline's times (1 + effect + noise); the positive
    controls' effects `small` (qW8/4096) and `large` (qW8/shard)."""
    rng = random.Random(7)
    base = {s: 2.0 + 0.05 * rng.gauss(0, 1) for s in range(1, seeds + 1)}
    effects = {name: 0.0 for name in study.ROWS}
    effects[study.POSITIVE_4096], effects[study.POSITIVE_SHARD] = small, large
    runs = {name: {} for name in study.ROWS}
    for seed, loss in base.items():
        for name in study.ROWS:
            noise = 0.0 if name == BASELINE else spread * rng.gauss(0, 1)
            runs[name][seed] = _run(loss * (1 + effects[name] + noise))
    return runs


def _report(runs: dict, tmp_path: Path) -> str:
    args = argparse.Namespace(steps=12, val_tokens=4096, out=tmp_path)
    rows = select_rows(list(study.ROWS), study.ROWS)
    return study.report(args, rows, runs, datetime.datetime.now(datetime.timezone.utc), 1.0)


def test_the_design_is_valid_only_where_a_positive_control_in_range_separates(tmp_path):
    seen = _report(_runs(0.005), tmp_path)
    assert "- **The design can see an effect in that range** (valid)." in seen
    assert seen.count("**separated from zero**, its effect inside the 0.25-1% range.") == 1
    assert "**separated from zero**, its effect outside the 0.25-1% range." in seen  # 2%
    assert "no verdict above is evidence" not in seen
    # The control of the control: the in-range control without its effect, so only the 2%
    # one separates, which does not show the design sees 0.25-1%; the report says so.
    blind = _report(_runs(0.0), tmp_path)
    assert "(invalid: its non-inferiority verdicts are not evidence)" in blind
    assert "**No positive control in the range separated: no verdict above is evidence.**" in blind


def test_the_report_gives_each_rows_bound_and_the_seeds_power_asks_for(tmp_path):
    runs = _runs(0.005)
    text = _report(runs, tmp_path)
    for name in (study.SDP4BIT, "TLq", "TLq-HS", "qWD", *study.POSITIVE_CONTROLS, study.NULL):
        assert f"| {name} | 12 | " in text
    # A spread of 0.2% against a margin of 0.25%: a handful of seeds suffices ...
    assert "| SDP4Bit | 12 | baseline" in text and "| yes |" in text
    deltas, _ = study.relative_differences(study.ROWS[study.SDP4BIT], runs)
    needed = study.seeds_for_non_inferiority(study.statistics.stdev(deltas), convergence.MARGIN)
    assert f"with probability 80%: **{needed}** (this run: 12)" in text
    # ... and the positive control is refused at the margin.
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| {study.POSITIVE_4096} |")]
    assert "| no |" in line
    assert "steps 0-1 | steps 2-3" in text  # six spans of 12 steps


def test_the_deciding_rows_bounds_are_corrected_for_being_tested_together(tmp_path):
    runs = _runs(0.005)
    rows = select_rows(list(study.ROWS), study.ROWS)
    (line, blank) = study.corrected_bounds(rows, runs)
    assert line.startswith("Corrected for testing the 4 deciding rows together (Bonferroni: "
                           "one-sided 98.75% bounds): SDP4Bit +") and blank == ""
    deltas, _ = study.relative_differences(study.ROWS["qWD"], runs)
    corrected = study.upper_bound(deltas, 0.9875)
    assert corrected > study.upper_bound(deltas)  # wider than the row's own bound
    assert f"qWD {100 * corrected:+.2f}%" in line and line.endswith("all under the margin.")
    assert line in _report(runs, tmp_path)
    # A deciding row 1% worse is named apart; a lone deciding row needs no correction.
    for seed in runs["TLq"]:
        runs["TLq"][seed] = _run(runs[BASELINE][seed]["val_loss"] * 1.01)
    assert study.corrected_bounds(rows, runs)[0].endswith(
        "under the margin: SDP4Bit, TLq-HS, qWD.")
    assert study.corrected_bounds(select_rows([BASELINE, study.SDP4BIT], study.ROWS), runs) == []


def test_the_difference_along_training_is_taken_span_by_span():
    runs = {BASELINE: {1: _run(2.0), 2: _run(2.0)}, study.SDP4BIT: {}}
    for seed in (1, 2):
        losses = [2.0] * 6 + [2.2] * 6  # 10% worse in the second half only
        runs[study.SDP4BIT][seed] = {**_run(2.0), "train_loss": losses}
        runs[BASELINE][seed] = {**_run(2.0), "train_loss": [2.0] * 12}
    spans = study.along_training(study.ROWS[study.SDP4BIT], runs, 2)
    assert [span for span, _ in spans] == [(0, 6), (6, 12)]
    assert [d.mean for _, d in spans] == pytest.approx([0.0, 0.1])


def test_flattening_is_the_fall_of_the_seed_average_over_the_last_span():
    steps = 600
    curve = [2.0 + 1000.0 / (step + 100) for step in range(steps)]  # falls ever slower
    runs = {BASELINE: {seed: {"train_loss": [v + 0.01 * (-1) ** seed for v in curve]}
                       for seed in (1, 2)}}  # opposite offsets: the average is the curve
    means, fall = study.flattening(runs, BASELINE, 6)
    assert means == pytest.approx([sum(curve[i:i + 100]) / 100 for i in range(0, steps, 100)])
    # The slope of 1000 / (step + 100) over steps 500-599, near its value at 550: 1000 / 650^2.
    assert fall == pytest.approx(100 * 1000 / 650 ** 2, rel=0.01)
    line = study.flattening_line(runs)
    assert f"falls {fall:.4f} per 100 steps" in line
    assert f"{fall / means[-1] / study.MARGIN:.1f} times the margin" in line
    flat = {BASELINE: {1: {"train_loss": [2.0] * steps}, 2: {"train_loss": [2.0] * steps}}}
    assert study.flattening(flat, BASELINE, 6)[1] == pytest.approx(0.0, abs=1e-12)


def test_only_seeds_every_row_kept_are_reported(tmp_path):
    rows = select_rows([BASELINE, study.SDP4BIT], study.ROWS)
    common = study.common_args(12, 4096)
    assert common[-2:] == ["--width", "64"]
    text = convergence.training_text_digest()
    for row, seed in ((rows[0], 1), (rows[1], 1), (rows[0], 2)):
        run = {**_run(2.0), "ran_with": convergence.ran_with_args(row, seed, 12, common),
               "training_text": text}
        convergence.run_file(row, seed, tmp_path).write_text(json.dumps(run))
    kept = study.kept_whole_seeds(rows, [1, 2], 12, 4096, tmp_path)
    assert {name: sorted(by_seed) for name, by_seed in kept.items()} == {
        BASELINE: [1], study.SDP4BIT: [1]}
    assert study.kept_whole_seeds(rows, [1], 13, 4096, tmp_path)[BASELINE] == {}  # other args
    # A run another Python trained (another standard library, other bytes) is not reused.
    path = convergence.run_file(rows[1], 1, tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "training_text": "other"}))
    assert study.kept_whole_seeds(rows, [1], 12, 4096, tmp_path)[BASELINE] == {}


def test_lag_one_autocorrelation_sees_a_shared_stream():
    rng = random.Random(3)
    independent = [rng.gauss(0, 1) for _ in range(4000)]
    shared = [a + b for a, b in zip(independent, independent[1:])]  # neighbours share a draw
    assert abs(study.lag_one_autocorrelation(independent)) < 0.05
    assert study.lag_one_autocorrelation(shared) == pytest.approx(0.5, abs=0.05)


def test_the_committed_report_is_the_one_its_runs_give():
    kept = json.loads((RESULTS / "convergence_long.json").read_text())["runs"]
    runs = {name: {int(s): r for s, r in by_seed.items()} for name, by_seed in kept.items()}
    rows = select_rows(list(runs), study.ROWS)
    text = (RESULTS / "convergence_long.md").read_text()
    for table in (study.row_table(rows, runs), study.controls(runs)[0],
                  study.power_lines(runs, len(runs[BASELINE])), study.training_table(rows, runs),
                  [study.flattening_line(runs)], study.corrected_bounds(rows, runs)):
        assert "\n".join(table) in text
