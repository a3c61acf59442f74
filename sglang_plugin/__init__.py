"""latentspeed's SGLang adapter: thin glue over ``common_kernels``.

``register()`` is the ``sglang.srt.plugins`` entry point; SGLang calls it in the launcher
before parsing arguments and again in every scheduler process. It adds ``latentspeed`` to
the ``--attention-backend`` choices (also ``--decode-attention-backend`` /
``--prefill-attention-backend``) and to the backends that take MHA over chunks of a cached
prefix, registers the backend factory, and adds the quantization
method ``latentspeed_fp8`` (``sglang_plugin/fp8.py``), and hooks ``ModelRunner.forward`` (through
SGLang's ``HookRegistry``) so the fp8 guard counts every forward pass, whichever attention backend
runs, and ``ModelRunner.load_model`` so the producers that the fusion switches name are fused with
the activation quantization (``sglang_plugin/fusion.py``). The DeepSeek tables are filled when the factory first runs, in the scheduler, so the
launcher never imports models.
"""

BACKEND_NAME = "latentspeed"
FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
_registered = False


def register() -> None:
    """Register latentspeed's attention backend and FP8 method with SGLang; idempotent."""
    global _registered
    if _registered:
        return
    from ._compat import check_sglang

    check_sglang()
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.server_args import (
        ATTENTION_BACKEND_CHOICES,
        CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS,
        add_attention_backend_choices,
        add_chunked_prefix_cache_attention_backend,
    )

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS:  # else SGLang never takes MHA over a prefix
        add_chunked_prefix_cache_attention_backend(BACKEND_NAME)
    register_attention_backend(BACKEND_NAME)(create_backend)
    from .fp8 import register_quantization

    register_quantization()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(FORWARD_TARGET, after_forward, HookType.AFTER)
    from .fusion import LOAD_TARGET, after_load_model

    HookRegistry.register(LOAD_TARGET, after_load_model, HookType.AFTER)
    _registered = True


def after_forward(result, *args, **kwargs) -> None:
    """After each forward pass: a step for the fp8 guards (cache writes and ``latentspeed_fp8``'s
    quantizers), which read their counters every 256 steps; the result is left as it is."""
    from common_kernels.guard import step_all

    step_all()


def create_backend(runner):
    """SGLang's factory signature: ``fn(model_runner) -> AttentionBackend``. Where it runs the extends
    (``--attention-backend`` or ``--prefill-attention-backend latentspeed``), the MHA prefill's kernel
    variants are compiled here, not on the first long prompt."""
    import torch

    from common_kernels.mla import warm_up_varlen_attention

    from .mla import LatentspeedMLABackend, register_deepseek_dispatch

    register_deepseek_dispatch()
    backend = LatentspeedMLABackend(runner)
    if runner.server_args.get_attention_backends()[0] == BACKEND_NAME:
        config = runner.model_config
        warm_up_varlen_attention(torch.device(runner.device), runner.dtype,
                                 config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim)
    return backend
