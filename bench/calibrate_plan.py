"""Calibrates the cost model of sdp4bit.plan from the emulated cluster's committed measurements
(bench/results/cluster.json) and writes how well it predicts what it was not calibrated on.

    python bench/calibrate_plan.py [--cluster bench/results/cluster.json] [--out bench/results]

The model of one bucket's reduce-scatter plus all-gather (docs/performance.md "The cost
model"): the link part `L = link_ms / eta` is the bytes the core plans over a node's busiest
link at the link rate (`link_ms`, as cluster.py computes it) over the fraction `eta` of the link
the transport achieves; the rest `C` (codec passes on cores shared by the node's ranks,
intra-node copies, per-message costs) does not depend on the link rate. gloo's uncompressed
collectives do their parts one after the other: `T = C + L / eta_gloo`. The compressed presets
pipeline chunks, so their codec work hides behind the link except for a fraction `beta`:
`T = max(C, L) + beta * min(C, L)`.

Calibration: `C` of each preset and topology comes from its measurement at one link rate
(the calibration rate); the three constants `eta_gloo`, `eta` and `beta` come from the other
topology's rows, so no measured row predicts itself. Each row at the other rate is then
predicted and its error reported, for both directions (fast link -> slow, slow -> fast). The
constants written for sdp4bit.plan are fitted on every row, `C` taken at the fastest rate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNCOMPRESSED = "baseline"
#: The grids the constants are searched on.
ETA_GRID = [round(0.30 + 0.01 * i, 2) for i in range(71)]
BETA_GRID = [round(0.02 * i, 2) for i in range(51)]


def predict_ms(rest_ms: float, link_ms: float, preset: str, eta_gloo: float, eta: float,
               beta: float) -> float:
    """The model's time of one bucket's collectives from its rate-independent part and the
    link time at full rate."""
    if preset == UNCOMPRESSED:
        return rest_ms + link_ms / eta_gloo
    wire = link_ms / eta
    return max(rest_ms, wire) + beta * min(rest_ms, wire)


def rest_from(measured_ms: float, link_ms: float, preset: str, eta_gloo: float, eta: float,
              beta: float) -> float:
    """The rate-independent part `C` that makes the model reproduce one measurement (the
    inverse of `predict_ms` in `C`; 0 when the link alone already takes longer)."""
    if preset == UNCOMPRESSED:
        return max(0.0, measured_ms - link_ms / eta_gloo)
    wire = link_ms / eta
    if measured_ms - beta * wire >= wire:
        return measured_ms - beta * wire
    return max(0.0, (measured_ms - wire) / beta) if beta > 0 else 0.0


def _groups(rows: list[dict]) -> dict[tuple[str, str], dict[float, dict]]:
    """Rows by (topology, preset), then by link rate."""
    out: dict[tuple[str, str], dict[float, dict]] = {}
    for r in rows:
        out.setdefault((r["topology"], r["preset"]), {})[r["rate_mbit"]] = r
    return out


def errors(rows: list[dict], constants: tuple[float, float, float],
           calibration_rate: float | None = None) -> list[dict]:
    """Each row's prediction from `C` calibrated on the same preset and topology at
    `calibration_rate` (default: the fastest rate); rows at the calibration rate are left
    out."""
    predictions = []
    for (topology, preset), by_rate in sorted(_groups(rows).items()):
        cal_rate = max(by_rate) if calibration_rate is None else calibration_rate
        if cal_rate not in by_rate:
            continue
        cal = by_rate[cal_rate]
        rest = rest_from(cal["comm_ms"], cal["link_ms"], preset, *constants)
        for rate, r in sorted(by_rate.items()):
            if rate == cal_rate:
                continue
            ms = predict_ms(rest, r["link_ms"], preset, *constants)
            predictions.append({"topology": topology, "preset": preset, "rate_mbit": rate,
                                "calibration_rate_mbit": cal_rate, "measured_ms": r["comm_ms"],
                                "predicted_ms": ms, "error": ms / r["comm_ms"] - 1})
    return predictions


def fit(rows: list[dict], calibration_rate: float | None = None) -> tuple[float, float, float]:
    """(eta_gloo, eta, beta) minimising the largest relative error of `errors(rows, ...,
    calibration_rate)`; the uncompressed and the compressed constants are fitted separately."""
    base = [r for r in rows if r["preset"] == UNCOMPRESSED]
    compressed = [r for r in rows if r["preset"] != UNCOMPRESSED]

    def worst(subset, constants):
        errs = [abs(e["error"]) for e in errors(subset, constants, calibration_rate)]
        return max(errs) if errs else 0.0

    eta_gloo = min(ETA_GRID, key=lambda e: (worst(base, (e, 1.0, 0.0)), -e))
    eta, beta = min(((e, b) for e in ETA_GRID for b in BETA_GRID),
                    key=lambda c: (worst(compressed, (1.0, *c)), -c[0], c[1]))
    return eta_gloo, eta, beta


def cross_validate(rows: list[dict]) -> list[dict]:
    """For every ordered pair of rates and every topology: `C` from the calibration rate, the
    constants from the other topologies' rows; the rows at the other rate predicted."""
    topologies = sorted({r["topology"] for r in rows})
    rates = sorted({r["rate_mbit"] for r in rows})
    out = []
    for held in topologies:
        others = [r for r in rows if r["topology"] != held]
        mine = [r for r in rows if r["topology"] == held]
        if not others:
            continue
        for cal_rate in rates:
            constants = fit(others, cal_rate)
            for e in errors(mine, constants, cal_rate):
                e["constants"] = dict(zip(("eta_gloo", "eta", "beta"), constants))
                out.append(e)
    return out


