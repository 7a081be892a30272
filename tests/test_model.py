"""The dense MiniMind-3 model: MiniMind's state-dict keys, strict loading, tying, attention paths;
and the dense <-> TP-shard round trip."""
import math

import pytest
import torch

from minimind_parallel import ConfigError, MiniMindConfig, MiniMindForCausalLM, ParallelConfig
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


def test_labels_are_shifted_inside_as_minimind_and_transformers_take_them():
    """`model(ids, labels=labels)`: unshifted labels, -100 ignored, the same loss as pre-shifted targets
    and as MiniMind's forward writes it (logits[:, :-1] against labels[:, 1:])."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**TINY))
    ids = torch.randint(0, 128, (2, 10))
    labels = ids.clone()
    labels[0, 3:6] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, want, rtol=1e-6, atol=0)
    assert torch.equal(out.loss, model(ids, targets=shift_labels(labels)).loss)
    assert not torch.equal(out.loss, model(ids, targets=labels).loss)  # an unshifted loss would differ


def test_attention_mask_of_ones_is_accepted_and_any_other_is_refused_in_one_line():
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**TINY))
    ids = torch.randint(0, 128, (2, 10))
    want = model(ids, labels=ids)
    got = model(ids, torch.ones_like(ids), labels=ids)          # positionally, as MiniMind's generate passes it
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    assert torch.equal(model(ids, attention_mask=torch.ones(2, 10, dtype=torch.bool)).logits, want.logits)
    padded = torch.ones_like(ids)
    padded[1, 7:] = 0
    with pytest.raises(ConfigError, match=r"^attention_mask must be all ones .*; got 3 of 20 entries not 1$"):
        model(ids, attention_mask=padded)
    with pytest.raises(ConfigError, match=r"attention_mask must have input_ids' shape \[2, 10\]; got \[2, 9\]"):
        model(ids, attention_mask=torch.ones(2, 9))


def test_logits_to_keep_keeps_the_last_positions_or_the_ones_named():
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(**TINY))
    ids = torch.randint(0, 128, (2, 10))
    full = model(ids).logits
    assert torch.equal(model(ids, logits_to_keep=0).logits, full)
    torch.testing.assert_close(model(ids, logits_to_keep=1).logits, full[:, -1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model(ids, logits_to_keep=3).logits, full[:, -3:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model(ids, logits_to_keep=torch.tensor([0, 4])).logits, full[:, [0, 4]],
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match="logits_to_keep must be 0 with labels or targets; got logits_to_keep=1"):
        model(ids, labels=ids, logits_to_keep=1)
    with pytest.raises(ConfigError, match="logits_to_keep must be >= 0"):
        model(ids, logits_to_keep=-1)
    with pytest.raises(ConfigError, match="give labels .* or targets .*, not both"):
        model(ids, labels=ids, targets=shift_labels(ids))


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
