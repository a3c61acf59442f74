"""latentspeed's vLLM adapter: thin glue over ``common_kernels``.

``register()`` is the ``vllm.general_plugins`` entry point; vLLM calls it in every process
(front end, engine core, each worker). It registers:

- ``LatentspeedMLABackend`` as ``AttentionBackendEnum.CUSTOM`` (``--attention-backend CUSTOM``);
- ``LatentspeedMLAPrefill`` as ``MLAPrefillBackendEnum.CUSTOM``
  (``-ac '{"mla_prefill_backend": "CUSTOM"}'``);
- ``LatentspeedFp8Config`` as the quantization method ``latentspeed_fp8``
  (``--quantization latentspeed_fp8``; ``vllm_plugin/fp8.py``).

A second entry point, ``vllm.logits_processors``, installs ``vllm_plugin.guard.Fp8GuardStep``,
which steps the fp8 guard once per engine step.

The backends are registered by path, so they are imported only when vLLM selects them; the
quantization registry takes the class itself.
"""

_registered = False

BACKEND_PATH = "vllm_plugin.mla.LatentspeedMLABackend"
PREFILL_PATH = "vllm_plugin.mla_prefill.LatentspeedMLAPrefill"


def register() -> None:
    """Register latentspeed's backends with vLLM; idempotent, raises on an unsupported vLLM."""
    global _registered
    if _registered:
        return
    from ._compat import check_vllm

    check_vllm()
    from vllm.v1.attention.backends.mla.prefill import MLAPrefillBackendEnum, register_mla_prefill_backend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from vllm.model_executor.layers.quantization import register_quantization_config

    from .fp8 import NAME, LatentspeedFp8Config

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, PREFILL_PATH)
    register_quantization_config(NAME)(LatentspeedFp8Config)
    _registered = True
