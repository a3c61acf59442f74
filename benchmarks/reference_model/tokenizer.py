"""A byte-level BPE tokenizer trained on the corpus with the ``tokenizers`` library, saved in
the layout transformers, vLLM and SGLang load (``tokenizer.json`` + ``tokenizer_config.json``)."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]


def train_tokenizer(texts: list[str], vocab_size: int = 8192) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    out_dir = Path(out_dir)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    bos, eos, pad = SPECIAL_TOKENS
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
