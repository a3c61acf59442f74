"""The MoE A/B tool loads another revision's kernels as a package of their own and runs both sides on the
same inputs (timing needs a GPU; loading and running do not)."""

import shutil

import pytest
import torch

from benchmarks import fp8_moe_ab
from benchmarks.fp8_moe import SHAPES
from common_kernels import fp8
from common_kernels.fp8.moe import DEFAULT_CONFIG
from tests.common_kernels.test_fp8_moe import expert_weights


@pytest.fixture
def base(tmp_path):
    """This tree's kernels copied into a folder, with a change the A/B must see: their output doubled."""
    shutil.copytree(fp8_moe_ab.REPO / "common_kernels", tmp_path / "common_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    moe = tmp_path / "common_kernels" / "fp8" / "moe.py"
    source = moe.read_text()
    final = "    return sum_slots(down, runs.position, tokens, top_k)"
    assert source.count(final) == 1
    moe.write_text(source.replace(final, final.replace("return ", "return 2 * ")))
    return fp8_moe_ab.load_base(str(tmp_path))


def test_the_base_runs_its_own_code_on_the_same_inputs(base):
    assert base.fused_moe_fp8 is not fp8.fused_moe_fp8 and base.__name__ == "base_kernels.fp8"
    assert base.moe.__file__.startswith(str(fp8_moe_ab.Path(base.__file__).parent))
    experts, top_k, hidden, inter = SHAPES["refmodel"]
    w13, s13 = expert_weights(experts, 2 * inter, hidden, 0.05)
    w2, s2 = expert_weights(experts, hidden, inter, 0.05)
    x = torch.randn(3, hidden, dtype=torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(3, experts), -1).topk(top_k, dim=-1)
    calls = fp8_moe_ab.variants(base, (x, w13, s13, w2, s2, weights, ids.to(torch.int32)), DEFAULT_CONFIG, [2])
    assert list(calls) == ["base", "ours", "ours-G2"]
    assert fp8_moe_ab.equal_to_base(calls) == {"base": True, "ours": False, "ours-G2": False}
    torch.testing.assert_close(calls["base"](), 2 * calls["ours"](), atol=0, rtol=0)


def test_a_revision_is_archived_and_loaded_in_place_of_an_earlier_base(base):
    head = fp8_moe_ab.load_base("HEAD")
    assert head is not base and head.fused_moe_fp8 is not fp8.fused_moe_fp8
    assert fp8_moe_ab.Path(head.__file__).parent.parent.parent.name.startswith("fp8_moe_ab_")


def test_a_folder_without_the_package_or_an_unknown_revision_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no common_kernels package"):
        fp8_moe_ab.load_base(str(tmp_path))
    with pytest.raises(ValueError, match="neither a folder nor a revision"):
        fp8_moe_ab.load_base("no-such-revision")
