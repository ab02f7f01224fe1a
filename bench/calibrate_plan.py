"""Calibrates the cost model of sdp4bit.plan on the emulated cluster's measurements
(bench/results/cluster_cpu.json: each preset's time and each rank's CPU per call) and writes how
well it predicts what it was not calibrated on.

    python bench/calibrate_plan.py [--measurements bench/results/cluster_cpu.json] \\
        [--out bench/results]

The model of one bucket's reduce-scatter plus all-gather (docs/performance.md "The cost
model", `sdp4bit.plan.collective_ms`) has two measured inputs per row and six constants:
- `cpu_ms`, the CPU one rank spends per call (its threads' scheduler accounting, by
  bench/cluster_cpu.py), which takes `cpu_ms x (1 + (R / c - 1) / kappa)` of wall time when R
  ranks share c cores (R > c): the rank's own work plus the others' it queues behind, at the
  fraction `kappa` of the cores' time the ranks get;
- the link time, the bytes a node's busiest link carries per call at the link's rate (on the
  emulated cluster as its interface counted them, headers included: `wire_bytes`; else the
  bytes the core plans, `link_ms`), which the transport runs at the fraction `eta`
  (compressed presets' exchanges) or `eta_gloo` (gloo's uncompressed collectives) of that
  rate;
- CPU and link overlap: the longer of the two plus the fraction `beta` (`beta_gloo`) of the
  shorter;
- part of a rank's CPU grows with the time its bytes spend on the wire (TCP wake-ups while a
  shaped link drains): `gamma` ms of CPU per ms of link time, the slope of each preset's CPU
  per call between the two rates against its link time's change (least squares through the
  origin over every preset and topology measured at both rates), so a row's CPU measured at
  one rate is carried to another as `cpu + gamma x (link there - link here)`.

Held out: each row is predicted from its preset's CPU accounting and link bytes at the other
link rate (same topology) with the constants fitted on every other row (least squares of the relative error
over a grid), so nothing timed for that preset at that topology and rate is used; and each
topology's rows from the constants fitted on the other topology alone. The constants written
for sdp4bit.plan are fitted on every row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from sdp4bit.plan import Transport, bucket_link_ms, collective_ms

ROOT = Path(__file__).resolve().parent.parent
UNCOMPRESSED = "baseline"
CONSTANTS = ("kappa", "eta", "beta", "eta_gloo", "beta_gloo", "gamma")
#: The grids the constants are searched on.
KAPPA_GRID = np.round(np.arange(0.40, 1.2001, 0.02), 2)
ETA_GRID = np.round(np.arange(0.30, 1.2001, 0.01), 2)
BETA_GRID = np.round(np.arange(0.0, 1.0001, 0.02), 2)


def transport(constants: dict) -> Transport:
    """sdp4bit.plan's Transport of a set of constants."""
    return Transport(link_fraction=constants["eta"],
                     uncompressed_link_fraction=constants["eta_gloo"],
                     unhidden_codec=constants["beta"],
                     uncompressed_unhidden=constants["beta_gloo"],
                     core_share=constants["kappa"], wire_cpu=constants["gamma"])


def default_constants() -> dict:
    """The constants sdp4bit.plan uses by default (its Transport's defaults)."""
    t = Transport()
    return {"kappa": t.core_share, "eta": t.link_fraction,
            "beta": t.unhidden_codec, "eta_gloo": t.uncompressed_link_fraction,
            "beta_gloo": t.uncompressed_unhidden, "gamma": t.wire_cpu}


def ranks_per_core(row: dict, cores: int) -> float:
    """The emulated cluster's ranks (nodes x ranks per node) per core of the machine."""
    nodes, per_node = (int(x) for x in row["topology"].split("x"))
    return nodes * per_node / cores


def wire_ms(row: dict, rate_mbit: float | None = None) -> float:
    """The link time at `rate_mbit` (default: the row's) of the bytes the row's busiest node
    link carried per call, as its interface counted them (`wire_bytes`, bench/cluster_cpu.py);
    rows without that count (measured before it was recorded) use the bytes the core plans
    (`link_ms`)."""
    rate = row["rate_mbit"] if rate_mbit is None else rate_mbit
    if row.get("wire_bytes"):
        return row["wire_bytes"] * 8e-3 / rate
    return row["link_ms"] * row["rate_mbit"] / rate


