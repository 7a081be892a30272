"""The dense MiniMind-3 reference model (single device, batch-first), as in jingyaogong/minimind.

State-dict keys match MiniMind's so its checkpoints load with strict=True. This is the ground
truth every parallel layout is validated against; it shares no code with the parallel model
except the small numeric helpers below (RMSNorm math, RoPE tables, rotate_half).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, MiniMindConfig
from .data.batches import IGNORE_INDEX, shift_labels
from .moe import MOEFeedForward


@dataclass
class CausalLMOutput:
    """`loss`: the language-model loss (the mean over the targets); `aux_loss`: the MoE layers'
    load-balancing loss summed over layers (None for a dense model; 0 outside training mode, as
    MiniMind's). What training minimises is `objective` = loss + aux_loss, as MiniMind's trainer
    (trainer/train_pretrain.py: `loss = res.loss + res.aux_loss`)."""
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None

    @property
    def objective(self) -> torch.Tensor | None:
        if self.loss is None or self.aux_loss is None:
            return self.loss
        return self.loss + self.aux_loss


class RMSNorm(nn.Module):
    """MiniMind's RMSNorm: the fp32 upcast (and what autograd saves for it) is part of the memory story."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        # x.float() in MiniMind; float64 is kept as float64 rather than downcast.
        return (self.weight * self.norm(x.to(torch.promote_types(x.dtype, torch.float32)))).type_as(x)


def rope_tables(head_dim: int, end: int, theta: float, device=None):
    """fp32 cos/sin tables of width head_dim, built as cat(freqs, freqs)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim))
    freqs = torch.outer(torch.arange(end, device=device), freqs).float()
    return torch.cat([freqs.cos(), freqs.cos()], dim=-1), torch.cat([freqs.sin(), freqs.sin()], dim=-1)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def apply_rope(x, cos, sin):
    """x: [..., S, heads, head_dim] with cos/sin [S, head_dim] broadcast over heads."""
    return ((x * cos.unsqueeze(-2)) + (rotate_half(x) * sin.unsqueeze(-2))).to(x.dtype)


def causal_attention(q, k, v, *, flash: bool):
    """q: [B, h, S, d], k/v: [B, h, S, d] (kv already repeated for GQA) -> [B, h, S, d]."""
    if flash:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores + torch.full((seq, seq), float("-inf"), device=q.device).triu(1)
    # MiniMind's softmax runs in fp32; float64 stays float64 (never downcast).
    return F.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).type_as(q) @ v


def repeat_kv(x, n_rep: int):
    """[B, S, kv_heads, d] -> [B, S, kv_heads * n_rep, d]."""
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


def next_token_cross_entropy(logits, targets):
    """Mean loss over the target tokens: logits [B, S, V] against targets [B, S], the next token
    of every position, -100 where nothing is predicted (`data.batches.shift_labels`)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX)


