"""latentspeed's MLA attention backend for SGLang: ``--attention-backend latentspeed``.

Reads and writes SGLang's ``MLATokenToKVPool`` (per layer ``[size + page, 1, D_latent + D_rope]``,
fp8 stored as uint8 and viewed as E4M3/E5M2) through ``common_kernels.mla``:

- decode, and extends over a cached prefix (chunked prefill, mixed batches): absorbed MLA
  over the paged latent cache, one query token per request or ragged query counts;
- target verify (EAGLE): the draft tokens of each request attend to the prefix and, per
  SGLang's tree mask, to their ancestors;
- extends that SGLang computes as MHA over the up-projected heads (192 / 128; the model has
  already written their latent rows): new tokens causally against themselves, or in one shot
  against their whole sequence, or against one chunk of the cached prefix at a time (not
  causal, returning the log-sum-exp that SGLang merges).

DeepSeek dispatch: the backend joins ``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS`` (queries arrive
split into ``q_nope`` / ``q_rope``) and takes SGLang's FA3 rule for extends: MHA when there is no
cached prefix or a long one (``SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD``), absorbed MLA for short
prefixes, decode and speculative verification. Absorbed MLA over a long prefix would cost about
3.5 times MHA's FLOPs (576/512-wide products per head instead of 192/128).
"""

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.runtime_context import get_parallel

from common_kernels.fp8_format import FP8_DTYPES
from common_kernels.guard import fp8_guard
from common_kernels.mla import (
    DecodePlan,
    is_supported,
    mla_decode,
    plan_decode,
    sm90_kernels_apply,
    varlen_attention,
    write_latent_cache,
)
from common_kernels.mla.support import SUPPORTED_BLOCK_SIZES

from . import BACKEND_NAME


