"""Where a tuning run starts: an empty table, or the entries of the one it updates."""

import json

from benchmarks.tuned_tables import starting_configs


def test_a_fresh_run_starts_empty():
    assert starting_configs(None) == {}


def test_an_update_keeps_what_it_does_not_tune(tmp_path):
    shipped = {"2112,7168": {"1": {"BLOCK_M": 16, "us": 12.8}, "4096": {"BLOCK_M": 128, "us": 139.1}}}
    path = tmp_path / "gemm_NVIDIA_H200.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "configs": shipped}))
    table = starting_configs(str(path))
    table.setdefault("2112,7168", {})["4096"] = {"BLOCK_M": 128, "us": 125.9}  # as the tuner records a row
    assert table == {"2112,7168": {"1": {"BLOCK_M": 16, "us": 12.8}, "4096": {"BLOCK_M": 128, "us": 125.9}}}
