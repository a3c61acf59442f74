"""Block-FP8 fused MoE time: latentspeed's ``fused_moe_fp8`` against vLLM's, same weights and routing,
one process. ``vLLM-Triton`` is vLLM's Triton ``fused_experts`` (``use_fp8_w8a8``, 128 x 128 blocks),
what vLLM 0.26 serves on Hopper under tensor parallelism; ``vLLM-DeepGEMM`` is what ``--moe-backend
deep_gemm`` serves, assembled as vLLM's FP8 MoE oracle does: DeepGEMM's grouped GEMMs on E8M0 weight
scales (``VLLM_USE_DEEP_GEMM_E8M0=0``: fp32 scales, and Triton below 128 tokens), its row's
``served_by`` naming the experts that ran. ``SGLang-Triton`` (SGLang on the path instead of vLLM) is
SGLang's Triton ``fused_experts``, what SGLang 0.5.17 serves without DeepEP.

Shapes: DeepSeek-V3's experts (256 routed, top 8, hidden 7168, intermediate 2048), one rank's share
of them under 8-way tensor parallelism (``deepseek_v3_tp8``: intermediate 256, what each of eight
H200s runs when vLLM serves the model with ``-tp 8``; the full shape fits no single card), the tiny
model's (8 experts, top 2, hidden 1024, intermediate 256) and the reference model's, at T = 1 ... 4096
tokens routed at random.
CUDA-event medians (``triton.testing.do_bench``, L2 flushed), of eager calls (host launch overhead
included) or, with ``--cuda-graph``, of CUDA-graph replays (the GPU work alone, as engines run decode).
Each output is compared with the exact MoE, and each engine's with ours; ``workspace_mib`` is the GPU
memory one eager call takes at its peak beyond what was allocated before it (intermediates, output; a
workspace an engine keeps from an earlier call is not counted again). ``--ws`` adds
``latentspeed-sm90-ws``: both GEMMs on the warp-specialized Hopper kernels at one launch
(``WS_CONFIG``), whatever the tuned table says, and ``latentspeed-sm90-ws-separate``: the same with
gate/up as bf16 products on the down GEMM's kernel, activated and quantized after it
(``WS_SEPARATE_CONFIG``, ``SEPARATE_ACT``).

    python -m benchmarks.fp8_moe --out benchmarks/results/fp8_moe.json
"""

import argparse
import functools
import json
import sys

import torch
import triton

from benchmarks.timing import in_cuda_graph
from common_kernels.fp8 import fused_moe_fp8
from common_kernels.fp8.reference import dequantize_weight_blocks_ref

SHAPES = {"deepseek_v3": (256, 8, 7168, 2048), "deepseek_v3_tp8": (256, 8, 7168, 256), "tiny": (8, 2, 1024, 256),
          "refmodel": (8, 2, 256, 128)}
