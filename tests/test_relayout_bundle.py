"""``tests/gpu/relayout_bundle.py`` on a small fake bundle: every wheel comes back byte for byte (split ones once
their pieces are joined in name order, as install.sh joins them), no part is over the limit, every part has
stage.sh and the last has install.sh."""

import os

from tests.gpu.relayout_bundle import relayout


def test_relayout_keeps_every_wheel_and_fits_the_parts(tmp_path):
    wheels = {"big.whl": os.urandom(2500), "mid.whl": os.urandom(900), "small.whl": os.urandom(300)}
    bundle = tmp_path / "vllm"
    (bundle / "p1").mkdir(parents=True)
    (bundle / "p2").mkdir()
    (bundle / "p1" / "big.whl.piece00").write_bytes(wheels["big.whl"][:1800])
    (bundle / "p2" / "big.whl.piece01").write_bytes(wheels["big.whl"][1800:])
    (bundle / "p1" / "small.whl").write_bytes(wheels["small.whl"])
    (bundle / "p2" / "mid.whl").write_bytes(wheels["mid.whl"])
    for part in ("p1", "p2"):
        (bundle / part / "stage.sh").write_text("# stage\n")
    (bundle / "p2" / "install.sh").write_text("# install\n")

    sizes = relayout(bundle, part_bytes=1200, piece_bytes=1000)

    parts = sorted(bundle.iterdir())
    assert [p.name for p in parts] == [f"p{n}" for n in range(1, len(parts) + 1)] and len(parts) == len(sizes)
    files = {f.name: f for p in parts for f in p.iterdir()}
    assert all((p / "stage.sh").is_file() for p in parts) and (parts[-1] / "install.sh").is_file()
    assert all(sum(f.stat().st_size for f in p.iterdir() if f.suffix != ".sh") <= 1200 for p in parts)
    pieces = sorted(name for name in files if name.startswith("big.whl.piece"))
    assert pieces == ["big.whl.piece00", "big.whl.piece01", "big.whl.piece02"]
    assert b"".join(files[name].read_bytes() for name in pieces) == wheels["big.whl"]
    assert files["mid.whl"].read_bytes() == wheels["mid.whl"]
    assert files["small.whl"].read_bytes() == wheels["small.whl"]
    assert not (tmp_path / "vllm.flat").exists() and not (tmp_path / "vllm.new").exists()