def load_rows(path: Path) -> list[dict]:
    """The measured rows of cluster.json (one per topology, rate and preset)."""
    data = json.loads(path.read_text())
    return [r for r in data["rows"] if r.get("comm_ms") and r.get("link_ms") is not None]


def write(rows: list[dict], source: Path, out_dir: Path) -> dict:
    """Writes plan_calibration.json (the constants sdp4bit.plan uses, plus every error) and
    plan_calibration.md; returns the JSON document."""
    constants = fit(rows)
    held_out = cross_validate(rows)
    doc = {"source": str(source.relative_to(ROOT) if source.is_relative_to(ROOT) else source),
           "constants": dict(zip(("eta_gloo", "eta", "beta"), constants)),
           "cross_validation": held_out,
           "fit_on_all_rows": errors(rows, constants)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan_calibration.json").write_text(json.dumps(doc, indent=1) + "\n")
    worst = max((abs(e["error"]) for e in held_out), default=0.0)
    lines = [
        "# The cost model against the emulated cluster",
        "",
        f"Command: `python bench/calibrate_plan.py`, reading `{doc['source']}`. Model and "
        "calibration: docs/performance.md \"The cost model\". Constants for sdp4bit.plan (fitted "
        "on every row, rate-independent part at the fastest link): "
        + ", ".join(f"{k} = {v:g}" for k, v in doc["constants"].items()) + ".",
        "",
        "Held out: the rate-independent part of each preset and topology is calibrated at one "
        "link rate, the constants on the other topology's rows; the rows at the other rate are "
        f"predicted. Largest error: {100 * worst:.0f}%.",
        "",
        "| topology | preset | calibrated at | predicted at | measured ms | predicted ms | error "
        "| eta_gloo, eta, beta used |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for e in held_out:
        c = e["constants"]
        lines.append(
            f"| {e['topology']} | {e['preset']} | {e['calibration_rate_mbit'] / 1000:g} Gbit/s "
            f"| {e['rate_mbit'] / 1000:g} Gbit/s | {e['measured_ms']:.1f} | "
            f"{e['predicted_ms']:.1f} | {100 * e['error']:+.0f}% | "
            f"{c['eta_gloo']:g}, {c['eta']:g}, {c['beta']:g} |")
    (out_dir / "plan_calibration.md").write_text("\n".join(lines) + "\n")
    return doc


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", type=Path, default=ROOT / "bench/results/cluster.json")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = p.parse_args(argv)
    doc = write(load_rows(args.cluster), args.cluster.resolve(), args.out)
    print(json.dumps(doc["constants"]))


if __name__ == "__main__":
    main()
