"""What a kernel becomes on Hopper, read on any machine: compile it for sm_90a with Triton's bundled
ptxas (no GPU, no driver) and report registers, spills, wgmma instructions, pipelined async
copies and the MMA layouts Triton chose.

    python -m benchmarks.hopper_compile decode --heads 128 --cache bf16
    python -m benchmarks.hopper_compile decode --heads 128 --cache e4m3 --sass \
        --set decode_sm90_seesaw.FP8_PV_RING_PAIRS=1   # a launch variant, with its SASS instruction mix
    python -m benchmarks.hopper_compile gemm --block 64 128 --warps 4 --stages 4
    python -m benchmarks.hopper_compile prefill     # every block config the prefill kernel may launch with
    python -m benchmarks.hopper_compile all        # every kernel of common_kernels

The launches mirror the real ones (``_launch_config`` and ``plan_decode`` for the decode, a
tuned-table entry for the GEMM). Pointers and strides are marked 16-byte divisible, as Triton's
runtime marks them: without that hint the compile shows no async copies and spills that the
real launch does not have (``benchmarks/notes.md``, 2026-12-01).
"""

import argparse
import collections
import dataclasses
import inspect
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.runtime.jit import mangle_type

from benchmarks.mla_decode_ab import overridden, parse_settings

HOPPER = GPUTarget("cuda", 90, 128)
HOPPER_SHARED_MEMORY = 227 * 1024  # bytes a block may opt into on sm_90
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
                 torch.float8_e5m2: "fp8e5", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}


@dataclasses.dataclass(frozen=True)
class HopperReport:
    registers: int
    spill_bytes: int  # spill stores + spill loads, per thread
    wgmma: int  # wgmma.mma_async instructions in the PTX
    async_copies: int  # cp.async copies the software pipeliner made (ttgir ops)
    tma_copies: int  # bulk tensor copies (TMA) into shared memory (ttgir ops)
    mma_layouts: tuple[str, ...]  # warpsPerCTA and instrShape of each MMA layout
    wgmma_serialized: bool  # ptxas waits after every wgmma: C7511 (short of registers), C7514/C7515 (see gemm_sm90)
    shared_bytes: int  # shared memory a program takes (sm_90 gives a block at most 227 KiB)
    # warp-specialized kernels: for each partition, the ids of Triton's own warpgroup barriers
    # (``bar.sync ID, 128``) in its code before its first barrier shared with the other partition
    # (``partition_barrier_ids``); empty for other kernels
    partition_barrier_ids: tuple[tuple[int, ...], ...] = ()
    # with ``sass``: the SASS instructions of the cubin by opcode (nvdisasm), most frequent first; static counts,
    # each instruction once wherever it sits (a loop's body counts once)
    sass_opcodes: tuple[tuple[str, int], ...] = ()

    def line(self) -> str:
        return (f"registers {self.registers}, spills {self.spill_bytes} B, shared {self.shared_bytes // 1024} KiB, "
                f"wgmma {self.wgmma}"
                f"{' (serialized by ptxas)' if self.wgmma_serialized else ''}, "
                f"async copies {self.async_copies}, TMA copies {self.tma_copies}, "
                f"mma layouts {'; '.join(self.mma_layouts) or 'none'}"
                + (f", SASS {sum(n for _, n in self.sass_opcodes)} instructions: "
                   + " ".join(f"{op} {n}" for op, n in self.sass_opcodes[:16]) if self.sass_opcodes else ""))


