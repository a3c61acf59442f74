"""Reading the inputs of ``latentspeed quantize``: the model directory and the calibration text."""

import hashlib
import json
from pathlib import Path

from latentspeed.text_input import read_utf8

# Architectures whose module names the recipes' regexes are written for.
SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM")


class QuantizeError(ValueError):
    """Bad input to ``latentspeed quantize``: the message names the problem."""


def read_config(model_dir: str | Path) -> dict:
    """``config.json`` of a checkpoint directory (one with safetensors weights), or ``QuantizeError``."""
    path = Path(model_dir)
    if not path.is_dir():
        raise QuantizeError(f"{path} is not a directory")
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise QuantizeError(f"{path} is not a checkpoint: it needs config.json and *.safetensors weights")
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise QuantizeError(f"{path}/config.json is not valid JSON ({err.msg})") from err


def read_model_config(model_dir: str | Path) -> dict:
    """``config.json`` of a checkpoint that a recipe can handle, or ``QuantizeError``."""
    path = Path(model_dir)
    config = read_config(path)
    architectures = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise QuantizeError(f"{path}: architecture {architectures or 'unknown'} is not supported by the recipes: "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)} are")
    quant = config.get("quantization_config")
    if quant and quant.get("quant_method") not in ("fp8",):
        raise QuantizeError(f"{path} is already quantized ({quant.get('quant_method')}); start from a bf16 or a "
                            "native FP8 (DeepSeek-V3 style) checkpoint")
    return config


def is_native_fp8(config: dict) -> bool:
    """DeepSeek-V3's own FP8 checkpoints (``weight_scale_inv`` per 128 x 128 block)."""
    return (config.get("quantization_config") or {}).get("quant_method") == "fp8"


def read_calibration_texts(path: str | Path) -> tuple[list[str], str]:
    """Texts of a ``.jsonl`` (one object with ``"text"`` per line) or plain-text file (paragraphs
    separated by blank lines), and the file's sha256."""
    path = Path(path)
    try:
        content, raw = read_utf8(path, "calibration file")
    except ValueError as err:
        raise QuantizeError(str(err)) from err
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise QuantizeError(f"{path}:{number}: not a JSON line ({err.msg})") from err
            text = record.get("text") if isinstance(record, dict) else record
            if not isinstance(text, str):
                raise QuantizeError(f"{path}:{number}: expected a string or an object with a \"text\" string")
            texts.append(text)
    else:
        texts = [p.strip() for p in content.split("\n\n")]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise QuantizeError(f"calibration file {path} holds no text")
    return texts, hashlib.sha256(raw).hexdigest()


def checkpoint_bytes(model_dir: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
