"""Summarize an Nsight Compute run of ``benchmarks.ncu_cases`` (the folder ``run_h200.sh ncu``
packs: ``cases.txt``, ``raw.csv`` from ``--page raw --csv``, ``src/src_N.csv`` from ``--page source
--print-source sass --csv``): per kernel its time, DRAM read rate, shared-memory and issue use, the
warp instructions it executed (in all and a program), each main stall reason's warp samples (as counts,
to compare two builds, and as shares), the instructions with the most samples and how often its
instructions ran a program.

    python3 -m benchmarks.ncu_summary ncu-out/ --out ncu-summary.json
"""

import argparse
import csv
import json
from collections import Counter
from pathlib import Path

# ncu picks each value's unit (the units row): a kernel of 82 us is reported in us, one of 612 us in ms
MICROSECONDS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
                "s": 1e6, "second": 1e6}
TERABYTES_PER_S = {"Tbyte/s": 1.0, "Gbyte/s": 1e-3, "Mbyte/s": 1e-6}
METRICS = {
    "duration_us": ("gpu__time_duration.sum", MICROSECONDS),
    "dram_read_TBps": ("dram__bytes_read.sum.per_second", TERABYTES_PER_S),
    "dram_read_pct_of_peak": ("dram__bytes_read.sum.pct_of_peak_sustained_elapsed", None),
    "smem_wavefront_pct": ("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed", None),
    "lsu_pipe_pct": ("sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active", None),
    "issue_active_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active", None),
    "registers": ("launch__registers_per_thread", None),
    "grid": ("launch__grid_size", None),
    "warp_instructions": ("smsp__inst_executed.sum", None),
}
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"
SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _factor(units: dict | None, unit: str, metric: str) -> float:
    """What turns a value in ``unit`` into the summary's unit (``units`` None: taken as it is)."""
    if units is None:
        return 1.0
    if unit not in units:
        raise ValueError(f"{metric}: unit {unit!r} not one of {sorted(units)}")
    return units[unit]


def kernel_rows(raw_csv: Path) -> list[dict]:
    """One dict per profiled kernel from ``--page raw --csv`` (a header row, a units row, then data)."""
    rows = list(csv.reader(raw_csv.open()))
    header, unit_row, data = rows[0], rows[1], rows[2:]
    column = {name: i for i, name in enumerate(header)}
    missing = [metric for metric, _ in METRICS.values() if metric not in column]
    if missing:
        raise ValueError(f"{raw_csv}: no column for {missing} (was the run made with --set full?)")
    factors = {key: _factor(units, unit_row[column[metric]], metric) for key, (metric, units) in METRICS.items()}
    out = []
    for values in data:
        row = {"kernel": values[column["Kernel Name"]]}
        row |= {key: round(_number(values[column[metric]]) * factors[key], 3) for key, (metric, _) in METRICS.items()}
        stalls = {name[len(STALL_PREFIX):]: _number(values[i]) for name, i in column.items()
                  if name.startswith(STALL_PREFIX) and not name.endswith("_not_issued")}
        total = sum(stalls.values()) or 1.0
        main = [(name, count) for name, count in sorted(stalls.items(), key=lambda item: -item[1])
                if count / total >= 0.02]
        row["instructions_per_program"] = round(row["warp_instructions"] / row["grid"], 1)
        row["stall_sample_share"] = {name: round(count / total, 3) for name, count in main}
        row["stall_samples"] = {name: int(count) for name, count in main}
        out.append(row)
    return out


def source_page(source_csv: Path) -> tuple[list[str], list[list[str]]]:
    """The header and the instruction rows of ``--page source --print-source sass --csv`` (a
    kernel-name row, a header row, then one row per SASS instruction)."""
    rows = list(csv.reader(source_csv.open()))
    return rows[1], rows[2:]


def hottest_instructions(header: list[str], data: list[list[str]], count: int = 10) -> list[dict]:
    """The ``count`` SASS instructions with the most warp samples, with their two main stall reasons
    (``source_page``'s header and rows)."""
    column = {name: i for i, name in enumerate(header)}
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    ranked = sorted(range(len(data)), key=lambda n: -_number(data[n][column[SAMPLES]]))[:count]
    out = []
    for n in ranked:
        values = data[n]
        top = sorted(((_number(values[column[r]]), r[len("stall_"):]) for r in reasons), reverse=True)[:2]
        out.append({"index": n, "sass": values[column["Source"]].strip(),
                    "samples": int(_number(values[column[SAMPLES]])),
                    "stalls": {reason: int(samples) for samples, reason in top if samples}})
    return out


def executions_a_program(header: list[str], data: list[list[str]], programs: float,
                         count: int = 5) -> dict[str, int]:
    """How many SASS instructions ran how many times a program (warp executions over the grid), the
    ``count`` commonest: straight-line code shows as nearly every instruction at one warpgroup's four
    warps, a loop body as multiples of it (``source_page``'s header and rows)."""
    executed = header.index(EXECUTED)
    tally = Counter(f"{_number(values[executed] or '0') / programs:g}" for values in data)
    return dict(tally.most_common(count))


def summarize(folder: Path) -> list[dict]:
    cases = (folder / "cases.txt").read_text().split()
    kernels = kernel_rows(folder / "raw.csv")
    if len(cases) != len(kernels):
        raise ValueError(f"{folder}: {len(cases)} cases but {len(kernels)} profiled kernels")
    summary = []
    for n, (case, row) in enumerate(zip(cases, kernels)):
        source = folder / "src" / f"src_{n}.csv"
        if source.is_file():
            header, data = source_page(source)
            row |= {"hottest_sass": hottest_instructions(header, data),
                    "executions_a_program": executions_a_program(header, data, row["grid"])}
        summary.append({"case": case, **row})
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = json.dumps(summarize(args.folder), indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
