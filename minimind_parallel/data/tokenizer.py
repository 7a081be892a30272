"""MiniMind's tokenizer format: a ByteLevel BPE trained with Hugging Face `tokenizers`, whose first
three ids are the special tokens `<|endoftext|>` (0, padding), `<|im_start|>` (1, bos) and
`<|im_end|>` (2, eos), saved as `tokenizer.json` plus a `tokenizer_config.json` that
`transformers.AutoTokenizer.from_pretrained(DIR)` reads (MiniMind's scripts/train_tokenizer.py).

    python -m minimind_parallel.data.tokenizer --data data/stdlib.jsonl --out data/tokenizer --vocab_size 6400
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ..config import ConfigError
from ..files import atomic_path
from .chat_template import MINIMIND_CHAT_TEMPLATE
from .jsonl import iter_texts

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2 in this order
BYTE_ALPHABET = 256
# MiniMind-3's ChatML template (data/chat_template.py): what the `sft` task and `generate --chat` render.
CHAT_TEMPLATE = MINIMIND_CHAT_TEMPLATE


@dataclass(frozen=True, kw_only=True)
class LoadedTokenizer:
    """A `tokenizers.Tokenizer` with the ids pretraining needs."""

    tokenizer: Tokenizer
    path: str  # the tokenizer.json it was read from
    pad_id: int
    bos_id: int
    eos_id: int
    vocab_size: int  # including the special tokens


def tokenizer_config(model_max_length: int) -> dict:
    """The transformers side of the format: which token is bos, eos, pad; no automatic bos/eos."""
    added = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, tok in enumerate(SPECIAL_TOKENS)}
    return {"add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
            "added_tokens_decoder": added, "additional_special_tokens": [],
            "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": PAD_TOKEN,
            "clean_up_tokenization_spaces": False, "spaces_between_special_tokens": False,
            "model_max_length": model_max_length, "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE}


def train_tokenizer(data_path: str, out_dir: str, *, vocab_size: int = 6400,
                    model_max_length: int = 32768) -> LoadedTokenizer:
    """Train on the "text" of every line of `data_path`; write tokenizer.json and tokenizer_config.json."""
    if vocab_size < BYTE_ALPHABET + len(SPECIAL_TOKENS):
        raise ConfigError(f"vocab_size must hold the {BYTE_ALPHABET} bytes and {len(SPECIAL_TOKENS)} special "
                          f"tokens (>= {BYTE_ALPHABET + len(SPECIAL_TOKENS)}); got vocab_size={vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(iter_texts(data_path), trainer=trainer)
    with atomic_path(os.path.join(out_dir, "tokenizer.json")) as tmp:
        tokenizer.save(tmp)
    with atomic_path(os.path.join(out_dir, "tokenizer_config.json")) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(model_max_length), f, ensure_ascii=False, indent=2)
    return load_tokenizer(out_dir)


def _special_id(tokenizer: Tokenizer, token: str, path: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ConfigError(f"tokenizer {path} lacks the special token {token!r} (MiniMind's format)")
    return token_id


def load_tokenizer(path: str) -> LoadedTokenizer:
    """Read a tokenizer directory (or its tokenizer.json); bos/eos/pad from tokenizer_config.json when present."""
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception for missing and malformed files alike
        raise ConfigError(f"cannot load tokenizer {file}: {str(e).splitlines()[0] if str(e) else e!r}") from None
    config_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    config = {}
    if os.path.exists(config_file):
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    return LoadedTokenizer(
        tokenizer=tokenizer, path=file, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        pad_id=_special_id(tokenizer, config.get("pad_token", PAD_TOKEN), file),
        bos_id=_special_id(tokenizer, config.get("bos_token", BOS_TOKEN), file),
        eos_id=_special_id(tokenizer, config.get("eos_token", EOS_TOKEN), file))


def bos_first(loaded: LoadedTokenizer) -> Tokenizer:
    """A copy of the tokenizer that puts bos before every text it encodes, as MiniMind's pretraining
    rows start (`data.pretrain`) -- for the Hugging Face export, where `tokenizer(text)` is the whole
    recipe. The training tokenizer itself encodes the text alone: the rows add bos and eos themselves."""
    out = Tokenizer.from_str(loaded.tokenizer.to_str())
    bos = out.id_to_token(loaded.bos_id)
    out.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                                       special_tokens=[(bos, loaded.bos_id)])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="jsonl with one {\"text\": ...} per line")
    parser.add_argument("--out", required=True, help="directory for tokenizer.json and tokenizer_config.json")
    parser.add_argument("--vocab_size", type=int, default=6400)
    parser.add_argument("--model_max_length", type=int, default=32768)
    args = parser.parse_args(argv)
    try:
        loaded = train_tokenizer(args.data, args.out, vocab_size=args.vocab_size,
                                 model_max_length=args.model_max_length)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {loaded.path}: vocab {loaded.vocab_size}, pad {loaded.pad_id}, bos {loaded.bos_id}, "
          f"eos {loaded.eos_id}")


if __name__ == "__main__":
    main()
