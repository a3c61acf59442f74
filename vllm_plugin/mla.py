"""latentspeed's MLA decode backend for vLLM: ``--attention-backend CUSTOM``.

Subclasses vLLM's MLA common backend, metadata builder and impl, and swaps in two
``common_kernels.mla`` kernels: the paged latent-cache write (``do_kv_cache_update``) and the
weight-absorbed decode (``forward_mqa``). Prefill stays with the selected MLA prefill backend
(``vllm_plugin.mla_prefill`` under ``-ac '{"mla_prefill_backend": "CUSTOM"}'``).

Beyond the built-ins: fp8 E5M2 caches, several query tokens per request (spec decode) with
full CUDA graphs, and an fp8 saturation guard (``common_kernels.guard``).
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import vllm.envs as envs
from vllm.config import get_current_vllm_config
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
    get_mla_dims,
)
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.utils.platform_utils import num_compute_units
from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer, AttentionType
from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

from common_kernels.fp8_format import FP8_DTYPES
from common_kernels.guard import fp8_guard
from common_kernels.mla import (
    DecodePlan,
    is_supported,
    max_workspace_tokens_times_splits,
    mla_decode,
    plan_decode,
    sm90_kernels_apply,
    write_latent_cache,
)
from common_kernels.mla.support import SUPPORTED_BLOCK_SIZES

from .fp8 import NAME as FP8_METHOD
from .guard import steps_every_engine_step

_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of vLLM's ``--kv-cache-dtype`` as the kernels see it."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _CACHE_DTYPES:
        raise ValueError(
            f"kv-cache dtype {kv_cache_dtype!r} is not supported by latentspeed: "
            f"use one of {LatentspeedMLABackend.supported_kv_cache_dtypes}"
        )
    return _CACHE_DTYPES[kv_cache_dtype]


def _capability() -> tuple[int, int] | None:
    cap = current_platform.get_device_capability()
    return None if cap is None else (cap.major, cap.minor)


class LatentspeedMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto",
        "float16",
        "bfloat16",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
    ]

    @staticmethod
    def get_name() -> str:
        return "LATENTSPEED_MLA"

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return list(SUPPORTED_BLOCK_SIZES)

    @staticmethod
    def get_impl_cls() -> type["LatentspeedMLAImpl"]:
        return LatentspeedMLAImpl

    @staticmethod
    def get_builder_cls() -> type["LatentspeedMLAMetadataBuilder"]:
        return LatentspeedMLAMetadataBuilder

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability >= DeviceCapability(8, 0)

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        """Refuse, with latentspeed's own reason, a model the kernels do not cover."""
        model_config = get_current_vllm_config().model_config
        if model_config is None or not use_mla or kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            return None  # vLLM's own checks report these
        dims = get_mla_dims(model_config)
        ok, reason = is_supported(
            num_heads=model_config.get_num_attention_heads(get_current_vllm_config().parallel_config),
            kv_lora_rank=dims.kv_lora_rank,
            qk_nope_head_dim=dims.qk_nope_head_dim,
            qk_rope_head_dim=dims.qk_rope_head_dim,
            v_head_dim=dims.v_head_dim,
            dtype=dtype,
            cache_dtype=cache_torch_dtype(kv_cache_dtype or "auto", dtype),
            block_size=block_size,
            capability=(device_capability.major, device_capability.minor),
        )
        return None if ok else f"latentspeed: {reason}"


@dataclass
class LatentspeedDecodeMetadata(MLACommonDecodeMetadata):
    plan: DecodePlan


@dataclass
class LatentspeedMLAMetadata(MLACommonMetadata[LatentspeedDecodeMetadata]):
    pass