def register_deepseek_dispatch() -> None:
    """Add the backend to SGLang's DeepSeek tables (in place: the model modules hold the list)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        handle_attention_fa3,
    )
    from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS

    if BACKEND_NAME not in FORWARD_ABSORB_CORE_ATTENTION_BACKENDS:
        FORWARD_ABSORB_CORE_ATTENTION_BACKENDS.append(BACKEND_NAME)
    AttentionBackendRegistry.register(BACKEND_NAME, handle_attention_fa3)


@dataclass
class ForwardMetadata:
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32, cache tokens including this step's queries
    plan: DecodePlan
    query_start_loc: torch.Tensor | None = None  # [B + 1] int32, ragged extends
    kv_start_loc: torch.Tensor | None = None  # [B + 1] int32, extends: prefix sums of seq_lens
    tree_mask: torch.Tensor | None = None  # [B, D] int64, target verify
    max_extend_len: int = 0


class LatentspeedMLABackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        config = model_runner.model_config
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool  # SGLang's MHA prepare reads it off the backend
        self.req_to_token = self.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = model_runner.page_size
        self.num_heads = config.num_attention_heads // get_parallel().attn_tp_size
        self.kv_lora_rank = config.kv_lora_rank
        self.max_context_len = config.context_len
        self.cache_dtype = model_runner.kv_cache_dtype
        self.is_fp8 = self.cache_dtype in FP8_DTYPES
        device_index = torch.cuda.current_device() if torch.cuda.is_available() else None
        capability = torch.cuda.get_device_capability(device_index) if device_index is not None else None
        ok, reason = is_supported(
            num_heads=self.num_heads,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            dtype=model_runner.dtype,
            cache_dtype=self.cache_dtype,
            block_size=self.page_size,
            capability=capability,
        )
        if not ok:
            hint = f" (pass --page-size {SUPPORTED_BLOCK_SIZES[-1]})" if "block size" in reason else ""
            raise ValueError(f"latentspeed attention backend: {reason}{hint}")
        self.num_sms = torch.cuda.get_device_properties(device_index).multi_processor_count if device_index is not None else 1
        self.sm90 = sm90_kernels_apply(torch.device(self.device), self.cache_dtype, self.page_size, config.kv_lora_rank,
                                       config.qk_rope_head_dim)
        # SGLang's own MLA writers (the model's prefill path) store fp8 unscaled: read with 1.
        self.unit_scale = torch.ones(1, dtype=torch.float32, device=self.device)
        # Created here, not lazily: counters first made inside a graph capture would be zeroed
        # by every replay.
        self.guard = fp8_guard(self.unit_scale.device) if self.is_fp8 else None
        self.forward_metadata: ForwardMetadata | None = None
        self.graph_page_table: torch.Tensor | None = None
        self.graph_seq_lens: torch.Tensor | None = None
        self.graph_tree_mask: torch.Tensor | None = None


    def _page_table(self, req_pool_indices: torch.Tensor, num_pages: int) -> torch.Tensor:
        """Page ids of each request's first ``num_pages`` pages (slot // page of each page start)."""
        first_slots = self.req_to_token[req_pool_indices, : num_pages * self.page_size : self.page_size]
        return (first_slots // self.page_size).to(torch.int32)

    def _tree_mask(self, spec_info, seq_lens: torch.Tensor, num_draft: int) -> torch.Tensor:
        """SGLang's FULL_MASK (per request ``D x (seq_len + D)`` booleans, flattened) as one
        int64 ancestor word per draft token: bit ``c`` of word ``[b, i]`` = token i sees draft c."""
        widths = seq_lens.to(torch.int64) + num_draft
        starts = torch.cumsum(num_draft * widths, 0) - num_draft * widths
        rows = torch.arange(num_draft, device=seq_lens.device)
        index = (
            starts[:, None, None]
            + rows[None, :, None] * widths[:, None, None]
            + seq_lens.to(torch.int64)[:, None, None]
            + rows[None, None, :]
        )  # [B, D, D]
        bits = spec_info.custom_mask[index].to(torch.int64)
        return (bits << rows.to(torch.int64)).sum(-1)

    def _plan(self, batch: int, q_len: int, max_seq_len: int) -> DecodePlan:
        return plan_decode(batch, self.num_heads, q_len, max_seq_len, self.num_sms, cache_dtype=self.cache_dtype,
                           sm90=self.sm90)

    def _metadata(self, forward_batch, max_seq_len: int) -> ForwardMetadata:
        mode = forward_batch.forward_mode
        batch = forward_batch.batch_size
        seq_lens = forward_batch.seq_lens.to(torch.int32)
        if mode.is_target_verify():
            num_draft = forward_batch.spec_info.draft_token_num
            tree = self._tree_mask(forward_batch.spec_info, seq_lens, num_draft)
            seq_lens = seq_lens + num_draft
            max_seq_len += num_draft
            plan = self._plan(batch, num_draft, max_seq_len)
            return ForwardMetadata(self._page_table(forward_batch.req_pool_indices, -(-max_seq_len // self.page_size)),
                                   seq_lens, plan, tree_mask=tree)
        page_table = self._page_table(forward_batch.req_pool_indices, -(-max_seq_len // self.page_size))
        if mode.is_decode_or_idle():
            plan = self._plan(batch, 1, max_seq_len)
            return ForwardMetadata(page_table, seq_lens, plan)
        extend_lens = forward_batch.extend_seq_lens.to(torch.int32)
        starts = torch.zeros(2, batch + 1, dtype=torch.int32, device=extend_lens.device)
        torch.cumsum(torch.stack([extend_lens, seq_lens]), 1, out=starts[:, 1:])
        max_extend = max(forward_batch.extend_seq_lens_cpu) if batch else 0
        plan = self._plan(batch, max(1, max_extend), max_seq_len)
        return ForwardMetadata(page_table, seq_lens, plan, query_start_loc=starts[0], kv_start_loc=starts[1],
                               max_extend_len=max_extend)

    def init_forward_metadata(self, forward_batch):
        seq_lens_cpu = forward_batch.seq_lens_cpu
        max_seq_len = int(seq_lens_cpu.max()) if seq_lens_cpu is not None and len(seq_lens_cpu) else self.max_context_len
        self.forward_metadata = self._metadata(forward_batch, max_seq_len)


    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        max_pages = -(-(self.max_context_len + max_num_tokens // max(max_bs, 1)) // self.page_size)
        self.graph_page_table = torch.zeros(max_bs, max_pages, dtype=torch.int32, device=self.device)
        self.graph_seq_lens = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self.graph_tree_mask = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Refill the static buffers the captured kernels read; the plan is fixed per batch size
        (split count for the longest context), so it stays right for any replayed length."""
        fresh = self._metadata(forward_batch, self.max_context_len)
        batch = forward_batch.batch_size
        self.graph_page_table[:batch, : fresh.page_table.shape[1]].copy_(fresh.page_table)
        self.graph_seq_lens[:batch].copy_(fresh.seq_lens)
        tree = None
        if fresh.tree_mask is not None:
            tree = self.graph_tree_mask[: fresh.tree_mask.numel()].view_as(fresh.tree_mask)
            tree.copy_(fresh.tree_mask)
        self.forward_metadata = ForwardMetadata(
            self.graph_page_table[:batch], self.graph_seq_lens[:batch], fresh.plan, tree_mask=tree
        )

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        """Nothing to do: the tree mask is converted in ``init_forward_metadata_out_graph``."""


    def _cache(self, layer) -> torch.Tensor:
        buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return buffer.view(-1, self.page_size, buffer.shape[-1])

    def _save_latent(self, layer, forward_batch, k, k_rope) -> None:
        if layer.k_scale_float not in (None, 1.0):
            raise ValueError(
                f"latentspeed: k_scale {layer.k_scale_float} is not supported with SGLang, whose "
                "own MLA cache writes (prefill) store fp8 unscaled"
            )
        k = k.squeeze(1)
        kv_c, k_pe = (k, k_rope.squeeze(1)) if k_rope is not None else (k[:, : self.kv_lora_rank], k[:, self.kv_lora_rank :])
        write_latent_cache(
            kv_c,
            k_pe,
            self._cache(layer),
            forward_batch.out_cache_loc,
            kv_scale=self.unit_scale if self.is_fp8 else None,
            stats=self.guard.counters if self.guard is not None else None,
        )

    @staticmethod
    def _latent_rows(k, k_rope) -> torch.Tensor:
        """``[T, D_latent + D_rope]`` rows ``[c | r]`` of this step's tokens."""
        k = k.squeeze(1)
        return k if k_rope is None else torch.cat([k, k_rope.squeeze(1)], dim=-1)

    def _absorbed(self, q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope):
        if save_kv_cache and k is not None:
            self._save_latent(layer, forward_batch, k, k_rope)
        heads = layer.tp_q_head_num
        if q_rope is None:
            q = q.reshape(-1, heads, layer.head_dim)
            q_nope, q_pe = q[..., : self.kv_lora_rank], q[..., self.kv_lora_rank :]
        else:
            q_nope, q_pe = q.reshape(-1, heads, self.kv_lora_rank), q_rope.reshape(-1, heads, q_rope.shape[-1])
        meta = self.forward_metadata
        # Extends over an fp8 cache take the new tokens' keys at full precision, as SGLang's
        # own backends do (benchmarks/results/fp8-cache-exposure-2026-12-01.md).
        fresh = k is not None and self.is_fp8 and meta.query_start_loc is not None
        out, _ = mla_decode(
            q_nope,
            q_pe,
            self._cache(layer),
            meta.page_table,
            meta.seq_lens,
            layer.scaling,
            meta.plan,
            kv_scale=self.unit_scale if self.is_fp8 else None,
            tree_mask=meta.tree_mask,
            query_start_loc=meta.query_start_loc,
            fresh_kv=self._latent_rows(k, k_rope).to(q_nope.dtype) if fresh else None,
        )
        return out.view(-1, heads * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None, **kwargs):
        return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None, **kwargs):
        if layer.tp_k_head_num == 1:  # absorbed: over a cached prefix, or target verify
            return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope)
        if save_kv_cache:
            raise NotImplementedError("latentspeed: the MHA prefill path expects the model to write the latent cache")
        return self._mha(q, k, v, layer, forward_batch)

    def _mha(self, q, k, v, layer, forward_batch):
        """One of SGLang's MHA extend calls (module docstring). With ``mha_return_lse`` it returns
        ``(out [T, H, D_v], lse [T, H])``, natural log, the layout ``merge_state_v2`` takes."""
        heads, meta = layer.tp_q_head_num, self.forward_metadata
        if getattr(forward_batch, "attn_attend_prefix_cache", None):
            keys_start, causal = forward_batch.prefix_chunk_cu_seq_lens[forward_batch.prefix_chunk_idx], False
        else:
            keys_start, causal = (meta.kv_start_loc if getattr(forward_batch, "mha_one_shot", None) else meta.query_start_loc), True
        return_lse = bool(getattr(forward_batch, "mha_return_lse", None))
        result = varlen_attention(
            q.view(-1, heads, layer.head_dim),
            k.view(-1, heads, layer.head_dim),
            v.view(-1, heads, layer.v_head_dim),
            meta.query_start_loc,
            keys_start,
            meta.max_extend_len,
            layer.scaling,
            causal=causal,
            return_lse=return_lse,
        )
        if return_lse:
            out, lse = result
            return out, lse.t().contiguous()
        return result.view(-1, heads * layer.v_head_dim)
