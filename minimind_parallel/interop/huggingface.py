"""A Hugging Face folder for the dense model, loaded by `transformers.AutoModelForCausalLM` as Qwen3.

MiniMind-3's layout is transformers' Qwen3 (per-head q/k RMSNorm, GQA, RoPE, SwiGLU, optionally
tied embeddings) and its state-dict keys are Qwen3's, so the export is the state dict under the
same names plus a Qwen3 `config.json`; this is what jingyaogong/minimind's
scripts/convert_model.py produces through `Qwen3ForCausalLM.save_pretrained`. It is written here
without transformers: the config as JSON (flat `rope_theta` with `rope_scaling: null`, which
transformers 4.x and 5.x both read, as MiniMind's converter writes it), the weights with
`safetensors.torch.save_file`. With tied embeddings only `model.embed_tokens.weight` is stored,
as `save_pretrained` does for a tied model (`lm_head.weight` is re-tied on load). The tokenizer
puts bos first (`data.tokenizer.bos_first`), so `tokenizer(text)` gives the ids a pretraining row
starts with, and `generate` on them continues as ours does; every file is mode 0644.

The mixture-of-experts model (`use_moe`) is transformers' Qwen3-MoE (`Qwen3MoeForCausalLM`:
softmax router, top-k, renormalised when `norm_topk_prob`, SwiGLU experts, every layer sparse:
`decoder_sparse_step` 1, no `mlp_only_layers`), its weights under the same per-expert names
(`mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight`), the names of Qwen3-MoE's
released checkpoints, which transformers 5 fuses into its 3-D expert tensors on load.

The folder is written beside `out_dir` under a temporary name and renamed into place, so an
interrupted export never leaves a half-written folder; an existing non-empty folder is refused
unless `overwrite`.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping

import torch
from safetensors.torch import save_file

from ..config import DTYPES, ConfigError, MiniMindConfig
from ..data.tokenizer import LoadedTokenizer, bos_first, load_tokenizer, tokenizer_config
from ..files import atomic_path
from .minimind import HEAD_KEY, dense_state_dict

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# The dtypes a Hugging Face folder is written in, by name: the command line's (DTYPES) but float64.
EXPORT_DTYPES = {name: dtype for name, dtype in DTYPES.items() if dtype is not torch.float64}


def _dtype_name(dtype: torch.dtype) -> str:
    names = {d: name for name, d in EXPORT_DTYPES.items()}
    if dtype not in names:
        raise ConfigError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}; got {dtype}")
    return names[dtype]


def qwen3_config_dict(config: MiniMindConfig, *, dtype: torch.dtype = torch.float32, bos_token_id: int | None = None,
                      eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict:
    """transformers' Qwen3 `config.json` for `config`: the same model, no sliding window, no biases."""
    c = config
    out = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": False, "attention_dropout": c.dropout,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": c.num_hidden_layers,
        "initializer_range": 0.02, "use_cache": True,
        # transformers 4.x reads `torch_dtype`, 5.x `dtype`.
        "torch_dtype": _dtype_name(dtype), "dtype": _dtype_name(dtype),
    }
    if c.use_moe:
        out |= qwen3_moe_fields(c)
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    return out | {k: v for k, v in ids.items() if v is not None}


def qwen3_moe_fields(c: MiniMindConfig) -> dict:
    """What makes the Qwen3 config a Qwen3-MoE one: every layer an MoE layer of MiniMind's experts."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": c.num_experts,
            "num_experts_per_tok": c.num_experts_per_tok, "moe_intermediate_size": c.moe_intermediate_size,
            "norm_topk_prob": c.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": c.router_aux_loss_coef, "output_router_logits": False}


def generation_config_dict(*, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> dict:
    """`generation_config.json`: which ids start, end and pad a sequence (decoding defaults stay transformers')."""
    return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}


