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
quantization registry takes the class itself. ``register()`` also routes the ``latentspeed`` logger
through vLLM's handlers (``log_through_vllm``).
"""

import logging

_registered = False

BACKEND_PATH = "vllm_plugin.mla.LatentspeedMLABackend"
PREFILL_PATH = "vllm_plugin.mla_prefill.LatentspeedMLAPrefill"


def log_through_vllm() -> None:
    """Give the ``latentspeed`` logger (the fp8 warm-up's times, the fusion's match count, the guard's
    warnings) vLLM's handlers and level (``VLLM_LOGGING_LEVEL``), as vLLM's own loggers have. Without it
    its INFO records are dropped: vLLM configures the ``vllm`` logger, not the root. Left alone when it
    has handlers already (a user's logging config) or vLLM configured none (``VLLM_CONFIGURE_LOGGING=0``)."""
    ours, theirs = logging.getLogger("latentspeed"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


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
    log_through_vllm()
    _registered = True
