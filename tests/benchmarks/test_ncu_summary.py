"""``benchmarks.ncu_summary`` on a small folder in the layout ``run_h200.sh ncu`` packs."""

import csv

import pytest

from benchmarks import ncu_summary

RAW_HEADER = ["ID", "Kernel Name", *[metric for metric, _ in ncu_summary.METRICS.values()],
              "smsp__pcsamp_warps_issue_stalled_wait", "smsp__pcsamp_warps_issue_stalled_wait_not_issued",
              "smsp__pcsamp_warps_issue_stalled_barrier", "smsp__pcsamp_warps_issue_stalled_misc"]


def write_csv(path, rows):
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)


def make_run(folder, cases, kernels, time_unit="ms", rate_unit="Tbyte/s"):
    folder.mkdir()
    (folder / "cases.txt").write_text(" ".join(cases))
    units = ["", "", time_unit, rate_unit, *[""] * (len(RAW_HEADER) - 4)]
    data = [[str(i), name, "0.5", "3.25", "70", "60", "50", "36", "255", "1,024", "2,048,000", "800", "700", "150", "1"]
            for i, name in enumerate(kernels)]
    write_csv(folder / "raw.csv", [RAW_HEADER, units, *data])
    (folder / "src").mkdir()
    header = ["Address", "Source", ncu_summary.SAMPLES, "stall_wait", "stall_barrier", "stall_wait (Not Issued)",
              ncu_summary.EXECUTED]
    write_csv(folder / "src" / "src_0.csv", [["Kernel Name", kernels[0]], header,
                                             ["0x0", "  LDS R1, [R2]", "5", "5", "0", "4", "4,096"],
                                             ["0x10", "  BAR.SYNC 0x0", "1,200", "200", "1,000", "150", "4,096"],
                                             ["0x20", "  NOP", "0", "0", "0", "0", "0"]])


def test_summary_reads_metrics_stalls_and_hottest_instructions(tmp_path):
    make_run(tmp_path / "run", ["decode:e4m3:16:1:32768", "gemm:4096:7168:2048"], ["narrow", "gemm"])
    first, second = ncu_summary.summarize(tmp_path / "run")
    assert first["case"] == "decode:e4m3:16:1:32768" and first["kernel"] == "narrow"
    assert first["duration_us"] == 500.0 and first["dram_read_TBps"] == 3.25 and first["grid"] == 1024.0
    # wait 800 and barrier 150 of 951 samples (not-issued counts are a subset, left out); misc < 2 %
    assert first["stall_sample_share"] == {"wait": round(800 / 951, 3), "barrier": round(150 / 951, 3)}
    assert first["stall_samples"] == {"wait": 800, "barrier": 150}
    assert first["warp_instructions"] == 2048000 and first["instructions_per_program"] == 2000.0
    assert [h["sass"] for h in first["hottest_sass"]] == ["BAR.SYNC 0x0", "LDS R1, [R2]", "NOP"]
    assert first["hottest_sass"][0] == {"index": 1, "sass": "BAR.SYNC 0x0", "samples": 1200,
                                        "stalls": {"barrier": 1000, "wait": 200}}
    assert first["executions_a_program"] == {"4": 2, "0": 1}  # 4,096 warp executions over 1,024 programs
    assert "hottest_sass" not in second and "executions_a_program" not in second  # no source page for it


def test_summary_refuses_a_case_count_mismatch(tmp_path):
    make_run(tmp_path / "run", ["decode:e4m3:16:1:32768"], ["narrow", "gemm"])
    with pytest.raises(ValueError, match="1 cases but 2 profiled kernels"):
        ncu_summary.summarize(tmp_path / "run")


def test_summary_reads_each_value_in_its_unit(tmp_path):
    """ncu reports a short kernel's time in us and a long one's in ms; rates may come in Gbyte/s."""
    make_run(tmp_path / "us", ["decode:e4m3:16:1:4096"], ["narrow"], time_unit="us", rate_unit="Gbyte/s")
    (row,) = ncu_summary.summarize(tmp_path / "us")
    assert row["duration_us"] == 0.5 and row["dram_read_TBps"] == 0.003
    make_run(tmp_path / "odd", ["decode:e4m3:16:1:4096"], ["narrow"], time_unit="cycle")
    with pytest.raises(ValueError, match="unit 'cycle'"):
        ncu_summary.summarize(tmp_path / "odd")