def check_export_folder(out_dir: str, overwrite: bool) -> None:
    """ConfigError unless `out_dir` is absent, an empty folder, or `overwrite`."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"export folder {out_dir} exists and is not a folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ConfigError(f"export folder {out_dir} exists and is not empty; pass --overwrite to replace it")


def load_export_tokenizer(tokenizer_dir: str, config: MiniMindConfig) -> LoadedTokenizer:
    """The tokenizer of `tokenizer_dir`; ConfigError when absent or larger than the model's vocabulary."""
    if not os.path.isdir(tokenizer_dir):
        raise ConfigError(f"tokenizer folder {tokenizer_dir} not found (it holds tokenizer.json)")
    tok = load_tokenizer(tokenizer_dir)
    if tok.vocab_size > config.vocab_size:
        raise ConfigError(f"tokenizer {tok.path} has {tok.vocab_size} tokens, more than the model's "
                          f"vocab_size={config.vocab_size}")
    return tok


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")


def _write_tokenizer(folder: str, tok: LoadedTokenizer, model_max_length: int) -> None:
    """The tokenizer files, with bos put first by `tokenizer(text)` as the training rows start (the
    tokenizer.json's post-processor, which transformers applies unless add_special_tokens=False)."""
    source = os.path.dirname(tok.path)
    bos_first(tok).save(os.path.join(folder, "tokenizer.json"))
    config_file = os.path.join(source, "tokenizer_config.json")
    config = tokenizer_config(model_max_length)
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    _write_json(os.path.join(folder, "tokenizer_config.json"), config | {"add_bos_token": True})
    for name in TOKENIZER_FILES:
        if name not in ("tokenizer.json", "tokenizer_config.json") and os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(folder, name))


def _write_folder(folder: str, tensors: dict, config_json: dict, tok: LoadedTokenizer | None) -> None:
    _write_json(os.path.join(folder, "config.json"), config_json)
    with atomic_path(os.path.join(folder, "model.safetensors")) as tmp:  # 0644: save_file alone makes it 0600
        save_file(tensors, tmp, metadata={"format": "pt"})
    if tok is not None:
        ids = {k: config_json[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        _write_json(os.path.join(folder, "generation_config.json"), generation_config_dict(**ids))
        _write_tokenizer(folder, tok, config_json["max_position_embeddings"])


def _replace_folder(tmp: str, out_dir: str) -> None:
    """Move the finished `tmp` to `out_dir`; a previous `out_dir` is moved aside first and removed after."""
    old = None
    if os.path.isdir(out_dir):
        old = tmp + ".old"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old)


def export_hf(dense_state: Mapping[str, torch.Tensor], config: MiniMindConfig, out_dir: str, *,
              tokenizer_dir: str | None = None, overwrite: bool = False, dtype: torch.dtype = torch.float32) -> str:
    """Write `out_dir` with config.json, model.safetensors (weights in `dtype`) and, given `tokenizer_dir`,
    generation_config.json and the tokenizer files; bos/eos/pad ids come from that tokenizer.

    `dense_state` is checked strictly against `config` (either tied key suffices). Every check runs
    before anything is written. Returns `out_dir`.
    """
    _dtype_name(dtype)  # refuse an unsupported dtype before anything else
    check_export_folder(out_dir, overwrite)
    tok = load_export_tokenizer(tokenizer_dir, config) if tokenizer_dir is not None else None
    state = dense_state_dict(dense_state, config, dtype=dtype)
    if config.tie_word_embeddings:
        del state[HEAD_KEY]  # stored once, as embed_tokens; transformers ties lm_head to it on load
    tensors = {k: v.to(device="cpu", copy=True).contiguous() for k, v in state.items()}
    ids = {} if tok is None else {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    config_json = qwen3_config_dict(config, dtype=dtype, **ids)

    parent, name = os.path.split(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary folder
        _write_folder(tmp, tensors, config_json, tok)
        _replace_folder(tmp, out_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    return out_dir
