"""Train the reference model: offline corpus -> BPE tokenizer -> small DeepSeek-V3 -> HF directory.

    python -m benchmarks.reference_model.train --out /tmp/refmodel            # H200: ~6 minutes

Writes ``config.json``, ``model-0000x-of-0000y.safetensors`` (bf16, shards under 16 MiB),
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``, ``metrics.json``
(held-out perplexity, loss, steps, tokens, time, seed), ``heldout.txt`` (the held-out files, the
text ``latentspeed eval`` scores) and ``routing_trace.npz``: for held-out
text, the top-k routed expert ids of every MoE layer and token (uint8 ``[layers, tokens, k]``),
the input of the expert-prefetch policy. Seeds are fixed; the wall-clock budget bounds training.

Routing is DeepSeek-V3's aux-loss-free balancing: after every step each router's
``e_score_correction_bias`` moves by ``bias_rate`` towards equal expert load (a sign update,
no gradient), as in the DeepSeek-V3 report (arXiv:2412.19437, section 2.1.2).
"""

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV3ForCausalLM, GenerationConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from .corpus import build_corpus
from .model_config import ENGINE_FIELDS, reference_config
from .tokenizer import SPECIAL_TOKENS, save_tokenizer, train_tokenizer

HELDOUT_SEPARATOR = "\n\n"


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, each followed by the end-of-text token."""
    eos = tokenizer.token_to_id(SPECIAL_TOKENS[1])
    ids = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


class RoutingRecorder:
    """Forward hooks on every router: the top-k expert ids of the last forward, per layer.

    The ids are recomputed from the router logits with V3's selection (sigmoid scores plus
    ``e_score_correction_bias``; one expert group), because what the router module returns
    differs between transformers releases (logits alone, or logits, weights and ids).
    """

    def __init__(self, model):
        config = model.config
        if config.n_group != 1:
            raise ValueError(f"the routing recorder handles one expert group, not n_group={config.n_group}")
        self.top_k = config.num_experts_per_tok
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.last: list[torch.Tensor] = [torch.empty(0)] * len(self.routers)
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def record(module, inputs, outputs):
            logits = outputs[0] if isinstance(outputs, tuple) else outputs
            scores = logits.detach().float().sigmoid() + module.e_score_correction_bias
            self.last[i] = scores.topk(self.top_k, dim=-1).indices

        return record

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the others."""
        for router, indices in zip(self.routers, self.last):
            bias = router.e_score_correction_bias
            load = torch.bincount(indices.flatten(), minlength=bias.numel()).float()
            bias += rate * torch.sign(load.mean() - load)


def batches(ids: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator):
    """Random training windows ``[batch, seq_len]`` (the model shifts its labels itself)."""
    while True:
        starts = torch.randint(0, ids.numel() - seq_len, (batch,), generator=generator)
        yield torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def heldout_eval(model, ids: torch.Tensor, seq_len: int, max_windows: int, device) -> tuple[float, list[torch.Tensor], torch.Tensor]:
    """Mean next-token loss over non-overlapping held-out windows; also returns the routing of
    those windows and their tokens."""
    model.eval()
    recorder_routes, tokens, losses, count = [], [], 0.0, 0
    recorder = getattr(model, "_routing_recorder")
    for start in range(0, min(ids.numel(), max_windows * seq_len) - seq_len + 1, seq_len):
        window = ids[start : start + seq_len].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(window[None], labels=window[None].clone(), use_cache=False)
        losses += float(out.loss) * (seq_len - 1)  # seq_len - 1 predictions per window
        count += seq_len - 1
        recorder_routes.append(torch.stack([r.view(seq_len, -1) for r in recorder.last]).cpu())
        tokens.append(window.cpu())
    model.train()
    if not count:
        raise ValueError(f"held-out text has fewer than {seq_len} tokens")
    return losses / count, recorder_routes, torch.cat(tokens)


def train(args) -> dict:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    corpus = build_corpus(args.corpus_root, heldout_percent=args.heldout_percent, max_bytes=args.corpus_bytes)
    tokenizer = train_tokenizer(corpus.train, args.vocab_size)
    train_ids, heldout_ids = encode(tokenizer, corpus.train), encode(tokenizer, corpus.heldout)
    config = reference_config(tokenizer.get_vocab_size(), **json.loads(args.config_overrides))
    model = DeepseekV3ForCausalLM(config).to(device)
    model._routing_recorder = RoutingRecorder(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(args.seed)
    stream = batches(train_ids, args.batch, args.seq_len, generator)
    prep_s = time.perf_counter() - t0
    start, step, budget_s = time.perf_counter(), 0, args.minutes * 60
    while step < args.max_steps and time.perf_counter() - start < budget_s:
        # Warm-up, then a cosine decay over whichever runs out first: steps or time.
        progress = min(1.0, max(step / args.max_steps, (time.perf_counter() - start) / budget_s))
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs = next(stream).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss_t = model(inputs, labels=inputs.clone(), use_cache=False).loss
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model._routing_recorder.balance(args.bias_rate)
        step += 1
        if step % 50 == 0 or step == 1:
            print(f"step {step} loss {loss_t.item():.3f} lr {lr:.2e} {time.perf_counter() - start:.0f}s", flush=True)
    if not step:
        raise ValueError("no training step fitted in the budget")
    train_s = time.perf_counter() - start
    loss = float(loss_t.detach())
    heldout_loss, routes, route_tokens = heldout_eval(model, heldout_ids, args.seq_len, args.eval_windows, device)
    metrics = {
        "heldout_perplexity": math.exp(heldout_loss), "heldout_loss": heldout_loss, "final_train_loss": loss,
        "steps": step, "train_tokens": step * args.batch * args.seq_len, "train_seconds": train_s, "prep_seconds": prep_s,
        "seed": args.seed, "parameters": sum(p.numel() for p in model.parameters()),
        "corpus_chars": dict(zip(("train", "heldout"), corpus.sizes())), "corpus_tokens": train_ids.numel(),
        "train_epochs": step * args.batch * args.seq_len / train_ids.numel(), "vocab_size": tokenizer.get_vocab_size(),
        "kv_lora_rank": config.kv_lora_rank, "device": str(device),
    }
    print(f"held-out perplexity {metrics['heldout_perplexity']:.2f} after {step} steps ({train_s:.0f}s)", flush=True)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="15MB")
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, **ENGINE_FIELDS}, indent=2))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, do_sample=False).save_pretrained(out)
    save_tokenizer(tokenizer, out, config.max_position_embeddings)
    np.savez_compressed(
        out / "routing_trace.npz",
        expert_ids=torch.cat(routes, dim=1).numpy().astype(np.uint8),  # [moe layers, tokens, top-k]
        token_ids=route_tokens.numpy().astype(np.int32),
        moe_layers=np.arange(config.first_k_dense_replace, config.num_hidden_layers, dtype=np.int32),
    )
    (out / "heldout.txt").write_text(HELDOUT_SEPARATOR.join(corpus.heldout), encoding="utf-8")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--minutes", type=float, default=5.0, help="training wall-clock budget")
    parser.add_argument("--max-steps", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--bias-rate", type=float, default=1e-3)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--corpus-root", action="append", default=None,
                        help="a folder of Python sources (repeatable); default: the standard library, then site-packages")
    parser.add_argument("--corpus-bytes", type=int, default=96 << 20)
    parser.add_argument("--heldout-percent", type=int, default=2)
    parser.add_argument("--eval-windows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config-overrides", default="{}", help="JSON of DeepseekV3Config fields (tests shrink the model)")
    return train(parser.parse_args(argv))


if __name__ == "__main__":
    main()
