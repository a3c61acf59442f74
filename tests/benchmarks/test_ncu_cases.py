"""``benchmarks.ncu_cases --set``: a decode module's constant holds while every case is made and run, and is
restored afterwards (the cases run on CPU here: fake ones, with the CUDA calls stubbed)."""

import sys
import types

import pytest
import torch

from benchmarks import ncu_cases
from common_kernels.mla import decode_sm90_seesaw

SETTING = "decode_sm90_seesaw.MIN_TOKENS_PER_FP8_PV_SPLIT=0"


@pytest.mark.parametrize("argv", [["fake:a", "fake:b", "--set", SETTING], ["--set", SETTING, "--", "fake:a", "fake:b"]])
def test_set_holds_a_decode_constant_while_the_cases_run(monkeypatch, argv):
    seen = []

    def case(tag):
        seen.append(("made", tag, decode_sm90_seesaw.MIN_TOKENS_PER_FP8_PV_SPLIT))
        return lambda: seen.append(("ran", tag, decode_sm90_seesaw.MIN_TOKENS_PER_FP8_PV_SPLIT))

    monkeypatch.setitem(ncu_cases.CASES, "fake", case)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    profiler = types.SimpleNamespace(cudaProfilerStart=lambda: None, cudaProfilerStop=lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: profiler)
    monkeypatch.setattr(sys, "argv", ["ncu_cases", *argv])
    before = decode_sm90_seesaw.MIN_TOKENS_PER_FP8_PV_SPLIT
    ncu_cases.main()
    assert [(what, tag) for what, tag, _ in seen] == [("made", "a")] + [("ran", "a")] * 3 + [("made", "b")] + [
        ("ran", "b")] * 3
    assert {value for *_, value in seen} == {0}
    assert decode_sm90_seesaw.MIN_TOKENS_PER_FP8_PV_SPLIT == before != 0


def test_set_refuses_a_constant_it_cannot_set(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ncu_cases", "fake:a", "--set", "decode_sm90_seesaw.NO_SUCH=1"])
    with pytest.raises(ValueError, match="MODULE.NAME=INT"):
        ncu_cases.main()