def predict_ms(row: dict, cpu: float, constants: dict, cores: int,
               link_ms: float | None = None, cpu_link_ms: float | None = None) -> float:
    """The model's time of `row`'s collectives from a rank's CPU per call `cpu`, measured where
    the link time was `cpu_link_ms` (default: `link_ms`), and the link time `link_ms` (default:
    the row's, `wire_ms`): the CPU's part that grows with the time on the wire (gamma) is
    carried from the one link time to the other."""
    link = wire_ms(row) if link_ms is None else link_ms
    measured_at = link if cpu_link_ms is None else cpu_link_ms
    work = cpu - constants["gamma"] * measured_at
    return collective_ms(work, link, row["preset"] != UNCOMPRESSED, transport(constants),
                         ranks_per_core(row, cores))


def _errors(rows: list[dict], cpu: list[float], kappa: float, cores: int) -> np.ndarray:
    """Sum over `rows` of the model's squared relative error at `kappa`, for every overlap in
    BETA_GRID and link fraction in ETA_GRID: an array (beta, eta)."""
    if not rows:
        return np.zeros((len(BETA_GRID), len(ETA_GRID)))
    share = np.array([max(0.0, ranks_per_core(r, cores) - 1.0) for r in rows])
    busy = np.array(cpu) * (1.0 + share / kappa)  # (rows,)
    link = np.array([wire_ms(r) for r in rows])
    measured = np.array([r["comm_ms"] for r in rows])
    wire = link[None, :] / ETA_GRID[:, None]  # (eta, rows)
    longer, shorter = np.maximum(busy, wire), np.minimum(busy, wire)
    t = longer[None] + BETA_GRID[:, None, None] * shorter[None]  # (beta, eta, rows)
    return ((t / measured - 1.0) ** 2).sum(axis=-1)


def fit_gamma(rows: list[dict]) -> float:
    """The CPU per ms of link time: the least-squares slope through the origin of each
    preset's CPU per call between two rates against its link time's change, over every
    (topology, preset) of `rows` measured at two rates (0 when there is none, never
    negative), rounded to 0.001."""
    by = {}
    for r in rows:
        by.setdefault((r["topology"], r["preset"]), []).append(r)
    num = den = 0.0
    for pair in by.values():
        if len(pair) != 2:
            continue
        a, b = pair
        d_link = wire_ms(a) - wire_ms(b)
        num += (a["cpu_ms"] - b["cpu_ms"]) * d_link
        den += d_link * d_link
    return round(max(0.0, num / den), 3) if den > 0 else 0.0


def fit(rows: list[dict], cpu: list[float], cores: int) -> dict:
    """The constants minimising the sum of squared relative errors of the model over `rows`,
    each row's CPU per rank from `cpu`, searched on the grids: `kappa` on all rows, the link
    fraction and overlap of the compressed presets and of gloo's collectives each on their
    own rows."""
    compressed = [i for i, r in enumerate(rows) if r["preset"] != UNCOMPRESSED]
    base = [i for i, r in enumerate(rows) if r["preset"] == UNCOMPRESSED]
    best = None
    for kappa in KAPPA_GRID:
        ec = _errors([rows[i] for i in compressed], [cpu[i] for i in compressed],
                     float(kappa), cores)
        eb = _errors([rows[i] for i in base], [cpu[i] for i in base], float(kappa), cores)
        sse = ec.min() + eb.min()
        if best is None or sse < best[0] - 1e-12:
            bc, e = np.unravel_index(np.argmin(ec), ec.shape)
            bb, eg = np.unravel_index(np.argmin(eb), eb.shape)
            best = (sse, {"kappa": float(kappa), "eta": float(ETA_GRID[e]),
                          "beta": float(BETA_GRID[bc]), "eta_gloo": float(ETA_GRID[eg]),
                          "beta_gloo": float(BETA_GRID[bb])})
    return {**best[1], "gamma": fit_gamma(rows)}


def _key(row: dict) -> tuple:
    return row["topology"], row["rate_mbit"], row["preset"]