class Attention(nn.Module):
    def __init__(self, c: MiniMindConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.flash = (
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.flash_attn)
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=c.rms_norm_eps)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim)
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        rep = self.n_heads // self.n_kv
        q, k, v = q.transpose(1, 2), repeat_kv(k, rep).transpose(1, 2), repeat_kv(v, rep).transpose(1, 2)
        out = causal_attention(q, k, v, flash=self.flash)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, c: MiniMindConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MiniMindBlock(nn.Module):
    def __init__(self, c: MiniMindConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = MOEFeedForward(c) if c.use_moe else FeedForward(c)

    def forward(self, h, cos, sin):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class MiniMindModel(nn.Module):
    def __init__(self, c: MiniMindConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([MiniMindBlock(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        cos, sin = rope_tables(c.head_dim, c.max_position_embeddings, c.rope_theta)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)

    def forward(self, input_ids):
        s = input_ids.shape[1]
        h = self.embed_tokens(input_ids)
        cos, sin = self.freqs_cos[:s], self.freqs_sin[:s]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class MiniMindForCausalLM(nn.Module):
    """`MiniMindForCausalLM(config)(input_ids, labels=labels)` -> CausalLMOutput(logits, loss), as in
    MiniMind's model/model_minimind.py and transformers' causal LMs.

    - `labels` [B, S] are unshifted (usually the ids themselves, -100 where nothing is learned): the
      loss predicts labels[:, s + 1] from position s, shifted here (`data.batches.shift_labels`).
    - `targets` [B, S] are already shifted (targets[:, s] is the token after position s): what the
      data module's `Batch` holds. Give one of the two, or neither.
    - `attention_mask` [B, S]: accepted as MiniMind and transformers pass it, all ones only (this
      model has no padding inside a row); any zero is refused.
    - `logits_to_keep`: 0 keeps the logits of every position; k > 0 those of the last k; a tensor of
      positions those positions (MiniMind's and transformers' convention). Not with a loss.
    """

    def __init__(self, config: MiniMindConfig | None = None):
        super().__init__()
        self.config = config or MiniMindConfig()
        self.model = MiniMindModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if self.config.tie_word_embeddings:
            self.model.embed_tokens.weight = self.lm_head.weight
        self.apply(_init_weights)

    def forward(self, input_ids, attention_mask=None, *, labels=None, logits_to_keep=0, targets=None):
        check_attention_mask(attention_mask, input_ids)
        if labels is not None:
            if targets is not None:
                raise ConfigError("give labels (unshifted) or targets (shifted), not both")
            targets = shift_labels(labels)
        if targets is not None and not _keeps_all(logits_to_keep):
            raise ConfigError(f"a loss needs the logits of every position: logits_to_keep must be 0 with labels "
                              f"or targets; got logits_to_keep={_describe_keep(logits_to_keep)}")
        hidden = self.model(input_ids)                          # [B, S, H]
        logits = self.lm_head(hidden[:, _keep_slice(logits_to_keep)])  # [B, S or kept, V]
        loss = next_token_cross_entropy(logits, targets) if targets is not None else None
        return CausalLMOutput(logits=logits, loss=loss, aux_loss=moe_aux_loss(self.model.layers))


def moe_aux_loss(layers) -> torch.Tensor | None:
    """The MoE layers' aux losses of the last forward, summed (MiniMind's MiniMindModel); None without MoE."""
    layers = layers.values() if isinstance(layers, nn.ModuleDict) else layers
    losses = [layer.mlp.aux_loss for layer in layers if isinstance(layer.mlp, MOEFeedForward)]
    return torch.stack(losses).sum() if losses else None


def check_attention_mask(attention_mask, input_ids) -> None:
    """ConfigError unless `attention_mask` is None or all ones of input_ids' shape (no padding inside rows)."""
    if attention_mask is None:
        return
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ConfigError(f"attention_mask must have input_ids' shape {list(input_ids.shape)}; "
                          f"got {list(attention_mask.shape)}")
    zeros = int((attention_mask != 1).sum())
    if zeros:
        raise ConfigError(f"attention_mask must be all ones (this model attends causally over whole rows, no "
                          f"padding inside them); got {zeros} of {attention_mask.numel()} entries not 1")


def _keeps_all(logits_to_keep) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def _describe_keep(logits_to_keep) -> str:
    return str(logits_to_keep) if isinstance(logits_to_keep, int) else f"a tensor of {logits_to_keep.numel()} positions"


def _keep_slice(logits_to_keep):
    """0: every position; k: the last k; a tensor: those positions."""
    if isinstance(logits_to_keep, int):
        if logits_to_keep < 0:
            raise ConfigError(f"logits_to_keep must be >= 0 (0: every position); got logits_to_keep={logits_to_keep}")
        return slice(-logits_to_keep, None)
    return logits_to_keep


def _init_weights(m):
    # Hugging Face's default for this family: normal(0, 0.02) for linears and embeddings.
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
