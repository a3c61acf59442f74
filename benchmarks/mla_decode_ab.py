"""A/B of the sm_90 MLA decode kernels: the working tree's against those of a git revision, in one
process, on the same inputs and plans.

The revision's ``common_kernels/mla/decode_sm90_seesaw.py``, ``decode_sm90_narrow.py`` and their
helpers ``sm90_common.py`` are loaded from ``git show`` as modules of their own (the kernels import
the revision's helpers; their other relative imports resolve against the working tree's package),
and ``decode.mla_decode`` is pointed at one kernel set or the other by swapping the module
attributes it launches. Each shape: both outputs against ``mla_decode_ref`` (relative error, at the
first context length), then CUDA-graph replay medians (``mla_decode_splits.timed``). One JSON row
per shape: both times and ``base_us / ours_us`` (above 1: the working tree is faster).
``--both-orders`` times each shape a second time with ours first (``*_2`` entries): the H200's speed
drifted by 10-28 % within one run on 2026-12-02, which a one-order A/B reads as a difference between
the kernels (``benchmarks/results/mla_decode-sm90-narrow-tma-2026-12-02.md``).

    python -m benchmarks.mla_decode_ab --base HEAD --heads 16 --q-len 1 2 --cache e4m3 --out ab.jsonl
    python -m benchmarks.mla_decode_ab --base HEAD~1 --heads 128 --out ab128.jsonl

``--ours-set MODULE.NAME=INT`` changes a constant of the working tree's kernel modules for its side
only (the plan is made under it too), to time a launch setting without a new revision:

    python -m benchmarks.mla_decode_ab --base HEAD --heads 16 --cache e4m3 \
        --ours-set decode_sm90_narrow.PAIRED_FP8=0 --out ab.jsonl

``--base-set`` does the same for the base side: the plan and the launch options always come from
the working tree's modules, so a base that lacks a feature the working tree plans for (an fp8
``P V`` over E5M2, paired programs) runs with it switched off: ``--base-set
decode_sm90_narrow.USE_FP8_PV=0`` or ``decode_sm90_narrow.PAIRED_FP8=0``.

Where the repository's history cannot be trusted (on the GPU host, ``git rev-parse HEAD`` named the
session's first commit after later ones had been made here), ``--base`` takes a folder of the three
modules instead: ``git show REV:common_kernels/mla/decode_sm90_seesaw.py > DIR/...``, made here
(``benchmarks/at_revision.py``). The base needs the three as they are from 2026-12-02 on (the 64-row
kernel ``decode_sm90_seesaw``, helpers in ``sm90_common``).
"""

import argparse
import contextlib
import itertools
import json
import types

import torch

from benchmarks.at_revision import exec_at_base, revision_source
from common_kernels.mla import decode_sm90_narrow, decode_sm90_seesaw, mla_decode, plan_decode, sm90_kernels_apply

MODULES = {"decode_sm90_seesaw": ("mla_decode_split_kernel_sm90_seesaw", decode_sm90_seesaw),
           "decode_sm90_narrow": ("mla_decode_split_kernel_sm90_narrow", decode_sm90_narrow)}
OURS = {name: getattr(module, kernel) for name, (kernel, module) in MODULES.items()}
SHARED = "sm90_common"  # the kernels' helpers: the base side runs on its own copy


def load_revision(revision: str) -> dict[str, types.ModuleType]:
    """The revision's sm_90 kernel modules, importable beside the working tree's (as
    ``common_kernels.mla.<name>_at_base``), on the revision's own ``sm90_common``."""
    sources = {name: revision_source(revision, name) for name in (*MODULES, SHARED)}
    exec_at_base(revision, SHARED, sources[SHARED])
    shared_import = f"from .{SHARED} import"
    return {name: exec_at_base(revision, name, sources[name].replace(shared_import, f"from .{SHARED}_at_base import"))
            for name in MODULES}


def use(kernels: dict[str, types.ModuleType] | None) -> None:
    """Point ``mla_decode`` at the given modules' kernels, or back at the working tree's (``None``)."""
    for name, (kernel, module) in MODULES.items():
        setattr(module, kernel, getattr(kernels[name], kernel) if kernels else OURS[name])


def parse_settings(items: list[str]) -> dict[tuple[types.ModuleType, str], int]:
    """``["decode_sm90_narrow.NUM_BUFS=3", ...]`` as ``{(module, "NUM_BUFS"): 3}``; the constant
    must exist in that working-tree module."""
    settings = {}
    for item in items:
        target, _, value = item.partition("=")
        name, _, constant = target.partition(".")
        if name not in MODULES or not hasattr(MODULES[name][1], constant) or not value.lstrip("-").isdigit():
            raise ValueError(f"setting {item!r}: expected MODULE.NAME=INT with MODULE one of {sorted(MODULES)} "
                             "and NAME one of its constants")
        settings[(MODULES[name][1], constant)] = int(value)
    return settings