def compile_for_hopper(kernel, pointers: dict, constexprs: dict, num_warps: int, num_stages: int,
                       floats: tuple = (), unaligned: tuple = (), maxnreg: int | None = None,
                       typed: dict | None = None, sass: bool = False) -> HopperReport:
    """Compile ``kernel`` (a ``@triton.jit`` or ``@gluon.jit`` function) for sm_90a, with at most
    ``maxnreg`` registers a thread if given (``sass``: with the SASS opcode counts).

    ``pointers`` maps pointer arguments to their element dtype, ``floats`` names fp32 scalars; every
    other argument is an i32, 16-byte divisible unless named in ``unaligned``; ``typed`` gives the
    signature type of any other (a tensor descriptor: ``triton.runtime.jit.mangle_type`` of one).
    """
    typed = typed or {}
    defaults = {name: param.default for name, param in inspect.signature(kernel.fn).parameters.items()
                if "constexpr" in str(param.annotation) and param.default is not inspect.Parameter.empty}
    constexprs = defaults | constexprs  # the kernel's own defaults where the launch gives none, as a launch does
    given = set(pointers) | set(floats) | set(constexprs) | set(typed) | set(unaligned)
    params = [name for name, param in inspect.signature(kernel.fn).parameters.items()
              if name in given or param.default is inspect.Parameter.empty]  # optional ones only if given
    unknown = given
    if not unknown <= set(params):
        raise ValueError(f"{kernel.fn.__name__} has no argument(s) {sorted(unknown - set(params))}")
    signature = {}
    for name in params:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in typed:
            signature[name] = typed[name]
        elif name in pointers:
            signature[name] = "*" + _TRITON_TYPES[pointers[name]]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(params)
             if signature[name] not in ("constexpr", "fp32") and name not in unaligned and name not in typed}
    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    compiled = triton.compile(source(kernel, signature, constexprs=constexprs, attrs=attrs), target=HOPPER,
                              options=dict(num_warps=num_warps, num_stages=num_stages,
                                           **({"maxnreg": maxnreg} if maxnreg else {})))
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        verbose = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", source.name, "-o", "/dev/null"],
                                 capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", verbose).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", verbose))
    layouts = tuple(sorted(set(re.findall(r"warpsPerCTA = \[\d+, \d+\], instrShape = \[[\d, ]+\]", ttgir))))
    return HopperReport(registers, spills, ptx.count("wgmma.mma_async"), ttgir.count("async_copy_global_to_local"),
                        ttgir.count("async_tma_copy_global_to_local"), layouts,
                        "wgmma.mma_async instructions are serialized" in verbose, compiled.metadata.shared,
                        partition_barrier_ids(ptx), sass_opcodes(compiled.asm["cubin"]) if sass else ())


SIZED_ACCESSES = ("LDG", "STG", "LDS", "STS", "LD", "ST")  # loads and stores: their size is part of the opcode
ACCESS_SIZES = ("U8", "S8", "U16", "S16", "64", "128")  # 32 bits when none is given