class LatentspeedMLAMetadataBuilder(MLACommonMetadataBuilder[LatentspeedMLAMetadata]):
    # Decode batches of uniform query length (1 + speculative tokens) replay in full graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, LatentspeedMLAMetadata)
        if self.dcp_world_size > 1:
            raise NotImplementedError("latentspeed's MLA backend does not support decode context parallelism yet")
        if self.page_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"latentspeed: block size {self.page_size} is not supported: use --block-size "
                f"{' or '.join(map(str, SUPPORTED_BLOCK_SIZES))}"
            )
        self._num_sms = num_compute_units(device.index or 0)
        quantized = vllm_config.quant_config is not None and vllm_config.quant_config.get_name() == FP8_METHOD
        fp8_cache = kv_cache_spec.cache_dtype_str.startswith("fp8")
        self._cache_dtype = cache_torch_dtype(kv_cache_spec.cache_dtype_str, kv_cache_spec.dtype)
        self._sm90 = sm90_kernels_apply(device, self._cache_dtype, self.page_size, self.mla_dims.kv_lora_rank,
                                        self.mla_dims.qk_rope_head_dim)
        # One host read every check_every steps covers the cache writes and latentspeed_fp8's linears.
        # Where vLLM builds vllm_plugin.guard's logits processor, that steps the guard; here otherwise.
        self._fp8_guard = (fp8_guard(device) if (fp8_cache or quantized) and not steps_every_engine_step(vllm_config)
                           else None)
        self._reserve_decode_workspace()

    def _reserve_decode_workspace(self) -> None:
        """Reserve the split-KV scratch once, at its bound, before CUDA-graph capture locks it."""
        if not is_workspace_manager_initialized():
            return
        bound = self.reorder_batch_threshold * max_workspace_tokens_times_splits(
            self.vllm_config.scheduler_config.max_num_seqs, self._num_sms
        )
        current_workspace_manager().get_simultaneous(
            ((bound, self.num_heads, 1, self.mla_dims.kv_lora_rank), torch.float32),
            ((bound, self.num_heads, 1), torch.float32),
        )

    def _build_decode(
        self,
        block_table_tensor,
        seq_lens_device,
        max_seq_len,
        query_start_loc_cpu,
        query_start_loc_device,
        num_decode_tokens,
        dcp_tot_seq_lens_device,
    ) -> LatentspeedDecodeMetadata:
        num_decodes = query_start_loc_cpu.shape[0] - 1
        if num_decode_tokens % num_decodes:
            raise ValueError(f"latentspeed: {num_decode_tokens} decode tokens over {num_decodes} requests is not uniform")
        plan = plan_decode(
            batch=num_decodes,
            num_heads=self.num_heads,
            q_len=num_decode_tokens // num_decodes,
            max_seq_len=max_seq_len,
            num_sms=self._num_sms,
            num_splits=1 if envs.VLLM_BATCH_INVARIANT else None,
            cache_dtype=self._cache_dtype,
            sm90=self._sm90,
        )
        if self._fp8_guard is not None:
            self._fp8_guard.step()
        return LatentspeedDecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            plan=plan,
        )


class LatentspeedMLAImpl(MLACommonImpl[LatentspeedMLAMetadata]):
    can_return_lse_for_decode: bool = True

    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype,
        logits_soft_cap,
        attn_type,
        kv_sharing_target_layer_name,
        **mla_args,
    ) -> None:
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError("latentspeed's MLA backend supports no ALiBi, sliding window or logit soft-cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"latentspeed's MLA backend supports decoder self-attention only, not {attn_type}")
        self._cache_dtype = cache_torch_dtype(kv_cache_dtype, torch.get_default_dtype())
        ok, reason = is_supported(
            num_heads=num_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            dtype=torch.get_default_dtype(),
            cache_dtype=self._cache_dtype,
            capability=_capability(),
        )
        if not ok:
            raise ValueError(f"latentspeed MLA backend: {reason}")
        self._is_fp8 = self._cache_dtype in FP8_DTYPES
        # Queries stay in the model dtype; the kernel reads fp8 E4M3 and E5M2 caches alike.
        self.supports_quant_query_input = False

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        if kv_cache.numel() == 0:
            return
        write_latent_cache(
            kv_c_normed,
            k_pe,
            kv_cache.view(self._cache_dtype),
            slot_mapping.flatten(),
            kv_scale=k_scale if self._is_fp8 else None,
            stats=fp8_guard(kv_cache.device).counters if self._is_fp8 else None,
        )

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: LatentspeedMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        decode = attn_metadata.decode
        q_nope, q_pe = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        workspace = None
        if decode.plan.num_splits > 1 and is_workspace_manager_initialized():
            out_shape, lse_shape = decode.plan.workspace_shapes(self.kv_lora_rank)
            workspace = tuple(
                current_workspace_manager().get_simultaneous((out_shape, torch.float32), (lse_shape, torch.float32))
            )
        return mla_decode(
            q_nope,
            q_pe,
            # vLLM views every fp8 cache as E4M3; re-view it as what was written.
            kv_c_and_k_pe_cache.view(self._cache_dtype),
            decode.block_table,
            decode.seq_lens,
            self.scale,
            decode.plan,
            kv_scale=layer._k_scale if self._is_fp8 else None,
            workspace=workspace,
        )
