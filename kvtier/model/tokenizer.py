"""A byte-level tokenizer for the random demo checkpoints: 256 byte tokens + ChatML specials, no merges.

Every string round-trips (ids 0..255 are bytes in GPT-2's byte-to-unicode alphabet); it is saved as
``tokenizer.json`` + ``tokenizer_config.json`` so ``transformers.AutoTokenizer`` loads it too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
BYTE_VOCAB_SIZE = 256
VOCAB_SIZE = BYTE_VOCAB_SIZE + len(SPECIAL_TOKENS)  # model vocab_size must be >= this
EOS_TOKEN_ID = BYTE_VOCAB_SIZE + SPECIAL_TOKENS.index(EOS_TOKEN)
IM_END_TOKEN_ID = BYTE_VOCAB_SIZE + SPECIAL_TOKENS.index("<|im_end|>")
IMAGE_TOKEN = "<image>"  # the image placeholder of vision-language presets: the id after the specials
IMAGE_TOKEN_ID = VOCAB_SIZE

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_byte_tokenizer(image_token: bool = False) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(BYTE_VOCAB_SIZE)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if image_token:
        tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    return tok


def save_byte_tokenizer(out_dir: str | Path, model_max_length: int = 4096, image_token: bool = False) -> None:
    """``image_token``: with ``<image>`` (id IMAGE_TOKEN_ID), a vision-language preset's placeholder."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer(image_token).save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    if image_token:
        config["image_token"] = IMAGE_TOKEN
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (what ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's Hugging Face tokenizer, or None if it ships none (token-id prompts only)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
