"""latentspeed's MLA prefill backend for vLLM: ``-ac '{"mla_prefill_backend": "CUSTOM"}'``.

vLLM up-projects the latent cache into ordinary heads for prefill and calls this backend for
the new tokens (causal) and for each chunk of cached context (not causal), then merges the
pieces by their log-sum-exp. Both calls run ``common_kernels.mla.varlen_attention``, which
takes ``D_qk = 192`` as 128 + 64 without padding and ``D_v = 128`` without padding V. Its
variants are compiled when the backend is made, before vLLM's JIT monitor starts.
"""

import torch
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.mla.prefill.base import MLADimensions, MLAPrefillBackend

from common_kernels.mla import split_head_dim, varlen_attention, warm_up_varlen_attention


class LatentspeedMLAPrefill(MLAPrefillBackend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        warm_up_varlen_attention(torch.device(self.vllm_config.device_config.device_type),
                                 self.vllm_config.model_config.dtype, self.qk_nope_head_dim + self.qk_rope_head_dim,
                                 self.v_head_dim)

    @staticmethod
    def get_name() -> str:
        return "LATENTSPEED"

    @classmethod
    def supports_compute_capability(cls, device_capability: DeviceCapability) -> bool:
        return device_capability >= DeviceCapability(8, 0)

    @classmethod
    def supports_mla_dimensions(cls, mla_dimensions: MLADimensions) -> bool:
        try:
            split_head_dim(mla_dimensions.qk_nope_head_dim + mla_dimensions.qk_rope_head_dim)
        except ValueError:
            return False
        v = mla_dimensions.v_head_dim
        return v >= 16 and v & (v - 1) == 0

    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
        out: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if output_scale is not None:
            raise NotImplementedError("latentspeed's MLA prefill does not write quantized outputs")
        meta = self._prefill_metadata
        return varlen_attention(
            q,
            k,
            v,
            meta.query_start_loc,
            meta.query_start_loc,
            meta.max_query_len,
            self.scale,
            causal=True,
            return_lse=return_softmax_lse,
            out=out,
        )

    def run_prefill_context_chunk(
        self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        meta = self._prefill_metadata
        return varlen_attention(
            q,
            k,
            v,
            meta.query_start_loc,
            meta.chunked_context.cu_seq_lens[chunk_idx],
            meta.max_query_len,
            self.scale,
            causal=False,
            return_lse=True,
        )
