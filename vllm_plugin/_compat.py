"""The vLLM versions latentspeed's adapter supports, checked by feature and by version."""

from importlib.metadata import PackageNotFoundError, version

SUPPORTED = "0.26"


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM lacks an extension point latentspeed plugs into."""


def check_vllm() -> str:
    """Return the installed vLLM version, or raise ``UnsupportedVllmError`` naming what is missing."""
    try:
        found = version("vllm")
    except PackageNotFoundError as err:
        raise UnsupportedVllmError("vLLM is not installed: pip install vllm==0.26.0") from err
    missing = []
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        if "CUSTOM" not in AttentionBackendEnum.__members__:
            missing.append("AttentionBackendEnum.CUSTOM")
    except ImportError:
        missing.append("vllm.v1.attention.backends.registry")
    try:
        from vllm.v1.attention.backends.mla.prefill import MLAPrefillBackendEnum  # noqa: F401
    except ImportError:
        missing.append("vllm.v1.attention.backends.mla.prefill (register_mla_prefill_backend)")
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl  # noqa: F401
    except ImportError:
        missing.append("vllm.model_executor.layers.attention.mla_attention.MLACommonImpl")
    if missing or not found.startswith(SUPPORTED + "."):
        raise UnsupportedVllmError(
            f"latentspeed supports vLLM {SUPPORTED}.x; found vLLM {found}"
            + (f", which lacks {', '.join(missing)}" if missing else "")
            + ". Install vllm==0.26.0 or uninstall latentspeed (set VLLM_PLUGINS to skip it)."
        )
    return found
