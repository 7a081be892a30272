"""Text generation with the dense model and a KV cache: greedy, or temperature + top-p sampling.

The prompt is run once (prefill) and its keys and values kept per layer; each new token then runs
alone through the model, attending to the cached keys and values of every earlier position, so a
step costs one position instead of the whole sequence. The cached step is assembled here from the
dense model's own modules and helpers (`minimind_parallel/model.py`: projections, q/k norms,
`apply_rope`, `repeat_kv`, MLP, norms), so the training forward stays as it is; the tests check
that it gives exactly the tokens of recomputing the whole sequence each step.

Sampling follows Holtzman et al. 2019 ("The Curious Case of Neural Text Degeneration"): the
logits are divided by the temperature, and only the nucleus -- the smallest set of most likely
tokens whose probability reaches top_p -- can be drawn, with a `torch.Generator` seeded from
`seed`, so the same seed gives the same text. Temperature 0 is greedy (argmax).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ConfigError
from .data.chat import ChatTemplate
from .data.tokenizer import LoadedTokenizer
from .model import Attention, MiniMindForCausalLM, apply_rope, repeat_kv


@dataclass(kw_only=True)
class KVCache:
    """Post-RoPE keys and values of every layer, [B, max_len, kv_heads, head_dim] each; `length` positions filled."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(cls, model: MiniMindForCausalLM, batch: int, max_len: int) -> KVCache:
        c = model.config
        return cls.zeros(model, batch, max_len, c.num_key_value_heads, c.head_dim)

    @classmethod
    def zeros(cls, model, batch: int, max_len: int, kv_heads: int, head_dim: int) -> KVCache:
        """A cache for every layer of `model.config` (keys by layer index), in the dtype and on the device of
        `model`'s parameters; `kv_heads`: the key/value heads this process holds (all, or a TP rank's)."""
        p, shape = next(model.parameters()), (batch, max_len, kv_heads, head_dim)

        def zeros():
            return [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(model.config.num_hidden_layers)]
        return cls(keys=zeros(), values=zeros())

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [B, s, kv, d] after the `length` cached positions; return all [B, length + s, kv, d]."""
        end = self.length + k.shape[1]
        self.keys[layer][:, self.length:end] = k
        self.values[layer][:, self.length:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]


def attention_after(q, k, v, *, past: int, flash: bool):
    """q: [B, h, s, d] at positions past..past+s-1; k/v: [B, h, past+s, d] -> [B, h, s, d], causal."""
    if past == 0:  # the prefill is the training forward's causal attention
        mask = None
    else:  # query i sees keys 0..past+i
        s, t = q.shape[-2], k.shape[-2]
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(diagonal=past)
    if flash:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    # The softmax runs in fp32 at least, as in the dense model.
    return F.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).type_as(q) @ v


def _cached_attention(attn: Attention, x, cos, sin, cache: KVCache, layer: int):
    """The dense model's attention for new positions x [B, s, H], with earlier keys/values from `cache`."""
    b, s, _ = x.shape
    q = attn.q_proj(x).view(b, s, attn.n_heads, attn.head_dim)
    k = attn.k_proj(x).view(b, s, attn.n_kv, attn.head_dim)
    v = attn.v_proj(x).view(b, s, attn.n_kv, attn.head_dim)
    q, k = apply_rope(attn.q_norm(q), cos, sin), apply_rope(attn.k_norm(k), cos, sin)
    k, v = cache.extend(layer, k, v)  # [B, s, kv, d] -> [B, past + s, kv, d]
    rep = attn.n_heads // attn.n_kv
    q, k, v = q.transpose(1, 2), repeat_kv(k, rep).transpose(1, 2), repeat_kv(v, rep).transpose(1, 2)
    out = attention_after(q, k, v, past=cache.length, flash=attn.flash)
    return attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))  # [B, h, s, d] -> [B, s, H]


