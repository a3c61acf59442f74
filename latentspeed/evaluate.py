"""``latentspeed eval``: perplexity of a text through a real engine, and agreement with a bf16 run.

    latentspeed eval --model DIR --text heldout.txt --engine vllm --attention-backend CUSTOM \
        --kv-cache-dtype fp8_e5m2 --reference [--json]

The text is tokenized with the model's tokenizer and cut into windows; the engine scores every
window as a prompt (vLLM: prompt log-probs; SGLang: input log-probs), returning each token's
log-prob and the top-k. ``--reference`` runs the same engine again with its defaults (its own
attention backend, bf16 KV cache, no quantization) and reports |Δ log-prob|, top-1 agreement and
top-k KL. Each engine runs in its own process (``python -m latentspeed.evaluate SPEC OUT``).

Scoring a window as one prompt never reads the KV cache back, so a quantized cache would not
show. ``--prefill-chunk N`` has the engine prefill N tokens at a time: later chunks then attend
to earlier ones through the cache, in its dtype.
"""

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from .metrics import Position, agreement, perplexity
from .text_input import read_utf8

CHUNK = 16  # windows per engine call: one progress-bar step
PAGED_64 = ("latentspeed", "flashmla")  # SGLang backends that need pages of 64 tokens


def load_windows(model_dir: str, text_file: str, window: int, max_windows: int) -> list[list[int]]:
    """Token windows of the text; ``ValueError`` naming what is wrong with the inputs."""
    model = Path(model_dir)
    if not (model / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model directory: it has no config.json")
    from transformers import AutoConfig, AutoTokenizer

    try:
        AutoConfig.from_pretrained(model)
        tokenizer = AutoTokenizer.from_pretrained(model)
    except Exception as err:  # transformers raises many types; the user needs the reason
        raise ValueError(f"{model_dir} is not loadable: {type(err).__name__}: {err}") from err
    text, _ = read_utf8(text_file, "text file")
    if not text.strip():
        raise ValueError(f"{text_file} is empty")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    windows = [ids[i : i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) >= 2][:max_windows]
    if not windows:
        raise ValueError(f"{text_file} has fewer than two tokens")
    return windows


def require_engine(engine: str) -> None:
    if importlib.util.find_spec(engine) is None:
        pins = {"vllm": "vllm==0.26.0", "sglang": "sglang==0.5.17"}
        raise ValueError(f"{engine} is not installed in this environment: pip install {pins[engine]}")


def _chunks(windows):
    from tqdm import tqdm

    for start in tqdm(range(0, len(windows), CHUNK), desc="scoring windows", unit="chunk", file=sys.stderr):
        yield windows[start : start + CHUNK]


def vllm_kwargs(spec: dict, gpu_bytes: int) -> dict:
    """``vllm.LLM``'s arguments for a scoring spec on a GPU of ``gpu_bytes``."""
    kwargs = dict(model=spec["model"], kv_cache_dtype=spec["kv_cache_dtype"], quantization=spec["quantization"],
                  max_model_len=max(map(len, spec["windows"])) + 1, seed=0, enforce_eager=spec.get("eager", False))
    if spec["attention_backend"]:
        # latentspeed's backend name also selects its MLA prefill, or prompts never reach our kernels.
        prefill = {"mla_prefill_backend": "CUSTOM"} if spec["attention_backend"] == "CUSTOM" else {}
        kwargs["attention_config"] = {"backend": spec["attention_backend"], **prefill}
    if spec.get("prefill_chunk"):
        kwargs.update(enable_chunked_prefill=True, max_num_batched_tokens=spec["prefill_chunk"],
                      max_num_seqs=min(256, spec["prefill_chunk"]))
    if (share := spec.get("gpu_share", 1)) > 1:
        # A fixed cache size skips vLLM's memory profiling, which other processes' frees would upset.
        kwargs.update(gpu_memory_utilization=0.9 / share, kv_cache_memory_bytes=int(0.4 * gpu_bytes / share))
    return kwargs


def _score_vllm(spec: dict) -> list[list[Position]]:
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(**vllm_kwargs(spec, torch.cuda.get_device_properties(0).total_memory))
    params = SamplingParams(max_tokens=1, prompt_logprobs=spec["top_k"], temperature=0.0)
    runs = []
    for chunk in _chunks(spec["windows"]):
        for window, out in zip(chunk, llm.generate([TokensPrompt(prompt_token_ids=w) for w in chunk], params, use_tqdm=False)):
            runs.append([
                Position(tok, step[tok].logprob, {t: lp.logprob for t, lp in step.items() if lp.rank <= spec["top_k"]})
                for tok, step in zip(window[1:], out.prompt_logprobs[1:])
            ])
    return runs


def sglang_kwargs(spec: dict) -> dict:
    """``sglang.Engine``'s arguments for a scoring spec."""
    kwargs = dict(model_path=spec["model"], kv_cache_dtype=spec["kv_cache_dtype"], quantization=spec["quantization"],
                  random_seed=0, disable_cuda_graph=spec.get("eager", False),
                  chunked_prefill_size=spec.get("prefill_chunk") or None)
    if spec["attention_backend"]:
        kwargs["attention_backend"] = spec["attention_backend"]
        kwargs["page_size"] = 64 if spec["attention_backend"] in PAGED_64 else None
    if spec.get("gpu_share", 1) > 1:
        # SGLang sizes its pool from the memory left free; with others on the GPU, cap it at what one call needs.
        kwargs["max_total_tokens"] = CHUNK * max(map(len, spec["windows"])) + 4096
    return kwargs


def _score_sglang(spec: dict) -> list[list[Position]]:
    import sglang as sgl

    engine = sgl.Engine(**sglang_kwargs(spec))
    runs = []
    try:
        for chunk in _chunks(spec["windows"]):
            outs = engine.generate(input_ids=chunk, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                   logprob_start_len=0, top_logprobs_num=spec["top_k"])
            for out in outs:
                meta = out["meta_info"]
                # Entry 0 is the first token itself, which nothing predicts.
                runs.append([
                    Position(tok, lp, {t: v for v, t, _ in top})
                    for (lp, tok, _), top in zip(meta["input_token_logprobs"][1:], meta["input_top_logprobs"][1:])
                ])
    finally:
        engine.shutdown()
    return runs


def score_in_subprocess(spec: dict) -> list[Position]:
    """One engine run in a fresh process; the scored positions of every window, concatenated."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-m", "latentspeed.evaluate", str(spec_path), str(out_path)])
        if proc.returncode:
            raise RuntimeError(f"the {spec['engine']} run failed (exit {proc.returncode}); its log is above")
        rows = json.loads(out_path.read_text())
    return [Position(tok, lp, {int(t): v for t, v in top.items()}) for tok, lp, top in rows]


def run(args) -> dict:
    require_engine(args.engine)
    windows = load_windows(args.model, args.text, args.window, args.max_windows)
    spec = dict(engine=args.engine, model=args.model, attention_backend=args.attention_backend,
                kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, top_k=args.top_k, windows=windows,
                eager=args.eager, prefill_chunk=args.prefill_chunk)
    test = score_in_subprocess(spec)
    report = {"model": args.model, "text": args.text, "windows": len(windows), "tokens_scored": len(test),
              "run": {k: spec[k] for k in ("engine", "attention_backend", "kv_cache_dtype", "quantization")},
              "perplexity": perplexity(test)}
    if args.reference:
        reference = score_in_subprocess({**spec, "attention_backend": None, "kv_cache_dtype": "auto", "quantization": None})
        report["reference_perplexity"] = perplexity(reference)
        report["agreement"] = agreement(reference, test)
    return report


def format_table(report: dict) -> str:
    run = report["run"]
    label = f"{run['engine']} {run['attention_backend'] or 'default backend'}, kv {run['kv_cache_dtype']}" + (
        f", {run['quantization']}" if run["quantization"] else "")
    lines = [f"{'run':<48} {'perplexity':>10}", f"{label:<48} {report['perplexity']:>10.4f}"]
    if "agreement" in report:
        a = report["agreement"]
        lines.append(f"{'reference (engine defaults, bf16)':<48} {report['reference_perplexity']:>10.4f}")
        lines.append(f"|Δ log-prob| mean {a['mean_abs_dlogprob']:.4g}, max {a['max_abs_dlogprob']:.4g} over "
                     f"{a['positions']} tokens; top-1 agreement {a['top1_agreement']}; top-k KL {a['kl_topk']} "
                     f"({a['kl_positions']} positions)")
    return "\n".join(lines)


def _worker(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    runs = _score_vllm(spec) if spec["engine"] == "vllm" else _score_sglang(spec)
    Path(out_path).write_text(json.dumps([[p.token, p.logprob, p.top] for run in runs for p in run]))


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