def sass_opcodes(cubin: bytes) -> tuple[tuple[str, int], ...]:
    """The cubin's SASS instructions counted by opcode (``QGMMA``, ``LDS``, ...; predicates and modifiers dropped,
    except a load's or store's size other than 32 bits: ``STG.128``, ``LDS.U8``), most frequent first, from the
    nvdisasm that Triton bundles beside its ptxas."""
    nvdisasm = Path(get_ptxas(90).path).with_name("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as binary:
        binary.write(cubin)
        binary.flush()
        listing = subprocess.run([str(nvdisasm), "-c", binary.name], capture_output=True, text=True,
                                 check=True).stdout
    opcodes = []
    for mnemonic in re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", listing, flags=re.M):
        opcode, *modifiers = mnemonic.split(".")
        sizes = [m for m in modifiers if m in ACCESS_SIZES] if opcode in SIZED_ACCESSES else []
        opcodes.append(".".join([opcode, *sizes]))
    return tuple(collections.Counter(opcodes).most_common())


def partition_barrier_ids(ptx: str) -> tuple[tuple[int, ...], ...]:
    """For each partition of a warp-specialized kernel (the PTX between Triton's ``barrier.sync 1``
    hand-offs that holds a 256-thread named barrier), the ids of the 128-thread ``bar.sync`` in its
    code before its first 256-thread one. Two partitions sharing such an id race: a warpgroup's
    barrier can be released by the other's arrivals (the paired decode kernel's first build,
    ``benchmarks/results/mla_decode-sm90-narrow-paired-2026-12-03.md``)."""
    ids = []
    for segment in re.split(r"\n\s*barrier\.sync\s+1;", ptx):
        shared = re.search(r"bar\.(?:sync|arrive)\s+\d+,\s*256;", segment)
        if shared:
            ids.append(tuple(sorted({int(i) for i in re.findall(r"bar\.sync\s+(\d+),\s*128;",
                                                                segment[:shared.start()])})))
    return tuple(ids)


def decode_report(heads: int, q_len: int, cache_dtype: torch.dtype, page: int = 64, varlen: bool = False,
                  prefix_only: bool = False, keys_dense: bool = False, sass: bool = False) -> HopperReport:
    """The MLA decode split kernel as ``mla_decode`` launches it for this shape on sm_90: a Gluon
    kernel (``decode_sm90_seesaw``, ``decode_sm90_narrow``) where one fits, else the Triton kernel
    (``sass``: with the SASS opcode counts)."""
    from common_kernels.fp8_format import FP8_DTYPES
    from common_kernels.mla import decode, decode_sm90_seesaw

    sm90 = decode.sm90_kernel_for(64, cache_dtype, True, page, 512, 64) is not None  # sm90_kernels_apply on an H200
    plan = decode.plan_decode(128, heads, q_len, 8192, 132, cache_dtype=cache_dtype, sm90=sm90)
    keys_dtype = torch.bfloat16 if keys_dense else cache_dtype
    is_fp8 = keys_dtype in FP8_DTYPES
    kernel = decode._mla_decode_split_kernel
    block_n, num_warps, num_stages = decode._launch_config(plan.block_rows, page, is_fp8)
    extra, maxnreg, typed = {}, None, {}
    module = decode.sm90_kernel_for(plan.block_rows, keys_dtype, not keys_dense, page, 512, 64) if sm90 else None
    if module is decode_sm90_seesaw:
        kernel, block_n = module.mla_decode_split_kernel_sm90_seesaw, module.BLOCK_N
        extra = module.launch_options(plan.fp8_probs(keys_dtype))
        num_warps, maxnreg = extra.pop("num_warps"), extra.pop("maxnreg")
    elif module is not None:
        kernel, block_n, num_warps = module.mla_decode_split_kernel_sm90_narrow, module.BLOCK_N, module.NUM_WARPS
        extra = module.launch_options(torch.empty(4, page, 576, dtype=keys_dtype), plan.fp8_probs(keys_dtype),
                                       plan.paired)
        num_warps, maxnreg = extra.pop("num_warps"), extra.pop("maxnreg", None)
        typed = {name: mangle_type(extra.pop(name)) for name in ("kc_desc", "kp_desc") if name in extra}
    pointers = dict(q_nope_ptr=torch.bfloat16, q_pe_ptr=torch.bfloat16, cache_ptr=keys_dtype, block_table_ptr=torch.int32,
                    seq_lens_ptr=torch.int32, kv_scale_ptr=torch.float32, tree_mask_ptr=torch.int64,
                    q_start_ptr=torch.int32, out_ptr=torch.float32, lse_ptr=torch.float32)
    constexprs = dict(NUM_HEADS=heads, D_LATENT=512, D_ROPE=64, PAGE_SIZE=page, BLOCK_R=plan.block_rows, BLOCK_N=block_n,
                      IS_FP8=is_fp8, FP8_QUERIES=plan.fp8_queries(keys_dtype), DIRECT_OUT=False, TREE_MASK=False,
                      VARLEN=varlen, PREFIX_ONLY=prefix_only, KEYS_DENSE=keys_dense, **extra)
    return compile_for_hopper(kernel, pointers, constexprs, num_warps, num_stages,
                              floats=("qk_scale_log2",),
                              unaligned=("uniform_q_len", "stride_out_s", "stride_lse_t", "stride_lse_h"),
                              maxnreg=maxnreg, typed=typed, sass=sass)


def gemm_report(block_m: int, block_n: int, num_warps: int, num_stages: int, maxnreg: int | None = None,
                swap_ab: bool = False, sum_in_launch: bool = False) -> HopperReport:
    """The block-scaled fp8 GEMM kernel at one launch config (``maxnreg``: the config's register cap;
    ``swap_ab``: products as ``B A^T``; ``sum_in_launch``: K-split partials summed by each tile's last split)."""
    from common_kernels.fp8 import gemm

    pointers = dict(a_ptr=torch.float8_e4m3fn, b_ptr=torch.float8_e4m3fn,
                    c_ptr=torch.float32 if sum_in_launch else torch.bfloat16, a_scale_ptr=torch.float32,
                    b_scale_ptr=torch.float32, out_ptr=torch.bfloat16, counters_ptr=torch.int32)
    constexprs = dict(BLOCK_K=gemm.SCALE_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=8, SWAP_AB=swap_ab,
                      SUM_IN_LAUNCH=sum_in_launch)
    return compile_for_hopper(gemm._block_scaled_gemm_kernel, pointers, constexprs, num_warps, num_stages,
                              unaligned=("M", "splits", "stride_asm", "stride_bsn"), maxnreg=maxnreg)


def prefill_report(block_m: int, block_n: int, num_warps: int, num_stages: int, causal: bool = True,
                   store_lse: bool = False) -> HopperReport:
    """The prefill kernel at DeepSeek-V3's head sizes (192/128, bf16) in one block config and launch variant."""
    from common_kernels.mla import prefill

    bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    return compile_for_hopper(
        prefill._varlen_attention_kernel,
        dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, out_ptr=bf16, lse_ptr=f32, cu_q_ptr=i32, cu_k_ptr=i32),
        dict(D_A=128, D_B=64, D_V=128, CAUSAL=causal, STORE_LSE=store_lse, BLOCK_M=block_m, BLOCK_N=block_n),
        num_warps, num_stages, floats=("qk_scale_log2",), unaligned=("stride_lse_t",))


