"""The A/B tool loads a revision's sm_90 decode kernels beside the working tree's and swaps them in
and out of ``mla_decode`` (timing needs a GPU; loading and swapping do not)."""

import subprocess
import sys

import pytest
import torch

from benchmarks import at_revision, mla_decode_ab
from common_kernels.mla import decode_sm90_narrow, decode_sm90_seesaw, plan_decode, sm90_common


def kernels_in_use():
    return (decode_sm90_seesaw.mla_decode_split_kernel_sm90_seesaw,
            decode_sm90_narrow.mla_decode_split_kernel_sm90_narrow)


def test_a_revisions_kernels_load_beside_ours_and_swap():
    source = subprocess.run(["git", "show", "HEAD:common_kernels/mla/decode_sm90_seesaw.py"], cwd=at_revision.REPO,
                            check=True, capture_output=True, text=True).stdout
    ours = kernels_in_use()
    base = mla_decode_ab.load_revision("HEAD")
    theirs = (base["decode_sm90_seesaw"].mla_decode_split_kernel_sm90_seesaw,
              base["decode_sm90_narrow"].mla_decode_split_kernel_sm90_narrow)
    assert theirs[0] is not ours[0] and theirs[1] is not ours[1]
    assert theirs[0].src in source  # the revision's code, its source readable
    mla_decode_ab.use(base)
    try:
        assert kernels_in_use() == theirs
    finally:
        mla_decode_ab.use(None)
    assert kernels_in_use() == ours


def copy_head(folder, names):
    for name in names:
        source = subprocess.run(["git", "show", f"HEAD:common_kernels/mla/{name}.py"], cwd=at_revision.REPO,
                                check=True, capture_output=True, text=True).stdout
        (folder / f"{name}.py").write_text(source.replace('"""', '"""Copied. ', 1))


def test_a_folder_of_copies_stands_for_a_revision(tmp_path):
    copy_head(tmp_path, [*mla_decode_ab.MODULES, mla_decode_ab.SHARED])
    base = mla_decode_ab.load_revision(str(tmp_path))
    for name in mla_decode_ab.MODULES:  # read from the folder, not from git
        assert base[name].__doc__.startswith("Copied. "), name


def test_the_base_kernels_run_on_the_base_helpers(tmp_path):
    copy_head(tmp_path, [*mla_decode_ab.MODULES, mla_decode_ab.SHARED])
    base = mla_decode_ab.load_revision(str(tmp_path))
    helpers = sys.modules["common_kernels.mla.sm90_common_at_base"]
    assert helpers.__doc__.startswith("Copied. ")
    for name in mla_decode_ab.MODULES:  # a change to sm90_common alone shows in an A/B
        assert base[name]._page_of is helpers._page_of is not sm90_common._page_of, name


def test_an_older_revision_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="no decode_sm90_seesaw.py"):
        mla_decode_ab.load_revision(str(tmp_path))
    copy_head(tmp_path, [mla_decode_ab.SHARED])
    for name in mla_decode_ab.MODULES:  # as before 2026-12-02: the narrow kernel imported decode_sm90
        (tmp_path / f"{name}.py").write_text("from .decode_sm90 import D_LATENT\n")
    with pytest.raises(ValueError, match="imports what the working tree no longer has"):
        mla_decode_ab.load_revision(str(tmp_path))


def test_ours_set_changes_constants_for_one_side_only(monkeypatch):
    monkeypatch.delenv(decode_sm90_narrow.PAIRED_ENV, raising=False)
    settings = mla_decode_ab.parse_settings(["decode_sm90_narrow.PAIRED_FP8=0", "decode_sm90_narrow.NUM_BUFS=3"])
    assert settings == {(decode_sm90_narrow, "PAIRED_FP8"): 0, (decode_sm90_narrow, "NUM_BUFS"): 3}
    fp8 = torch.float8_e4m3fn

    def splits():  # 16 heads, 1 token: 16-row groups on the narrow kernel
        return plan_decode(128, 16, 1, 32768, 132, cache_dtype=fp8, sm90=True).num_splits

    paired = splits()
    with mla_decode_ab.overridden(settings):
        assert decode_sm90_narrow.NUM_BUFS == 3
        assert splits() == 2 * paired  # two one-warpgroup programs a multiprocessor: twice the splits
    assert (decode_sm90_narrow.NUM_BUFS, decode_sm90_narrow.PAIRED_FP8) == (2, 1)
    assert splits() == paired


@pytest.mark.parametrize("item", ["decode_sm90_narrow.NO_SUCH=1", "decode.NUM_BUFS=2",
                                  "decode_sm90_seesaw.MAXNREG=many"])
def test_ours_set_refuses_what_it_cannot_set(item):
    with pytest.raises(ValueError, match="MODULE.NAME=INT"):
        mla_decode_ab.parse_settings([item])


def test_both_orders_times_each_side_again_ours_first():
    calls = []
    times = iter([10.0, 5.0, 6.0, 12.0])  # base, ours, then ours, base

    def measure_side(side, kernels, constants, check):
        calls.append((side, check))
        return {f"{side}_us": next(times)}

    sides = [("base", None, {}), ("ours", None, {})]
    row = mla_decode_ab.compare(measure_side, sides, check=True, both_orders=True)
    assert calls == [("base", True), ("ours", True), ("ours", False), ("base", False)]
    assert row == {"base_us": 10.0, "ours_us": 5.0, "base/ours": 2.0, "ours_us_2": 6.0, "base_us_2": 12.0,
                   "base/ours_2": 2.0}
    calls.clear()
    times = iter([3.0, 4.0])
    assert mla_decode_ab.compare(measure_side, sides, check=False, both_orders=False) == {
        "base_us": 3.0, "ours_us": 4.0, "base/ours": 0.75}
    assert calls == [("base", False), ("ours", False)]