def _prediction(row: dict, cpu_row: dict, constants: dict, cores: int, scheme: str,
                calibrated: str) -> dict:
    link = wire_ms(cpu_row, row["rate_mbit"])
    ms = predict_ms(row, cpu_row["cpu_ms"], constants, cores, link, wire_ms(cpu_row))
    return {"scheme": scheme, "topology": row["topology"], "preset": row["preset"],
            "rate_mbit": row["rate_mbit"], "calibrated": calibrated,
            "measured_ms": row["comm_ms"], "min_ms": row["sweep_min_ms"],
            "max_ms": row["sweep_max_ms"], "spread": spread(row), "link_ms": row["link_ms"],
            "wire_ms": link,
            "cpu_ms": cpu_row["cpu_ms"], "predicted_ms": ms, "error": ms / row["comm_ms"] - 1,
            "within_range": row["sweep_min_ms"] <= ms <= row["sweep_max_ms"],
            "constants": constants}


def spread(row: dict) -> float:
    """A row's own noise: (max - min) / median of its runs' medians."""
    return (row["sweep_max_ms"] - row["sweep_min_ms"]) / row["comm_ms"]


def held_out(rows: list[dict], cores: int) -> list[dict]:
    """Every row predicted without any timing at its topology and rate:
    - across rates: each topology's rows at rate B from each preset's CPU accounting and link
      bytes at the other rate A (same topology), with the constants fitted on every row but
      that topology's at B (its rows at A, the other topologies' at every rate);
    - across topologies: each topology's rows from its own CPU accounting and link bytes and
      the constants fitted on the other topologies' rows alone."""
    by = {_key(r): r for r in rows}
    topologies = sorted({r["topology"] for r in rows})
    rates = sorted({r["rate_mbit"] for r in rows})
    out = []
    for topology in topologies:
        for target in rates:
            train = [r for r in rows if (r["topology"], r["rate_mbit"]) != (topology, target)]
            constants = fit(train, [r["cpu_ms"] for r in train], cores)
            for r in rows:
                if (r["topology"], r["rate_mbit"]) != (topology, target):
                    continue
                for cal in rates:
                    if cal != target and (topology, cal, r["preset"]) in by:
                        out.append(_prediction(r, by[(topology, cal, r["preset"])], constants,
                                               cores, "rate", f"{cal / 1000:g} Gbit/s"))
    for topology in topologies:
        train = [r for r in rows if r["topology"] != topology]
        if not train:
            continue
        constants = fit(train, [r["cpu_ms"] for r in train], cores)
        others = "+".join(sorted({r["topology"] for r in train}))
        for r in rows:
            if r["topology"] == topology:
                out.append(_prediction(r, r, constants, cores, "topology", others))
    return out


def load_rows(path: Path) -> tuple[list[dict], dict]:
    """The measured rows (one per topology, rate and preset) and the measurement's meta."""
    data = json.loads(path.read_text())
    rows = [r for r in data["rows"] if r.get("comm_ms") and r.get("cpu_ms")]
    for r in (r for r in rows if "bucket_numel" in r):
        # A measured bucket: the link time of the core's plan as the current model counts it
        # (rows without a bucket size, made up for tests, bring their own).
        nodes, per_node = (int(x) for x in r["topology"].split("x"))
        r["link_ms"] = bucket_link_ms(r["preset"], r["bucket_numel"], nodes, per_node,
                                      r["rate_mbit"])
    return rows, data["meta"]


def _row_line(e: dict) -> str:
    noisy = " (noisier than 15%)" if e["spread"] > 0.15 else ""
    return (f"| {e['topology']} | {e['preset']} | {e['calibrated']} | "
            f"{e['rate_mbit'] / 1000:g} Gbit/s | {e['cpu_ms']:.1f} | {e['link_ms']:.1f} | "
            f"{e['wire_ms']:.1f} | "
            f"{e['measured_ms']:.1f} [{e['min_ms']:.1f}-{e['max_ms']:.1f}] | "
            f"{100 * e['spread']:.0f}%{noisy} | {e['predicted_ms']:.1f} | "
            f"{100 * e['error']:+.0f}% | {'yes' if e['within_range'] else 'no'} | "
            + ", ".join(f"{e['constants'][k]:g}" for k in CONSTANTS) + " |")