def every_kernel_report() -> dict[str, HopperReport]:
    """Every launchable kernel of ``common_kernels`` at a DeepSeek-V3 launch (fp8 E4M3 where the
    kernel takes fp8), for a check that all of them compile for Hopper."""
    from common_kernels.fp8 import gemm, gemm_sm90, gemm_sm90_ws, moe, moe_sm90_ws, norm_quant, quant, silu_mul_quant
    from common_kernels.mla import cache, decode, prefill

    bf16, fp8, f32, i32, i64 = torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.int64
    e4m3 = dict(FP8_MAX=448.0)
    reports = {f"decode, {h} heads, {name}": decode_report(h, 1, dtype)
               for h in (16, 128) for name, dtype in (("bf16", bf16), ("e4m3", fp8))}
    # 32-row groups (16 heads, 2 tokens): the fp8 kernel's registers are tightest there
    reports["decode, 16 heads, e4m3, 2 tokens"] = decode_report(16, 2, fp8)
    for h in (16, 128):  # an extend with fresh_kv: the prefix from the fp8 cache, the new rows dense
        reports[f"decode, {h} heads, e4m3, extend prefix"] = decode_report(h, 1, fp8, varlen=True, prefix_only=True)
        reports[f"decode, {h} heads, e4m3, extend own rows"] = decode_report(h, 1, fp8, varlen=True, keys_dense=True)
    reports["decode combine"] = compile_for_hopper(
        decode._mla_decode_combine_kernel, dict(part_out_ptr=f32, part_lse_ptr=f32, out_ptr=bf16, lse_ptr=f32),
        dict(D_LATENT=512), 4, 3, unaligned=("num_splits", "stride_po_h", "stride_pl_t", "stride_pl_h", "stride_lse_t"))
    reports["cache write, e4m3"] = compile_for_hopper(
        cache._write_latent_cache_kernel,
        dict(kv_c_ptr=bf16, k_pe_ptr=bf16, cache_ptr=fp8, slot_ptr=i64, scale_ptr=f32, stats_ptr=i32),
        dict(D_LATENT=512, D_ROPE=64, PAGE_SIZE=64, IS_FP8=True, FP8_MAX=448.0, TRACK_STATS=True), 4, 3)
    reports["prefill, 192/128, causal"] = prefill_report(*prefill.prefill_config(192, 128, 2, HOPPER_SHARED_MEMORY))
    reports["group quantizer"] = compile_for_hopper(
        quant._group_quant_kernel, dict(x_ptr=bf16, q_ptr=fp8, scale_ptr=f32, stats_ptr=i32),
        dict(GROUP=128, POW2_SCALE=False, TRACK_STATS=True, BLOCK_ROWS=quant.GROUP_BLOCK_ROWS, **e4m3), 4, 3,
        floats=("eps",), unaligned=("num_rows", "num_cols", "stride_s_m"))
    reports["group quantizer, device row limit"] = compile_for_hopper(  # the fused MoE's unfused intermediate
        quant._group_quant_kernel, dict(x_ptr=bf16, q_ptr=fp8, scale_ptr=f32, stats_ptr=i32, rows_limit_ptr=i32),
        dict(GROUP=128, POW2_SCALE=False, TRACK_STATS=True, BLOCK_ROWS=quant.GROUP_BLOCK_ROWS, **e4m3), 4, 3,
        floats=("eps",), unaligned=("num_rows", "num_cols", "stride_s_m"))
    reports["token quantizer"] = compile_for_hopper(
        quant._token_quant_kernel, dict(x_ptr=bf16, q_ptr=fp8, scale_ptr=f32, stats_ptr=i32),
        dict(BLOCK=1024, POW2_SCALE=False, TRACK_STATS=True, **e4m3), 4, 3, floats=("eps",),
        unaligned=("num_cols",))
    reports["weight block quantizer"] = compile_for_hopper(
        quant._weight_block_quant_kernel, dict(w_ptr=bf16, q_ptr=fp8, scale_ptr=f32, stats_ptr=i32),
        dict(BLOCK=128, TRACK_STATS=True, **e4m3), 4, 3, floats=("eps",),
        unaligned=("num_rows", "num_cols", "stride_s"))
    # RMSNorm + group quantization, with the residual, one DeepSeek-V3 hidden row (7168) a program
    reports["rms norm group quantizer"] = compile_for_hopper(
        norm_quant._rms_norm_group_quant_kernel,
        dict(x_ptr=bf16, residual_ptr=bf16, residual_out_ptr=bf16, weight_ptr=bf16, q_ptr=fp8, scale_ptr=f32,
             stats_ptr=i32),
        dict(HAS_RESIDUAL=True, GROUP=128, NUM_GROUPS=64, POW2_SCALE=False, TRACK_STATS=True, **e4m3), 8, 3,
        floats=("eps", "quant_eps"), unaligned=("num_cols", "stride_s"))
    reports["silu-and-mul group quantizer"] = compile_for_hopper(
        silu_mul_quant._silu_mul_group_quant_kernel, dict(x_ptr=bf16, q_ptr=fp8, scale_ptr=f32, stats_ptr=i32),
        dict(GROUP=128, POW2_SCALE=False, TRACK_STATS=True, BLOCK_ROWS=quant.GROUP_BLOCK_ROWS, **e4m3), 4, 3,
        floats=("quant_eps",), unaligned=("num_rows", "half", "stride_s"))
    reports["silu-and-mul group quantizer, sorted MoE rows"] = compile_for_hopper(  # SEPARATE_ACT's activation
        silu_mul_quant._silu_mul_group_quant_kernel,
        dict(x_ptr=bf16, q_ptr=fp8, scale_ptr=f32, stats_ptr=i32, rows_limit_ptr=i32, pair_ids_ptr=i32),
        dict(GROUP=128, POW2_SCALE=False, TRACK_STATS=True, BLOCK_ROWS=quant.GROUP_BLOCK_ROWS, **e4m3), 4, 3,
        floats=("quant_eps",), unaligned=("num_rows", "half", "stride_s", "num_pairs"))
    reports["gemm 64x128"] = gemm_report(64, 128, 4, 4)
    for swap_ab in (False, True):  # decode's 16-row tiles: products as A B^T, or as B A^T (SWAP_AB)
        reports[f"gemm 16x128{', swapped' if swap_ab else ''}"] = gemm_report(16, 128, 4, 4, swap_ab=swap_ab)
    reports["gemm 16x128, swapped, K splits summed in the launch"] = gemm_report(16, 128, 4, 4, swap_ab=True,
                                                                                sum_in_launch=True)
    for bn in (128, 64):  # the Gluon GEMM (gemm_sm90): its wgmma must not be serialized by ptxas
        reports[f"gemm sm90 128x{bn}"] = compile_for_hopper(
            gemm_sm90.block_scaled_gemm_kernel_sm90, dict(a_ptr=fp8, b_ptr=fp8, c_ptr=bf16, a_scale_ptr=f32,
                                                          b_scale_ptr=f32),
            dict(BLOCK_K=128, BLOCK_M=128, BLOCK_N=bn, GROUP_M=8, NUM_STAGES=4), 8, 1,
            unaligned=("M", "stride_asm", "stride_bsn"))
    # the warp-specialized Gluon GEMM, at DeepSeek-V3's 2048 x 7168: C by bulk stores (16-byte aligned rows),
    # and from registers (any other C)
    for bn, c_tma in ((128, True), (64, True), (128, False)):
        a, b = torch.empty(4096, 7168, dtype=fp8), torch.empty(2048, 7168, dtype=fp8)
        a_desc, b_desc = gemm_sm90_ws.descriptors(a, b, bn)
        c_desc = gemm_sm90_ws.out_descriptor(torch.empty(4096, 2048, dtype=bf16), bn)
        reports[f"gemm sm90 ws 128x{bn}" + ("" if c_tma else ", C from registers")] = compile_for_hopper(
            gemm_sm90_ws.block_scaled_gemm_kernel_sm90_ws, dict(c_ptr=bf16, a_scale_ptr=f32, b_scale_ptr=f32),
            dict(BLOCK_N=bn, GROUP_M=8, NUM_STAGES=6, C_TMA=c_tma), gemm_sm90_ws.NUM_WARPS.value, 1,
            unaligned=("M", "stride_asm", "stride_bsn"), maxnreg=gemm_sm90_ws.MAXNREG,
            typed=dict(a_desc=mangle_type(a_desc), b_desc=mangle_type(b_desc))
            | (dict(c_desc=mangle_type(c_desc)) if c_tma else {}))
    # K split (few tiles at small M: 2112 x 7168 at M = 128): fp32 partials from registers
    for bn, split in ((64, 4), (128, 2)):
        a, b = torch.empty(128, 7168, dtype=fp8), torch.empty(2112, 7168, dtype=fp8)
        a_desc, b_desc = gemm_sm90_ws.descriptors(a, b, bn)
        reports[f"gemm sm90 ws 128x{bn}, split {split}"] = compile_for_hopper(
            gemm_sm90_ws.block_scaled_gemm_kernel_sm90_ws, dict(c_ptr=f32, a_scale_ptr=f32, b_scale_ptr=f32),
            dict(BLOCK_N=bn, GROUP_M=8, NUM_STAGES=6, SPLIT_K=split), gemm_sm90_ws.NUM_WARPS.value, 1,
            unaligned=("M", "stride_asm", "stride_bsn"), maxnreg=gemm_sm90_ws.MAXNREG,
            typed=dict(a_desc=mangle_type(a_desc), b_desc=mangle_type(b_desc)))
    # grouped by expert over 128-row runs, at DeepSeek-V3's 256 experts: the fused MoE's down GEMM (7168 x 2048,
    # rows times their routing weights) and SEPARATE_ACT's gate/up GEMM (4096 x 7168, bf16 products, no weights)
    for label, (n, k), weighted in (("moe down gemm, sm90 ws 128x128", (7168, 2048), True),
                                    ("moe gate/up gemm, sm90 ws 128x128, products", (4096, 7168), False)):
        a, b = torch.empty(49152, k, dtype=fp8), torch.empty(256 * n, k, dtype=fp8)
        a_desc, b_desc = gemm_sm90_ws.descriptors(a, b, 128)
        c_desc = gemm_sm90_ws.out_descriptor(torch.empty(49152, n, dtype=bf16), 128)
        reports[label] = compile_for_hopper(
            gemm_sm90_ws.block_scaled_gemm_kernel_sm90_ws,
            dict(c_ptr=bf16, a_scale_ptr=f32, b_scale_ptr=f32, rows_in_use_ptr=i32, block_expert_ptr=i32,
                 sorted_ids_ptr=i32) | (dict(weights_ptr=f32) if weighted else {}),
            dict(BLOCK_N=128, GROUP_M=8, NUM_STAGES=6, C_TMA=True, GROUPED=True), gemm_sm90_ws.NUM_WARPS.value, 1,
            unaligned=("M", "stride_asm", "stride_bsn", "num_pairs", "stride_bse"), maxnreg=gemm_sm90_ws.MAXNREG,
            typed=dict(a_desc=mangle_type(a_desc), b_desc=mangle_type(b_desc), c_desc=mangle_type(c_desc)))
    # the fused MoE's gate/up GEMM, warp-specialized, at DeepSeek-V3 (2 x 2048 x 7168 experts), 128-row runs
    a, w13 = torch.empty(49152, 7168, dtype=fp8), torch.empty(256, 4096, 7168, dtype=fp8)
    a_desc, w_desc = moe_sm90_ws.descriptors(a, w13)
    reports["moe gate/up gemm, sm90 ws, quantizing"] = compile_for_hopper(
        moe_sm90_ws.moe_gate_up_kernel_sm90_ws,
        dict(a_scale_ptr=f32, w_scale_ptr=f32, h_ptr=fp8, h_scale_ptr=f32, stats_ptr=i32, rows_in_use_ptr=i32,
             sorted_ids_ptr=i32, block_expert_ptr=i32),
        dict(RUN_ROWS=128, GROUP_M=8, NUM_STAGES=5, MID_DTYPE=tl.bfloat16, TRACK_STATS=True, **e4m3),
        gemm_sm90_ws.NUM_WARPS.value, 1, floats=("eps",),
        unaligned=("num_pairs", "stride_asm", "stride_wse", "stride_wsn", "stride_hsm"), maxnreg=gemm_sm90_ws.MAXNREG,
        typed=dict(a_desc=mangle_type(a_desc), w_desc=mangle_type(w_desc)))
    reports["gemm split-k sum"] = compile_for_hopper(
        gemm._split_k_sum_kernel, dict(partial_ptr=f32, c_ptr=bf16), dict(SPLIT_K=4, BLOCK=1024), 4, 3,
        unaligned=("M",))
    # the expert sort at DeepSeek-V3, 4096 tokens (18 programs of 2048 pairs)
    reports["moe expert count"] = compile_for_hopper(
        moe._count_by_expert_kernel, dict(ids_ptr=i32, cursor_ptr=i32, sorted_ids_ptr=i32),
        dict(E_PAD=512, CHUNK=2048), 4, 3, unaligned=("pairs", "num_experts", "size"))
    reports["moe expert run starts"] = compile_for_hopper(
        moe._run_starts_kernel, dict(cursor_ptr=i32, block_expert_ptr=i32, used_rows_ptr=i32),
        dict(BLOCK_M=64, E_PAD=512, P_PAD=32, BLOCKS_CHUNK=32), 8, 3, unaligned=("programs", "num_experts", "size"))
    reports["moe expert scatter"] = compile_for_hopper(
        moe._scatter_by_expert_kernel, dict(ids_ptr=i32, sorted_ids_ptr=i32, position_ptr=i32, cursor_ptr=i32),
        dict(E_PAD=512, CHUNK=2048), 4, 3, unaligned=("pairs", "num_experts"))
    # decode batches (up to moe.ONE_LAUNCH_MAX_PAIRS): the three phases in one program
    reports["moe expert sort, one program"] = compile_for_hopper(
        moe._align_one_program_kernel,
        dict(ids_ptr=i32, cursor_ptr=i32, sorted_ids_ptr=i32, block_expert_ptr=i32, position_ptr=i32,
             used_rows_ptr=i32), dict(BLOCK_M=16, E_PAD=512, CHUNK=1024, BLOCKS_CHUNK=32), 8, 3,
        unaligned=("pairs", "num_experts", "size"))
    # gate/up also with its quantizing epilogue (the intermediate stored as E4M3 and group scales); "capped":
    # launches tune_fp8_moe tries under a register cap, three programs a multiprocessor; 16-row runs (decode)
    # with products as A B^T, or as B A^T ("swapped")
    for name, gated, quantizing, block_m, warps, stages, maxnreg, swap_ab in (
            ("gate/up", True, False, 64, 8, 4, None, False), ("gate/up, quantizing", True, True, 64, 8, 4, None, False),
            ("down", False, False, 64, 4, 3, None, False),
            ("gate/up, quantizing, capped", True, True, 16, 4, 3, 168, False),
            ("down, capped", False, False, 64, 4, 3, 168, False),
            ("gate/up, quantizing, 16-row runs", True, True, 16, 4, 4, None, False),
            ("gate/up, quantizing, 16-row runs, swapped", True, True, 16, 4, 4, None, True),
            ("down, 16-row runs", False, False, 16, 4, 4, None, False),
            ("down, 16-row runs, swapped", False, False, 16, 4, 4, None, True)):
        reports[f"moe {name} gemm"] = compile_for_hopper(
            moe._moe_gemm_kernel,
            dict(a_ptr=fp8, a_scale_ptr=f32, b_ptr=fp8, b_scale_ptr=f32, c_ptr=fp8 if quantizing else bf16,
                 c_scale_ptr=f32, stats_ptr=i32, sorted_ids_ptr=i32, block_expert_ptr=i32, weights_ptr=f32),
            dict(ROWS_PER_A=8 if gated else 1, A_SORTED=not gated, GATED=gated, APPLY_WEIGHT=not gated, BLOCK_M=block_m, BLOCK_N=128,
                 BLOCK_K=128, QUANT_OUT=quantizing, MID_DTYPE=tl.bfloat16, TRACK_STATS=quantizing, ONE_SCALE=True,
                 SWAP_AB=swap_ab, **e4m3),
            warps, stages, floats=("eps",), unaligned=("num_pairs", "stride_asm", "stride_bsn", "stride_csm"),
            maxnreg=maxnreg)
    reports["moe slot sum"] = compile_for_hopper(
        moe._sum_slots_kernel, dict(rows_ptr=bf16, position_ptr=i32, out_ptr=bf16),
        dict(TOP_K=8, K_PAD=8, BLOCK_H=moe.SUM_BLOCK_H), 4, 3, unaligned=("num_rows", "H"))
    return reports


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON list of the reports instead of lines")
    kernels = parser.add_subparsers(dest="kernel", required=True)
    decode = kernels.add_parser("decode")
    decode.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    decode.add_argument("--q-len", type=int, default=1)
    decode.add_argument("--cache", nargs="+", default=["bf16", "e4m3"], choices=["bf16", "e4m3", "e5m2"])
    decode.add_argument("--extend", action="store_true",
                        help="also the two launches of an extend with fresh_kv (prefix from the cache, own rows dense)")
    decode.add_argument("--set", nargs="+", default=[], metavar="MODULE.NAME=INT",
                        help="a decode module's constant for the plan and the compile (mla_decode_ab's --ours-set)")
    decode.add_argument("--sass", action="store_true", help="with the SASS instructions counted by opcode")
    kernels.add_parser("all", help="every kernel at a DeepSeek-V3 launch")
    kernels.add_parser("prefill", help="the prefill kernel in each block config it may launch with")
    gemm = kernels.add_parser("gemm")
    gemm.add_argument("--block", type=int, nargs=2, default=[64, 128], metavar=("M", "N"))
    gemm.add_argument("--warps", type=int, default=4)
    gemm.add_argument("--stages", type=int, default=4)
    gemm.add_argument("--maxnreg", type=int, help="the config's register cap a thread (more programs an SM)")
    gemm.add_argument("--swap-ab", action="store_true", help="products as B A^T (the config's SWAP_AB)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 replaces compiled kernels by the interpreter: unset it")
    reports = {}
    if args.kernel == "decode":
        dtypes = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
        with overridden(parse_settings(args.set)):
            for heads in args.heads:
                for cache in args.cache:
                    label = f"decode, {heads} heads, q_len {args.q_len}, {cache}"
                    reports[label] = decode_report(heads, args.q_len, dtypes[cache], sass=args.sass)
                    if args.extend:
                        reports[f"{label}, extend prefix"] = decode_report(
                            heads, args.q_len, dtypes[cache], varlen=True, prefix_only=True, sass=args.sass)
                        reports[f"{label}, extend own rows"] = decode_report(
                            heads, args.q_len, dtypes[cache], varlen=True, keys_dense=True, sass=args.sass)
    elif args.kernel == "all":
        reports = every_kernel_report()
    elif args.kernel == "prefill":
        from common_kernels.mla.prefill import _PREFILL_CONFIGS, LAUNCH_VARIANTS

        for config in _PREFILL_CONFIGS:
            for causal, lse in LAUNCH_VARIANTS:
                kind = ("causal" if causal else "chunk") + (", lse" if causal and lse else "")
                reports[f"prefill {config}, {kind}"] = prefill_report(*config, causal, lse)
    else:
        label = f"gemm {args.block[0]}x{args.block[1]}, {args.warps} warps, {args.stages} stages"
        label += (f", maxnreg {args.maxnreg}" if args.maxnreg else "") + (", swapped" if args.swap_ab else "")
        reports[label] = gemm_report(*args.block, args.warps, args.stages, args.maxnreg, args.swap_ab)
    if args.json:
        print(json.dumps([{"label": label, **dataclasses.asdict(report)} for label, report in reports.items()]))
    else:
        for label, report in reports.items():
            print(f"{label}: {report.line()}")


if __name__ == "__main__":
    main()