WS_CONFIG = {"BLOCK_M": 128, "gate_up": {"KERNEL": "sm90_ws", "BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
             "down": {"KERNEL": "sm90_ws", "BLOCK_N": 128, "num_warps": 4, "num_stages": 6}}
WS_SEPARATE_CONFIG = dict(WS_CONFIG, gate_up=dict(WS_CONFIG["down"], SEPARATE_ACT=True))


def expert_weights(experts, rows, cols):
    """Random E4M3 experts ``[E, rows, cols]`` at init scale with their 128 x 128 block scales, made one
    expert at a time (all of DeepSeek-V3's gate/up weights would take 30 GB in fp32, more than an H100's
    room for three such temporaries)."""
    q = torch.empty(experts, rows, cols, dtype=torch.float8_e4m3fn, device="cuda")
    scale = torch.empty(experts, rows // 128, cols // 128, device="cuda")
    for e in range(experts):
        blocks = (torch.randn(rows, cols, device="cuda") * 0.02).view(rows // 128, 128, cols // 128, 128)
        scale[e] = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-10) / 448.0
        q[e] = (blocks / scale[e][:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(rows, cols)
    return q, scale


def routed_inputs(shape: str, token_counts):
    """``(tokens, (x, w13, s13, w2, s2, weights, ids))`` for each of ``token_counts``: ``shape``'s experts
    (``expert_weights``, made once) and ``tokens`` random bf16 rows routed at random (top k of a softmax,
    int32 ids)."""
    experts, top_k, hidden, inter = SHAPES[shape]
    w13, s13 = expert_weights(experts, 2 * inter, hidden)
    w2, s2 = expert_weights(experts, hidden, inter)
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(top_k, dim=-1)
        yield tokens, (x, w13, s13, w2, s2, weights, ids.to(torch.int32))


def exact_moe(x, w13, s13, w2, s2, weights, ids):
    """The MoE in fp32 on the dequantized weights with unquantized activations: what both FP8 kernels
    approximate, so each one's own error (not only their difference) is known."""
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[rows].float() @ dequantize_weight_blocks_ref(w13[e], s13[e]).T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ dequantize_weight_blocks_ref(w2[e], s2[e]).T
        out.index_add_(0, rows, y * weights[rows, slot, None])
    return out


def transient_mib(fn) -> float:
    """The GPU memory one eager call takes beyond what was allocated before it (its buffers and output),
    at its peak, in MiB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def rel_diff(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


def vllm_fused(x, w13, s13, w2, s2, weights, ids):
    from vllm.model_executor.layers.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    config = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=[128, 128])
    return lambda: fused_experts(x, w13, w2, weights, ids, quant_config=config)


def sglang_fused(x, w13, s13, w2, s2, weights, ids):
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    experts, top_k, inter = w13.shape[0], ids.shape[1], w2.shape[2]
    config = MoeRunnerConfig(num_experts=experts, num_local_experts=experts, hidden_size=x.shape[1],
                             intermediate_size_per_partition=inter, top_k=top_k, params_dtype=x.dtype, inplace=False,
                             gate_up_interleaved=False)  # W13 is [gate; up], as DeepSeek-V3's checkpoints hold it
    routing = StandardTopKOutput(weights, ids, None)
    return lambda: fused_experts(x, w13, w2, routing, config, use_fp8_w8a8=True, w1_scale=s13, w2_scale=s2,
                                 block_shape=[128, 128])


def vllm_oracle_kernel(backend_name, x, w13, s13, w2, s2, weights, ids):
    """vLLM's FP8 MoE for ``backend_name`` (an ``Fp8MoeBackend`` member) as its oracle assembles it on
    one GPU: the weights converted to that backend's layout (copies: DeepGEMM's E8M0 requantization
    works in place), its prepare/finalize without EP, and its experts. Returns the call and the name of
    the experts class that serves these shapes."""
    import types

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as oracle
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    backend = oracle.Fp8MoeBackend[backend_name]
    experts, top_k, inter = w13.shape[0], ids.shape[1], w2.shape[2]
    w13, w2, s13, s2 = oracle.convert_to_fp8_moe_kernel_format(
        backend, types.SimpleNamespace(weight_block_size=[128, 128]), w13.clone(), w2.clone(), s13.clone(),
        s2.clone(), None, None)
    quant_config = oracle.make_fp8_moe_quant_config(backend, s13, s2, None, None, block_shape=[128, 128])
    moe_config = FusedMoEConfig(
        num_experts=experts, experts_per_token=top_k, hidden_dim=x.shape[1], intermediate_size=inter,
        num_local_experts=experts, num_logical_experts=experts, activation=MoEActivation.SILU, device=x.device,
        routing_method=RoutingMethodType.Unspecified, moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=x.dtype)
    kernel = oracle.make_fp8_moe_kernel(quant_config, moe_config, oracle.backend_to_kernel_cls(backend)[0], backend)
    if not is_workspace_manager_initialized():
        init_workspace_manager(x.device)
    chosen = kernel.fused_experts
    if hasattr(chosen, "_select_experts_impl"):  # a fallback pair picks its experts per call, by shape
        chosen = chosen._select_experts_impl(x, w13, w2)
    return (lambda: kernel.apply(x, w13, w2, weights, ids, MoEActivation.SILU, experts, None, False),
            type(chosen).__name__)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays (no host overhead)")
    parser.add_argument("--ws", action="store_true", help="add both GEMMs on the warp-specialized Hopper kernels")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        experts, top_k, hidden, inter = SHAPES[shape]
        for tokens, (x, w13, s13, w2, s2, weights, ids) in routed_inputs(shape, args.tokens):
            # Engines pass check_ids=False (their routers give valid ids): the check is a host synchronization.
            providers = {"latentspeed": lambda: fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, check_ids=False)}
            if args.ws:
                for name, config in (("latentspeed-sm90-ws", WS_CONFIG),
                                     ("latentspeed-sm90-ws-separate", WS_SEPARATE_CONFIG)):
                    providers[name] = functools.partial(fused_moe_fp8, x, w13, s13, w2, s2, weights, ids,
                                                        check_ids=False, config=config)
            try:
                providers["vLLM-Triton"] = vllm_fused(x, w13, s13, w2, s2, weights, ids)
            except Exception as err:  # vLLM missing on this host
                print(f"vLLM-Triton unavailable ({type(err).__name__}: {err})", file=sys.stderr)
            try:
                providers["SGLang-Triton"] = sglang_fused(x, w13, s13, w2, s2, weights, ids)
            except Exception as err:  # SGLang missing on this host
                print(f"SGLang-Triton unavailable ({type(err).__name__}: {err})", file=sys.stderr)
            served_by = {}
            try:
                providers["vLLM-DeepGEMM"], served_by["vLLM-DeepGEMM"] = vllm_oracle_kernel(
                    "DEEPGEMM", x, w13, s13, w2, s2, weights, ids)
            except Exception as err:  # vLLM or DeepGEMM missing on this host
                print(f"vLLM-DeepGEMM unavailable ({type(err).__name__}: {err})", file=sys.stderr)
            outs, exact = {}, exact_moe(x, w13, s13, w2, s2, weights, ids)
            for name, fn in providers.items():
                try:
                    workspace_mib = transient_mib(fn)
                    fn = in_cuda_graph(fn) if args.cuda_graph else fn
                    outs[name] = fn().float()
                    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                except Exception as err:  # an engine's kernel refusing a shape, or missing on this card
                    if name.startswith("latentspeed"):
                        raise
                    print(f"{name} {shape} {tokens}: failed ({type(err).__name__}: {str(err)[:200]})", file=sys.stderr)
                    continue
                flops = 2 * tokens * top_k * (2 * inter * hidden + hidden * inter)
                row = dict(shape=shape, tokens=tokens, provider=name, cuda_graph=args.cuda_graph, us=ms * 1e3,
                           tflop_s=flops / ms / 1e9, rel_err_vs_exact=rel_diff(outs[name], exact),
                           workspace_mib=workspace_mib)
                if name in served_by:
                    row["served_by"] = served_by[name]
                if name.startswith(("vLLM", "SGLang")):
                    row["rel_diff_vs_latentspeed"] = rel_diff(outs["latentspeed"], outs[name])
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"card": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