def forward_cached(model: MiniMindForCausalLM, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run input_ids [B, s] at positions cache.length.. and extend the cache; -> logits of the last position [B, V]."""
    m, start, s = model.model, cache.length, input_ids.shape[1]
    h = m.embed_tokens(input_ids)
    cos, sin = m.freqs_cos[start:start + s], m.freqs_sin[start:start + s]
    for i, layer in enumerate(m.layers):
        h = h + _cached_attention(layer.self_attn, layer.input_layernorm(h), cos, sin, cache, i)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    cache.length += s
    return model.lm_head(m.norm(h[:, -1]))


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the nucleus: keep the most likely tokens until their mass reaches top_p. [B, V]."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the most likely token always stays
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def sample_next(logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator | None):
    """logits [B, V] -> next token ids [B]: argmax at temperature 0, else a draw from the tempered nucleus."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = F.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = top_p_filter(probs, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_generation_args(*, prompt_len: int, max_new_tokens: int, temperature: float, top_p: float,
                          max_position_embeddings: int) -> None:
    """One ConfigError line per broken constraint."""
    if prompt_len < 1:
        raise ConfigError("the prompt must hold at least one token; got an empty prompt")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1; got max_new_tokens={max_new_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"temperature must be >= 0 and finite (0 is greedy); got temperature={temperature}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1]; got top_p={top_p}")
    if prompt_len > max_position_embeddings:
        raise ConfigError(f"the prompt is {prompt_len} tokens, more than the model's {max_position_embeddings} "
                          f"positions (max_position_embeddings)")
    if prompt_len + max_new_tokens > max_position_embeddings:
        raise ConfigError(f"prompt length + max_new_tokens must be <= max_position_embeddings; got "
                          f"{prompt_len} + {max_new_tokens} > {max_position_embeddings}")


@torch.no_grad()
def generate(model: MiniMindForCausalLM, input_ids: torch.Tensor, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> torch.Tensor:
    """input_ids [B, S] -> [B, S + n] with n <= max_new_tokens new tokens, using a KV cache.

    Stops when every row has produced `eos_id` (rows that finished earlier are filled with it) or after
    max_new_tokens. Sampling draws from a generator seeded with `seed` on the model's device.
    """
    cache = KVCache.allocate(model, input_ids.shape[0], input_ids.shape[1] + max_new_tokens)
    return decode(model, lambda ids: forward_cached(model, ids, cache), input_ids, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_p=top_p, seed=seed, eos_id=eos_id)


def decode(model, forward, input_ids: torch.Tensor, *, max_new_tokens: int, temperature: float, top_p: float,
           seed: int, eos_id: int | None) -> torch.Tensor:
    """The decoding loop of `generate` around `forward(ids [B, s]) -> logits of the last position [B, V]`,
    which runs the new positions against its own KV cache (the dense model's, or a TP rank's)."""
    check_generation_args(prompt_len=input_ids.shape[1], max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, max_position_embeddings=model.config.max_position_embeddings)
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
    logits = forward(input_ids)  # prefill: [B, S] -> [B, V]
    out = [input_ids]
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature=temperature, top_p=top_p, generator=generator)  # [B]
        if eos_id is not None:
            token = token.masked_fill(finished, eos_id)
            finished |= token == eos_id
        out.append(token[:, None])
        if step + 1 == max_new_tokens or bool(finished.all()):
            break
        logits = forward(token[:, None])  # one position: [B, 1] -> [B, V]
    return torch.cat(out, dim=1)


def generate_text(model: MiniMindForCausalLM, tokenizer: LoadedTokenizer, prompt: str, *, max_new_tokens: int,
                  temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, add_bos: bool = True) -> str:
    """Text in, text out: bos + the prompt's tokens (as in MiniMind's pretraining rows), generated until
    eos or max_new_tokens; returns the new text only, eos and other special tokens left out."""
    ids = prompt_ids(tokenizer, prompt, vocab_size=model.config.vocab_size, add_bos=add_bos)
    out = generate(model, torch.tensor([ids]), max_new_tokens=max_new_tokens, temperature=temperature,
                   top_p=top_p, seed=seed, eos_id=tokenizer.eos_id)
    return new_text(tokenizer, out[0, len(ids):].tolist())


def prompt_ids(tokenizer: LoadedTokenizer, prompt: str, *, vocab_size: int, add_bos: bool = True) -> list[int]:
    """bos + the prompt's token ids; ConfigError when the tokenizer has more ids than the model (`vocab_size`)."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, more than the model's "
                          f"vocab_size={vocab_size}")
    return ([tokenizer.bos_id] if add_bos else []) + tokenizer.tokenizer.encode(prompt).ids


def chat_prompt_ids(tokenizer: LoadedTokenizer, template: ChatTemplate, messages: list[dict], *,
                    vocab_size: int) -> list[int]:
    """The ids of a conversation rendered for the assistant's next turn (the template's generation
    prompt, `<|im_start|>assistant\n`, last; the template writes every special token, so no bos is
    added), as the SFT rows render their conversations (`data.sft`)."""
    prompt_ids(tokenizer, "", vocab_size=vocab_size)   # the tokenizer fits the model
    return tokenizer.tokenizer.encode(template.render(messages, add_generation_prompt=True),
                                      add_special_tokens=False).ids


def new_text(tokenizer: LoadedTokenizer, new: list[int]) -> str:
    """The text of generated ids, up to the first eos, special tokens left out."""
    if tokenizer.eos_id in new:
        new = new[:new.index(tokenizer.eos_id)]
    return tokenizer.tokenizer.decode(new, skip_special_tokens=True)
