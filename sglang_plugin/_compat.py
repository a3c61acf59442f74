"""The SGLang versions latentspeed's adapter supports, checked by feature and by version."""

from importlib.metadata import PackageNotFoundError, version

SUPPORTED = "0.5.17"


class UnsupportedSglangError(RuntimeError):
    """The installed SGLang lacks an extension point latentspeed plugs into."""


def check_sglang() -> str:
    """Return the installed SGLang version, or raise ``UnsupportedSglangError`` naming what is missing."""
    try:
        found = version("sglang")
    except PackageNotFoundError as err:
        raise UnsupportedSglangError("SGLang is not installed: pip install sglang==0.5.17") from err
    missing = []
    for module, names in (
        ("sglang.srt.layers.attention.attention_registry", ("register_attention_backend", "ATTENTION_BACKENDS")),
        ("sglang.srt.server_args", ("add_attention_backend_choices", "add_chunked_prefix_cache_attention_backend")),
        ("sglang.srt.layers.attention.base_attn_backend", ("AttentionBackend",)),
    ):
        try:
            imported = __import__(module, fromlist=list(names))
        except ImportError:
            missing.append(module)
            continue
        missing += [f"{module}.{n}" for n in names if not hasattr(imported, n)]
    if missing or not (found == SUPPORTED or found.startswith(SUPPORTED + ".")):
        raise UnsupportedSglangError(
            f"latentspeed supports SGLang {SUPPORTED}; found SGLang {found}"
            + (f", which lacks {', '.join(missing)}" if missing else "")
            + ". Install sglang==0.5.17 or uninstall latentspeed (set SGLANG_PLUGINS to skip it)."
        )
    return found
