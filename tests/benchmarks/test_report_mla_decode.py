"""``benchmarks.report_mla_decode``'s table: ratios against FLASHMLA and FlashInfer, and the share of the copy
bandwidth."""

import json
import sys

from benchmarks import report_mla_decode


def row(provider, us, tb_s):
    return dict(batch=128, cache="bf16", heads=16, q_len=1, ctx=8192, provider=provider, us=us, tb_s=tb_s,
                tflop_s=90.0)


def test_table_gives_speed_ups_and_share_of_copy(tmp_path, monkeypatch):
    run = {"card": "NVIDIA H200", "copy_tb_s": 4.0, "rows": [row("latentspeed", 400.0, 3.4),
                                                             row("FLASHMLA", 500.0, 2.7),
                                                             row("FLASHINFER_MLA", 600.0, 2.3)]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    monkeypatch.setattr(report_mla_decode, "plot", lambda rows, path, cards: None)
    monkeypatch.setattr(sys, "argv", ["report", str(tmp_path / "run.json"), "--md", str(tmp_path / "t.md"),
                                      "--png", str(tmp_path / "t.png")])
    report_mla_decode.main()
    text = (tmp_path / "t.md").read_text()
    assert text.startswith("Card: NVIDIA H200. Device-to-device copy (read + write) measured in the run: 4.00 TB/s.")
    line = next(ln for ln in text.splitlines() if ln.startswith("| bf16 | 16 | 1 | 8192 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4:10] == ["400", "—", "500", "—", "600", "—"]
    assert cells[10:] == ["3.40", "85 %", "90", "1.25×", "1.50×", "—"]


def test_runs_without_a_copy_measurement_leave_the_share_blank():
    text = report_mla_decode.table([dict(row("latentspeed", 400.0, 3.4), copy_tb_s=None)])
    assert "| 3.40 | — | 90 |" in text