@contextlib.contextmanager
def overridden(settings: dict[tuple[types.ModuleType, str], int]):
    """The modules' constants set to ``settings`` inside the block, restored after it."""
    saved = {key: getattr(*key) for key in settings}
    try:
        for (module, constant), value in settings.items():
            setattr(module, constant, value)
        yield
    finally:
        for (module, constant), value in saved.items():
            setattr(module, constant, value)


def measure(side: str, kernels, constants, inputs, dtype, batch: int, heads: int, q_len: int, ctx: int,
            check: bool) -> dict:
    """One side's row entries for one shape: its split count, its error against the fp32
    reference (``check``) and its CUDA-graph replay time."""
    from benchmarks.mla_decode import D_LATENT, SCALE
    from benchmarks.mla_decode_splits import timed
    from common_kernels.mla.reference import mla_decode_ref

    q, cache, table, lens, kv_scale = inputs
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sm90 = sm90_kernels_apply(torch.device("cuda"), dtype, 64, D_LATENT, 64)
    with overridden(constants):
        use(kernels)
        try:
            plan = plan_decode(batch, heads, q_len, ctx, sms, cache_dtype=dtype, sm90=sm90)
            row = {f"{side}_splits": plan.num_splits, f"{side}_paired": plan.paired,
                   f"{side}_fp8_pv": plan.fp8_probs(dtype)}
            if check:
                scale = kv_scale if dtype != torch.bfloat16 else None
                got, _ = mla_decode(q[..., :D_LATENT], q[..., D_LATENT:], cache, table, lens, SCALE, plan, scale)
                ref, _ = mla_decode_ref(q[..., :D_LATENT].float(), q[..., D_LATENT:].float(), cache, table, lens,
                                        SCALE, kv_scale=kv_scale if scale is not None else 1.0,
                                        fp8_queries=plan.fp8_queries(dtype))
                row[f"{side}_rel_err"] = ((got.float() - ref).norm() / ref.norm()).item()
            row[f"{side}_us"] = timed(q, cache, table, lens, plan, kv_scale)
        finally:
            use(None)
    return row


def compare(measure_side, sides, check: bool, both_orders: bool) -> dict:
    """One shape's A/B entries: ``measure_side(side, kernels, constants, check)`` for base then ours,
    and ``base/ours``; with ``both_orders`` once more, ours first, as ``*_2`` entries and
    ``base/ours_2`` (a drift during the run shows as ``base_us`` != ``base_us_2``)."""
    row = {}
    for side in sides:
        row |= measure_side(*side, check=check)
    row["base/ours"] = row["base_us"] / row["ours_us"]
    if both_orders:
        for side in reversed(sides):
            row |= {f"{key}_2": value for key, value in measure_side(*side, check=False).items()}
        row["base/ours_2"] = row["base_us_2"] / row["ours_us_2"]
    return row


def main() -> None:
    from benchmarks.mla_decode import make_inputs
    from benchmarks.mla_decode_splits import DTYPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the git revision to compare with (default HEAD), or a folder "
                        "holding its decode_sm90_seesaw.py and decode_sm90_narrow.py")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--q-len", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ctx", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--cache", nargs="+", default=["bf16", "e4m3"], choices=list(DTYPES))
    parser.add_argument("--ours-set", nargs="+", default=[], metavar="MODULE.NAME=INT",
                        help="constants of the working tree's kernel modules for its side only")
    parser.add_argument("--base-set", nargs="+", default=[], metavar="MODULE.NAME=INT",
                        help="the same working-tree constants for the base side (its plan and launch options)")
    parser.add_argument("--both-orders", action="store_true",
                        help="time each shape twice, base first and then ours first (base/ours and base/ours_2)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    settings, base_settings = parse_settings(args.ours_set), parse_settings(args.base_set)
    base = load_revision(args.base)
    kv_scale = torch.tensor([0.5], device="cuda")
    with open(args.out, "w") as out:
        for cache_name, heads, q_len, ctx in itertools.product(args.cache, args.heads, args.q_len, args.ctx):
            dtype = DTYPES[cache_name]
            inputs = (*make_inputs(args.batch, heads, q_len, ctx, dtype), kv_scale)
            row = dict(base=args.base, base_set=args.base_set, ours_set=args.ours_set, cache=cache_name,
                       batch=args.batch, heads=heads, q_len=q_len, ctx=ctx)
            row |= compare(lambda side, kernels, constants, check: measure(
                side, kernels, constants, inputs, dtype, args.batch, heads, q_len, ctx, check),
                [("base", base, base_settings), ("ours", None, settings)], check=ctx == args.ctx[0],
                both_orders=args.both_orders)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
