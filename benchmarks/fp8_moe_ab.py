"""A/B of the block-FP8 fused MoE: the working tree's kernels against another revision's, in one process, on
the same weights, routing and launch (this tree's tuned table entry for the shape and token count, or
``untuned_config``), with this tree's kernels also at other tile orders (``--group-m``: ``GROUP_M`` on its
warp-specialized launches).

The revision's ``common_kernels`` is imported as a package of its own, ``base_kernels`` (its imports are
relative), from a folder holding a copy of it (``--base DIR``: ``git archive REV common_kernels | tar -x -C
DIR``, made here and carried to a GPU host without the git history) or from a revision (``--base REV``,
where git is at hand). Each variant is captured in a CUDA graph, and its replays are timed
(``triton.testing.do_bench`` medians, L2 flushed) over ``--rounds`` rounds, each round starting one variant
later; a row reports the median round and whether the output equals the base's bit for bit
(``equal_to_base``: the changes that keep the arithmetic keep the bytes).

    python -m benchmarks.fp8_moe_ab --base HEAD --tokens 1024 4096 --group-m 2 4 --out ab.jsonl
"""

import argparse
import functools
import importlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.fp8_moe import SHAPES, routed_inputs
from benchmarks.tune_fp8_moe import with_group_m
from common_kernels.fp8 import fused_moe_fp8
from common_kernels.fp8.moe import moe_config

REPO = Path(__file__).resolve().parents[1]
BASE_PACKAGE = "base_kernels"


def load_base(base: str):
    """The revision's ``common_kernels.fp8``, imported as ``base_kernels.fp8``: from ``base``/common_kernels if
    ``base`` is a folder, else from ``git archive`` of revision ``base`` (into a folder that lives as long
    as the process)."""
    folder = Path(base)
    if not folder.is_dir():
        folder = Path(tempfile.mkdtemp(prefix="fp8_moe_ab_"))
        archive = subprocess.run(["git", "archive", base, "common_kernels"], cwd=REPO, capture_output=True)
        if archive.returncode:
            raise ValueError(f"--base {base}: neither a folder nor a revision ({archive.stderr.decode().strip()})")
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    package = folder / "common_kernels"
    if not (package / "__init__.py").is_file():
        raise ValueError(f"--base {base}: no common_kernels package in {folder}")
    spec = importlib.util.spec_from_file_location(BASE_PACKAGE, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    for name in [name for name in sys.modules if name.split(".")[0] == BASE_PACKAGE]:
        del sys.modules[name]  # an earlier base's
    sys.modules[BASE_PACKAGE] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{BASE_PACKAGE}.fp8")


def variants(base, inputs, config: dict, group_ms) -> dict:
    """``{name: call}``: ``base`` (the revision's ``fused_moe_fp8``) and ``ours`` at ``config``, and ``ours-G<g>``
    at each of ``group_ms``."""
    calls = {"base": functools.partial(base.fused_moe_fp8, *inputs, check_ids=False, config=config),
             "ours": functools.partial(fused_moe_fp8, *inputs, check_ids=False, config=config)}
    for group_m in group_ms:
        calls[f"ours-G{group_m}"] = functools.partial(fused_moe_fp8, *inputs, check_ids=False,
                                                      config=with_group_m(config, group_m))
    return calls


def equal_to_base(calls: dict) -> dict:
    """Whether each variant's output equals the base's, bit for bit."""
    outs = {name: call() for name, call in calls.items()}
    return {name: bool(torch.equal(out, outs["base"])) for name, out in outs.items()}


def timed_rounds(calls: dict, rounds: int) -> dict:
    """Each variant's CUDA-graph replay medians (µs), one a round, round ``r`` starting at variant ``r``."""
    import triton

    from benchmarks.timing import in_cuda_graph

    graphs = {name: in_cuda_graph(call) for name, call in calls.items()}
    times = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(triton.testing.do_bench(graphs[name], warmup=25, rep=200, return_mode="median") * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="a folder holding a copy of common_kernels, or a revision")
    parser.add_argument("--shapes", nargs="+", default=["deepseek_v3"], choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--group-m", type=int, nargs="*", default=[], help="ours also at these GROUP_M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    base = load_base(args.base)
    torch.manual_seed(0)
    with open(args.out, "w") as out:
        for shape in args.shapes:
            experts, top_k, hidden, inter = SHAPES[shape]
            for tokens, inputs in routed_inputs(shape, args.tokens):
                config = moe_config(tokens, top_k, experts, hidden, inter, inputs[0].device)
                calls = variants(base, inputs, config, args.group_m)
                equal = equal_to_base(calls)
                for name, times in timed_rounds(calls, args.rounds).items():
                    row = dict(shape=shape, tokens=tokens, variant=name, us=sorted(times)[len(times) // 2],
                               rounds=times, equal_to_base=equal[name], config=config)
                    print(json.dumps(row), flush=True)
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
