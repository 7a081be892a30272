"""Causal attention over grouped kv heads without materialising repeat_kv copies.

MiniMind repeats k and v to every query head (`model.repeat_kv`, a copy) before attention, and
autograd keeps those copies for backward: 2 b N h d bytes per block where the kv heads need
2 b N k d. `scaled_dot_product_attention(..., enable_gqa=True)` reads each kv head for its
group of query heads directly. Backends, torch 2.13: the CPU flash kernel
(`_scaled_dot_product_flash_attention_for_cpu`) takes the kv heads as they are and saves them
so (measured with the memory tracker, tests/test_recompute.py); on CUDA the flash and math
backends accept enable_gqa (math repeats internally, inside the op). The manual softmax path
(`flash_attn=False`) has no such option and keeps MiniMind's repeat_kv.
"""
from __future__ import annotations

import torch.nn.functional as F

from ..model import causal_attention, repeat_kv


def causal_attention_gqa(q, k, v, *, flash: bool):
    """q: [B, h, S, d], k/v: [B, k, S, d] (h a multiple of k) -> [B, h, S, d]."""
    rep = q.shape[1] // k.shape[1]
    if flash:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)
    # manual softmax: [B, k, S, d] -> [B, S, k, d] -> repeat -> [B, h, S, d]
    k = repeat_kv(k.transpose(1, 2), rep).transpose(1, 2)
    v = repeat_kv(v.transpose(1, 2), rep).transpose(1, 2)
    return causal_attention(q, k, v, flash=False)
