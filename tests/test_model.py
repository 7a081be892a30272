"""The dense MiniMind-3 model: MiniMind's state-dict keys, strict loading, tying, attention paths;
and the dense <-> TP-shard round trip."""
import math

import pytest
import torch

from minimind_parallel import MiniMindConfig, MiniMindForCausalLM, ParallelConfig
from minimind_parallel.data.batches import shift_labels
from minimind_parallel.sharding import gather_state_dict, shard_state_dict

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def minimind_keys(layers):
    """The key list of jingyaogong/minimind's MiniMindForCausalLM, written out from its layout."""
    keys = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        keys += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        keys += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        keys += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return sorted(keys)


def test_defaults_are_minimind3():
    c = MiniMindConfig()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (768, 8, 8, 4)
    assert c.intermediate_size == math.ceil(768 * math.pi / 64) * 64 == 2432
    assert (c.head_dim, c.vocab_size, c.rope_theta, c.rms_norm_eps) == (96, 6400, 1e6, 1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_state_dict_keys_and_strict_load(tied):
    config = MiniMindConfig(**TINY, tie_word_embeddings=tied)
    model = MiniMindForCausalLM(config)
    sd = model.state_dict()
    assert sorted(sd) == minimind_keys(2)
    h, hd = 64, 16
    shapes = {"model.layers.0.self_attn.q_proj.weight": (4 * hd, h), "model.layers.0.self_attn.k_proj.weight": (2 * hd, h),
              "model.layers.0.self_attn.o_proj.weight": (h, 4 * hd), "model.layers.0.self_attn.q_norm.weight": (hd,),
              "model.layers.0.mlp.gate_proj.weight": (config.intermediate_size, h), "lm_head.weight": (128, h)}
    for k, shape in shapes.items():
        assert tuple(sd[k].shape) == shape, k
    other = MiniMindForCausalLM(config)
    other.load_state_dict({k: v.clone() for k, v in sd.items()}, strict=True)
    ids = torch.randint(0, 128, (2, 10))
    torch.testing.assert_close(other(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_loss_is_shifted_and_ignores_minus_100():
    """MiniMind-style labels, shifted by the data module: the loss predicts label s+1 from position s."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**TINY))
    ids = torch.randint(0, 128, (2, 10))
    labels = ids.clone()
    labels[:, 4] = -100
    out = model(ids, targets=shift_labels(labels))
    logp = out.logits.log_softmax(-1)[:, :-1]
    tgt = labels[:, 1:]
    keep = tgt != -100
    want = -logp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep].mean()
    torch.testing.assert_close(out.loss, want)


def test_flash_and_manual_attention_agree():
    torch.manual_seed(0)
    a = MiniMindForCausalLM(MiniMindConfig(**TINY, flash_attn=True)).double()
    b = MiniMindForCausalLM(MiniMindConfig(**TINY, flash_attn=False)).double()
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 128, (2, 12))
    torch.testing.assert_close(a(ids).logits, b(ids).logits, atol=1e-12, rtol=1e-12)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**TINY)).double()
    ids = torch.randint(0, 128, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 128
    torch.testing.assert_close(model(ids).logits[:, :8], model(changed).logits[:, :8], atol=1e-12, rtol=1e-12)


def megatron_slice(key: str, dense: torch.Tensor, tp: int, rank: int, vocab_parallel: bool) -> torch.Tensor:
    """The part of a dense parameter that TP rank `rank` must hold, written out from Megatron's
    layout (Shoeybi et al. 2019, section 3): a column-parallel linear (q/k/v, gate/up) holds its
    rank's output features, i.e. rows of the [out, in] weight; a row-parallel one (o, down) its
    input features, i.e. columns; a vocab-parallel embedding / lm_head its rows of the vocabulary;
    every norm is replicated."""
    name = key.split(".")[-2]
    if name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") or (vocab_parallel and name in
                                                                         ("embed_tokens", "lm_head")):
        rows = dense.shape[0] // tp
        return dense[rank * rows:(rank + 1) * rows, :]
    if name in ("o_proj", "down_proj"):
        cols = dense.shape[1] // tp
        return dense[:, rank * cols:(rank + 1) * cols]
    return dense


def assert_shards_are_megatron_slices(sd: dict, shards: list, tp: int, vocab_parallel: bool) -> None:
    """shards[r] holds, for every key it has, exactly the dense slice of TP rank r % tp."""
    for r, shard in enumerate(shards):
        assert shard, r
        for key, value in shard.items():
            assert torch.equal(value, megatron_slice(key, sd[key], tp, r % tp, vocab_parallel)), (key, r)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("vp", [False, True])
def test_shard_gather_round_trip_is_bit_exact(tp, vp):
    torch.manual_seed(0)
    sd = MiniMindForCausalLM(MiniMindConfig(**TINY, tie_word_embeddings=False)).state_dict()
    par = ParallelConfig(tp=tp, vocab_parallel=vp)
    shards = [shard_state_dict(sd, par, r) for r in range(tp)]
    assert all(sorted(s) == sorted(sd) for s in shards)
    assert_shards_are_megatron_slices(sd, shards, tp, vp)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert shards[1][q].shape[0] == sd[q].shape[0] // tp
    assert shards[0]["model.layers.0.self_attn.o_proj.weight"].shape[1] == sd["model.layers.0.self_attn.o_proj.weight"].shape[1] // tp
    assert (shards[0]["lm_head.weight"].shape[0] == 128 // tp) == vp
    back = gather_state_dict(shards, par)
    assert sorted(back) == sorted(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
