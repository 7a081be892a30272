"""Generation under tensor parallelism with a KV cache: each TP rank caches the keys and values of its
own key/value heads.

The cached step is assembled from the parallel model's own modules, as `generation.py` does for the
dense model, so the training forward is left as it is: the column-parallel q/k/v projections give
this rank's heads of the new positions, RoPE and attention run over them against the cached keys
and values of those heads, and the row-parallel o_proj / down_proj sum the ranks' partial outputs
(one all-reduce each, Megatron-LM's g). The layout is plain TP: a step of one position cannot be
split over the sequence (no SP), and the head is replicated (no VP), so every rank computes the same
logits from the same all-reduced hidden states and draws the same token with the same seed.
"""
from __future__ import annotations

import torch

from .config import ConfigError, MiniMindConfig, ParallelConfig, Recompute
from .generation import KVCache, attention_after, decode
from .groups import ProcessGroups
from .model import apply_rope, repeat_kv
from .parallel_model import ParallelAttention, ParallelMiniMindForCausalLM
from .training import build_parallel_model


def generation_layout(tp: int) -> ParallelConfig:
    """The layout `generate` runs: plain tensor parallelism over `tp` ranks."""
    return ParallelConfig(tp=tp)


def check_generation_layout(par: ParallelConfig) -> None:
    """One line unless `par` is plain TP (what the cached step assembles)."""
    if (par.pp, par.cp, par.dp) != (1, 1, 1):
        raise ConfigError(f"generate runs under tensor parallelism only; got pp_size={par.pp}, cp_size={par.cp}, "
                          f"dp_size={par.dp}")
    if par.sequence_parallel or par.vocab_parallel or par.recompute != Recompute.NONE or par.loss_chunks != 1:
        raise ConfigError("generate runs under plain tensor parallelism (a step of one position has no sequence to "
                          "split, the head is replicated); got a layout with SP, VP, recompute or loss chunks")


def build_generation_model(config: MiniMindConfig, groups: ProcessGroups, dense_state: dict, *, dtype=torch.float32,
                           device="cpu") -> ParallelMiniMindForCausalLM:
    """This TP rank's shard of the dense weights, in the plain-TP layout of `groups.par`, for generation."""
    check_generation_layout(groups.par)
    return build_parallel_model(config, groups.par, groups, dense_state, dtype=dtype, device=device).eval()


def _cached_attention(attn: ParallelAttention, x, cos, sin, cache: KVCache, layer: int):
    """This rank's heads of the new positions x [s, B, H] against its cached keys/values -> [s, B, H] (summed)."""
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)       # [s, B, heads/T * d]
    s, b = q.shape[:2]
    q = q.view(s, b, attn.n_heads, attn.head_dim).transpose(0, 1)   # [B, s, h/T, d]
    k = k.view(s, b, attn.n_kv, attn.head_dim).transpose(0, 1)      # [B, s, kv/T, d]
    v = v.view(s, b, attn.n_kv, attn.head_dim).transpose(0, 1)
    q, k = apply_rope(attn.q_norm(q), cos, sin), apply_rope(attn.k_norm(k), cos, sin)
    k, v = cache.extend(layer, k, v)                                # [B, past + s, kv/T, d]
    rep = attn.n_heads // attn.n_kv
    q, k, v = q.transpose(1, 2), repeat_kv(k, rep).transpose(1, 2), repeat_kv(v, rep).transpose(1, 2)
    out = attention_after(q, k, v, past=cache.length, flash=attn.flash)            # [B, h/T, s, d]
    return attn.o_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))  # [s, B, h/T * d] -> all-reduce -> [s, B, H]


def forward_cached_parallel(model: ParallelMiniMindForCausalLM, input_ids: torch.Tensor, cache: KVCache):
    """Run input_ids [B, s] at positions cache.length.. on this TP rank; -> logits of the last position [B, V]."""
    m, start, s = model.model, cache.length, input_ids.shape[1]
    h = m.embed_tokens(input_ids.t())                               # [B, s] -> [s, B] -> [s, B, H]
    cos, sin = m.freqs_cos[start:start + s], m.freqs_sin[start:start + s]
    for index, layer in m.layers.items():
        h = h + _cached_attention(layer.self_attn, layer.input_layernorm(h), cos, sin, cache, int(index))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    cache.length += s
    return model.lm_head(m.norm(h[-1]))                             # [B, H] -> [B, V]


@torch.no_grad()
def generate_parallel(model: ParallelMiniMindForCausalLM, input_ids: torch.Tensor, *, max_new_tokens: int,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                      eos_id: int | None = None) -> torch.Tensor:
    """`generation.generate` on a TP rank (every rank of the group calls it with the same arguments and
    returns the same ids [B, S + n])."""
    check_generation_layout(model.par)
    c = model.config
    cache = KVCache.zeros(model, input_ids.shape[0], input_ids.shape[1] + max_new_tokens,
                          c.num_key_value_heads // model.par.tp, c.head_dim)
    return decode(model, lambda ids: forward_cached_parallel(model, ids, cache), input_ids,
                  max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, eos_id=eos_id)
