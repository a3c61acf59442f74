"""A/B of the sm_90 MLA decode kernels: the working tree's against those of a git revision, in one
process, on the same inputs and plans.

The revision's ``common_kernels/mla/decode_sm90.py`` and ``decode_sm90_narrow.py`` are loaded from
``git show`` as modules of their own (their relative imports resolved against the working tree's
package), and ``decode.mla_decode`` is pointed at one kernel set or the other by swapping the
module attributes it launches. Each shape: both outputs against ``mla_decode_ref`` (relative error,
at the first context length), then CUDA-graph replay medians (``mla_decode_splits.timed``). One
JSON row per shape: both times and ``base_us / ours_us`` (above 1: the working tree is faster).

    python -m benchmarks.mla_decode_ab --base HEAD --heads 16 --q-len 1 2 --cache e4m3 --out ab.jsonl
    python -m benchmarks.mla_decode_ab --base HEAD~1 --heads 128 --out ab128.jsonl

Where the repository's history is not at hand (the GPU host gets the working tree only), ``--base``
takes a folder of the two modules instead: ``git show REV:common_kernels/mla/decode_sm90.py > DIR/...``.
"""

import argparse
import importlib.util
import json
import linecache
import subprocess
import sys
import types
from pathlib import Path

import torch

from common_kernels.mla import decode, decode_sm90, decode_sm90_narrow, mla_decode, plan_decode, sm90_kernels_apply

REPO = Path(__file__).resolve().parents[1]
MODULES = {"decode_sm90": ("mla_decode_split_kernel_sm90", decode_sm90),
           "decode_sm90_narrow": ("mla_decode_split_kernel_sm90_narrow", decode_sm90_narrow)}
OURS = {name: getattr(module, kernel) for name, (kernel, module) in MODULES.items()}


def revision_source(revision: str, name: str) -> str:
    """Module ``name``'s source at a git revision, or in a folder of copies (``revision`` names one:
    for a machine that has the working tree but not its history)."""
    if Path(revision).is_dir():
        return (Path(revision) / f"{name}.py").read_text()
    return subprocess.run(["git", "show", f"{revision}:common_kernels/mla/{name}.py"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout


def load_revision(revision: str) -> dict[str, types.ModuleType]:
    """The revision's sm_90 kernel modules, importable beside the working tree's (as
    ``common_kernels.mla.<name>_at_base``)."""
    loaded = {}
    for name in MODULES:
        source = revision_source(revision, name)
        if name == "decode_sm90_narrow":  # its own import of the 64-row module: the revision's too
            source = source.replace("from .decode_sm90 import", "from .decode_sm90_at_base import")
        qualified = f"common_kernels.mla.{name}_at_base"
        path = REPO / "common_kernels" / "mla" / f"{name}_at_base.py"  # the name Gluon's errors show; not written
        spec = importlib.util.spec_from_loader(qualified, loader=None, origin=str(path))
        module = importlib.util.module_from_spec(spec)
        module.__package__ = "common_kernels.mla"
        sys.modules[qualified] = module
        linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))  # for jit's getsource
        exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 (our own source at a revision)
        loaded[name] = module
    return loaded


def use(kernels: dict[str, types.ModuleType] | None) -> None:
    """Point ``mla_decode`` at the given modules' kernels, or back at the working tree's (``None``)."""
    for name, (kernel, module) in MODULES.items():
        setattr(module, kernel, getattr(kernels[name], kernel) if kernels else OURS[name])


def main() -> None:
    from benchmarks.mla_decode import D_LATENT, SCALE, make_inputs
    from benchmarks.mla_decode_splits import DTYPES, timed
    from common_kernels.mla.reference import mla_decode_ref

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the git revision to compare with (default HEAD), or a folder "
                        "holding its decode_sm90.py and decode_sm90_narrow.py")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--q-len", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ctx", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--cache", nargs="+", default=["bf16", "e4m3"], choices=list(DTYPES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    base = load_revision(args.base)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_scale = torch.tensor([0.5], device="cuda")
    with open(args.out, "w") as out:
        for cache_name in args.cache:
            dtype = DTYPES[cache_name]
            sm90 = sm90_kernels_apply(torch.device("cuda"), dtype, 64, D_LATENT, 64)
            for heads in args.heads:
                for q_len in args.q_len:
                    for ctx in args.ctx:
                        q, cache, table, lens = make_inputs(args.batch, heads, q_len, ctx, dtype)
                        plan = plan_decode(args.batch, heads, q_len, ctx, sms, cache_dtype=dtype, sm90=sm90)
                        row = dict(base=args.base, cache=cache_name, heads=heads,
                                   q_len=q_len, ctx=ctx, splits=plan.num_splits)
                        for side, kernels in (("base", base), ("ours", None)):
                            use(kernels)
                            if ctx == args.ctx[0]:
                                scale = kv_scale if dtype != torch.bfloat16 else None
                                got, _ = mla_decode(q[..., :D_LATENT], q[..., D_LATENT:], cache, table, lens, SCALE,
                                                    plan, scale)
                                ref, _ = mla_decode_ref(q[..., :D_LATENT].float(), q[..., D_LATENT:].float(), cache,
                                                        table, lens, SCALE, kv_scale=kv_scale if scale is not None
                                                        else 1.0, fp8_queries=plan.fp8_queries(dtype))
                                row[f"{side}_rel_err"] = ((got.float() - ref).norm() / ref.norm()).item()
                            row[f"{side}_us"] = timed(q, cache, table, lens, plan, kv_scale)
                        use(None)
                        row["base/ours"] = row["base_us"] / row["ours_us"]
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        print(json.dumps(row), flush=True)
                        del q, cache, table, lens
                        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
