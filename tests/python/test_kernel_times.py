"""The measured GPU kernel figures the cost model reads (sdp4bit/kernel_times.json) are those of
the committed reports they name, and what they cost a step is computed as documented."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from sdp4bit import kernel_times

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _section(text: str, heading: str) -> str:
    """`text` from the line `heading` to the next heading of its level or above."""
    start = text.index(heading + "\n")
    level = heading.split()[0]
    rest = text[start + len(heading) + 1:]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def _run_report(path: Path) -> dict:
    """What one GPU kit report with a bench and a cost stage says: the kit's command and date,
    the device, the bench's copy, kernel rows and bucket size, the per-bucket cost and the GEMM
    step table (each once in the report)."""
    text = path.read_text()
    lines = text.splitlines()
    kernels = {}
    for line in lines:
        if line.startswith("| (") and line.count("|") == 11:
            label, kernel, read, written, median = _cells(line)[:5]
            kernels[label.split()[0]] = {"label": label, "kernel": kernel, "read_mib": float(read),
                                         "written_mib": float(written), "median_us": float(median)}
    copy = next(line for line in lines if line.startswith("| baseline: device-to-device copy"))
    gemm = [_cells(line) for line in lines if re.match(r"\| \d+ Mi \| \w+ \| \d+, ", line)]
    return {
        "command": re.search(r"^- command: `(.*)`$", text, re.M).group(1),
        "date": re.search(r"^- date: (\S+)$", text, re.M).group(1),
        "device": re.search(r"^- device: (.*) \(ordinal", text, re.M).group(1),
        "bucket_mib": int(re.search(r"^## Fused kernels \((\d+) MiB buckets", text, re.M).group(1)),
        "copy_gbps": float(_cells(copy)[6]),
        "kernels": kernels,
        "costs": json.loads(re.search(r"^cost-json: (.*)$", text, re.M).group(1)),
        "tokens": int(re.search(r"linear layers on (\d+) tokens", text).group(1)),
        "gemm": [(int(c[2].split(",")[0]), float(c[3]), int(c[4])) for c in gemm],
    }


def _kernel_medians(source: dict) -> dict[str, tuple[float, float, float]]:
    """Row -> (median, lowest, highest) microseconds from an aggregated table."""
    table = _section((ROOT / source["file"]).read_text(), source["section"])
    medians = {}
    for line in table.splitlines():
        if line.startswith("| ("):
            cells = _cells(line)
            low, high = (float(x) for x in cells[3].split("-"))
            medians[cells[0].split()[0]] = (float(cells[2]), low, high)
    return medians


@pytest.mark.parametrize("times", kernel_times.entries(), ids=lambda t: t.name)
def test_the_record_is_the_committed_reports(times):
    runs = [(r, _run_report(ROOT / r["file"])) for r in times.sources["runs"]]
    assert runs and len({t.name for t in kernel_times.entries()}) == len(kernel_times.entries())
    for source, report in runs:
        assert report["command"] == source["command"], source
        assert report["date"].startswith(times.date) and report["device"] == times.gpu.name
        assert report["costs"]["device"] == times.gpu.name
    reports = [report for _, report in runs]
    assert times.copy_gbps == pytest.approx(statistics.median(r["copy_gbps"] for r in reports))
    # The per-bucket cost: the median over the runs of each run's cost-json figure.
    for cost in times.per_bucket:
        measured = [next(c for c in r["costs"]["rows"]
                         if (c["numel"], c["grad"]) == (cost["numel"], cost["grad"]))
                    for r in reports]
        assert cost["preset"] == reports[0]["costs"]["preset"]
        for key in ("reduce_scatter_ms", "all_gather_ms"):
            assert cost[key] == pytest.approx(statistics.median(m[key] for m in measured),
                                              abs=1e-9), (cost, key)
    assert len(times.per_bucket) == len(reports[0]["costs"]["rows"])
    # The GEMM rate: 6 x tokens x 12 h^2 over each run's GEMM step, as bench/gpu_cost.py prints.
    for gemm in times.gemm:
        rates = []
        for r in reports:
            assert r["tokens"] == gemm["tokens"]
            for hidden, ms, printed in r["gemm"]:
                if hidden == gemm["hidden"]:
                    rate = 6 * gemm["tokens"] * 12 * hidden ** 2 / (ms * 1e-3) / 1e12
                    assert round(rate) == printed
                    rates.append(rate)
                    break
        assert gemm["tflops"] == pytest.approx(statistics.median(rates), abs=0.05), gemm
    # The kernel rows: every run's labels and bytes, the medians of the aggregated table (each
    # run's own median inside its range) or of the runs.
    medians = (_kernel_medians(times.sources["kernel_medians"])
               if "kernel_medians" in times.sources else None)
    assert set(times.rows) == set(reports[0]["kernels"])
    for row in times.rows.values():
        for r in reports:
            measured = r["kernels"][row.row]
            assert {k: getattr(row, k) for k in ("label", "kernel", "read_mib", "written_mib")} \
                == {k: measured[k] for k in ("label", "kernel", "read_mib", "written_mib")}
            element = 2 if row.kernel.startswith("weight_") else 4  # bf16 params, fp32 grads
            assert row.bucket_elements * element == r["bucket_mib"] * MIB
        runs_us = [r["kernels"][row.row]["median_us"] for r in reports]
        if medians is None:
            assert row.median_us == pytest.approx(statistics.median(runs_us))
        else:
            median, low, high = medians[row.row]
            assert row.median_us == median and all(low <= us <= high for us in runs_us), row


def test_the_h100_run_is_recorded():
    times = kernel_times.load("h100-2026-11-27")
    assert times.gpu.name == "NVIDIA H100 80GB HBM3" and times.copy_gbps == 2959.7
    assert times.rows["(1)"].median_us == 441.6 and times.gemm_tflops() == 717.0
    assert "bench/results/gpu/README.md" in times.source_files()


def _with_entry(tmp_path, **change) -> Path:
    """kernel_times.json with a copy of its first entry appended, changed."""
    doc = json.loads(kernel_times.DATA.read_text())
    doc["entries"].append({**doc["entries"][0], **change})
    path = tmp_path / "kernel_times.json"
    path.write_text(json.dumps(doc))
    return path


def test_an_entry_is_chosen_by_name_or_as_the_latest(tmp_path):
    later = _with_entry(tmp_path, name="h200-sweep", date="2026-12-01",
                        copy_gbps=4200.0)
    assert kernel_times.load(path=later).name == "h200-sweep"
    assert kernel_times.load("h100-2026-11-27", later).copy_gbps == 2959.7
    same_day = _with_entry(tmp_path, name="h100-again")
    assert kernel_times.load(path=same_day).name == "h100-again"  # the later in the file
    with pytest.raises(ValueError, match="known: h100-2026-11-27, h100-again, latest"):
        kernel_times.load("h200", same_day)


def test_codec_time_per_preset_by_hand():
    times = kernel_times.load("h100-2026-11-27")
    elements, a100 = 6.7e9, kernel_times.A100
    to_a100 = 3350.0 / 1555.0  # the datasheets' HBM bandwidths, H100 SXM over A100 40 GB
    # QSDP: rows (6a) and (6b), each one rank's call for a 64 Mi-element bucket.
    qsdp = kernel_times.codec(times, "qsdp", 64, 40e6)
    assert qsdp.ms(elements, times, a100) == pytest.approx(
        elements * (246.1 + 98.4) * 1e-3 / 2 ** 26 * to_a100)
    assert qsdp.missing and "weight_encode" in qsdp.missing[0]
    # sdp4bit: the per-bucket sequence at 64 Mi elements (nearest 40e6), both runs' median.
    sdp = kernel_times.codec(times, "sdp4bit", 64, 40e6)
    per_element = (0.850432 + 0.230272) / 2 ** 26
    assert sdp.ms(elements, times, a100) == pytest.approx(elements * per_element * to_a100)
    assert sdp.missing == ()
    at_256 = kernel_times.codec(times, "sdp4bit", 64, 300e6)
    assert at_256.ns_per_element == pytest.approx((3.183936 + 0.84096) * 1e6 / 2 ** 28)
    # At the targets: 1.5 x its rows' bytes at the copy: (1) + (2) + (3) per gradient element,
    # (4) + (5) per parameter element of their 128 Mi-element bucket.
    moved = ((256 + 66 + 66 + 17 + 17 + 64) * MIB / 2 ** 26
             + (128 + 16.06 + 320.25 + 256) * MIB / 2 ** 27)
    target = kernel_times.codec(times, "sdp4bit", 64, 40e6, at_targets=True)
    assert target.ns_per_element == pytest.approx(1.5 * moved / 2959.7)
    # ZeRO++'s quantizer at 0.75x the copy: 290 MiB per 64 Mi elements.
    zeropp = kernel_times.codec(times, "zeropp", 64, 40e6, at_targets=True)
    assert zeropp.ns_per_element == pytest.approx(290 * MIB / 2 ** 26 / (0.75 * 2959.7))
    assert kernel_times.codec(times, "baseline", 64, 40e6).ns_per_element == 0


def test_the_targets_are_faster_than_today():
    times = kernel_times.load("h100-2026-11-27")
    for ranks in (64, 128):
        for preset in ("sdp4bit", "qsdp", "zeropp", "global-qsgd"):
            today = kernel_times.codec(times, preset, ranks, 40e6).ns_per_element
            target = kernel_times.codec(times, preset, ranks, 40e6, at_targets=True)
            assert target.ns_per_element <= today, preset
            if preset != "global-qsgd":  # its measured kernels already beat their targets
                assert target.ns_per_element < today, preset


def test_what_no_row_times_is_named_not_invented():
    times = kernel_times.load("h100-2026-11-27")
    narrow, wide = (kernel_times.preset_kernels("global-qsgd", n) for n in (64, 128))
    assert narrow.rows == ("(8a)", "(8b)") and len(narrow.missing) == 1
    assert wide.rows == ("(8a)",) and "16-bit" in wide.missing[0]
    assert kernel_times.codec(times, "global-qsgd", 128, 40e6).ns_per_element == pytest.approx(
        100.4e3 / 2 ** 26)
    assert "global_sum_dequantize" in narrow.missing[0]


def test_compute_at_the_measured_gemm_rate_by_hand():
    times = kernel_times.load("h100-2026-11-27")
    a100_rate = 717.0 * 312.0 / 989.0  # the H100's measured rate, by the dense bf16 peaks
    assert kernel_times.compute_ms(6.7e9, 2048, times, kernel_times.A100) == pytest.approx(
        6 * 6.7e9 * 2048 / (a100_rate * 1e12) * 1e3)
    assert kernel_times.compute_ms(18e9, 2048, times, kernel_times.H800) == pytest.approx(
        6 * 18e9 * 2048 / 717e12 * 1e3)