def _summary(name: str, predictions: list[dict]) -> str:
    """One line: a scheme's largest error and its rows beyond 15%, those that the row's own
    noise explains (its sweeps spread over more than 15%, or the prediction lies inside their
    range) apart from the others."""
    worst = max((abs(e["error"]) for e in predictions), default=0.0)
    outside = [e for e in predictions if abs(e["error"]) > 0.15]
    noisy = [e for e in outside if e["spread"] > 0.15 or e["within_range"]]
    rest = [e for e in outside if e not in noisy]
    line = (f"- {name}: largest error {100 * worst:.0f}%; {len(outside)} of "
            f"{len(predictions)} rows beyond 15%")
    if noisy:
        line += (f", {len(noisy)} of them in rows whose own runs spread over more than 15% or "
                 "whose runs' range holds the prediction")
    if rest:
        line += "; beyond 15% and beyond the row's noise: " + ", ".join(
            f"{e['topology']} {e['preset']} at {e['rate_mbit'] / 1000:g} Gbit/s "
            f"({100 * e['error']:+.0f}%)" for e in rest)
    return line + "."


def write(rows: list[dict], meta: dict, source: Path, out_dir: Path) -> dict:
    """Writes plan_calibration.json (the constants sdp4bit.plan uses, plus every held-out
    prediction) and plan_calibration.md; returns the JSON document."""
    cores = meta["cpus"]
    constants = fit(rows, [r["cpu_ms"] for r in rows], cores)
    predictions = held_out(rows, cores)
    doc = {"source": str(source.relative_to(ROOT) if source.is_relative_to(ROOT) else source),
           "measured": {k: meta.get(k) for k in ("date", "cpus", "command")},
           "constants": constants, "held_out": predictions,
           "largest_error": max((abs(e["error"]) for e in predictions), default=0.0)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan_calibration.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        "# The cost model against the emulated cluster",
        "",
        f"Command: `python bench/calibrate_plan.py`, reading `{doc['source']}` (measured "
        f"{meta.get('date')} on {cores} cores: `{meta.get('command')}`). Model: "
        "docs/performance.md \"The cost model\". Constants for sdp4bit.plan, fitted on every "
        "row: " + ", ".join(f"{k} = {constants[k]:g}" for k in CONSTANTS) + ".",
        "",
        f"Held out, largest error {100 * doc['largest_error']:.0f}%:",
        "",
        *(_summary(name, [e for e in predictions if e["scheme"] == scheme])
          for scheme, name in (("rate", "across rates"), ("topology", "across topologies"))),
        "",
        "Across rates: each row predicted from its preset's CPU accounting and link bytes at "
        "the other rate "
        "(calibrated at; same topology) and the constants fitted on every other row, so "
        "nothing timed for that preset at that topology and rate is used. Across topologies: "
        "each topology's rows predicted from its own CPU accounting and link bytes and the "
        "constants fitted on the other topology alone (calibrated at). CPU ms = one rank's CPU per call (mean over ranks, "
        "median over the sweeps); link ms = the busiest node link's bytes per call at the "
        "predicted rate, as the core plans them and as the link's interface counted them "
        "(headers included; the model's input); measured = the median over the sweeps of each sweep's "
        "median, [min-max] = the sweeps' medians; spread = (max - min) / median, the row's "
        "noise between runs.",
        "",
        "| topology | preset | calibrated at | predicted at | CPU ms/rank | link ms (plan) | "
        "link ms (wire) | "
        "measured ms [min-max] | spread | predicted ms | error | inside [min-max] | "
        + ", ".join(CONSTANTS) + " |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    lines += [_row_line(e) for e in predictions if e["scheme"] == "rate"]
    lines += [_row_line(e) for e in predictions if e["scheme"] == "topology"]
    (out_dir / "plan_calibration.md").write_text("\n".join(lines) + "\n")
    return doc


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measurements", type=Path,
                   default=ROOT / "bench/results/cluster_cpu.json")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = p.parse_args(argv)
    rows, meta = load_rows(args.measurements)
    doc = write(rows, meta, args.measurements.resolve(), args.out)
    print(json.dumps(doc["constants"]), f"largest held-out error {doc['largest_error']:.0%}")


if __name__ == "__main__":
    main()
