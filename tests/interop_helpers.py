"""Shared by the interop and generation tests: a tiny model with lively weights and a tiny tokenizer."""
import json
import os

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, MiniMindForCausalLM, ParallelConfig, ProcessGroups
from minimind_parallel.checkpoint import save_checkpoint
from minimind_parallel.data.tokenizer import SPECIAL_TOKENS, tokenizer_config
from minimind_parallel.training import build_parallel_model, make_optimizer

# MiniMind's head ratio (8 query heads, 4 key/value heads); non-default rope_theta and eps so an
# export that dropped either would change the logits.
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=128,
            max_position_embeddings=64, rope_theta=5e4, rms_norm_eps=1e-5)
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home")


def lively_model(seed: int = 0, **overrides) -> MiniMindForCausalLM:
    """A tiny model whose matrices are drawn with std 0.2 and norm weights around 1, so that greedy
    decoding wanders over the vocabulary (at the 0.02 init it repeats the last token) and every
    norm weight matters."""
    torch.manual_seed(seed)
    model = MiniMindForCausalLM(MiniMindConfig(**(TINY | overrides)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return model


def write_word_tokenizer(directory: str) -> str:
    """MiniMind's special tokens (ids 0, 1, 2) and a dozen whole words, with MiniMind's tokenizer_config.json."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(64), f)
    return directory


def _save_on_one_rank(save_dir: str, state: dict, config):
    par = ParallelConfig()
    groups = ProcessGroups.build(par)
    model = build_parallel_model(config, par, groups, state)
    return save_checkpoint(save_dir, 1, model=model, optimizer=make_optimizer(model, 1e-3), config=config, par=par,
                           groups=groups, extra={})


def save_as_checkpoint(save_dir: str, model: MiniMindForCausalLM, state: dict | None = None) -> str:
    """`model` (or `state` in its place) saved as a one-rank checkpoint at step 1 of `save_dir`."""
    state = model.state_dict() if state is None else state
    return run_ranks(_save_on_one_rank, 1, str(save_dir), {k: v.clone() for k, v in state.items()}, model.config)[0]
