"""MiniMind's weight file: `{weight}_{hidden_size}.pth`, read strictly and written as MiniMind writes it.

jingyaogong/minimind's trainer (trainer/trainer_utils.py, `lm_checkpoint`) saves
`model.state_dict()` with every tensor cast to half precision and moved to the CPU, under
`{save_dir}/{weight}_{hidden_size}.pth` (e.g. `pretrain_768.pth`), `{weight}_{hidden_size}_moe.pth`
for the mixture-of-experts model (`use_moe`). With tied word embeddings the
state dict names the one matrix twice, `model.embed_tokens.weight` and `lm_head.weight`, and the
file holds both (two equal half-precision copies); the RoPE tables are non-persistent buffers and
are not in it. The keys are the dense model's (`minimind_parallel/model.py`).

Here every key of the dense model must be present with its exact shape and no other key may be,
so a file of another size is refused with one line naming the first key that differs (a dense
file for the MoE model, or an MoE file for the dense one, is named as such). Whether the
file is tied is read from it (the two shared keys hold equal tensors) and must agree with the
model's `tie_word_embeddings`: MiniMind's strict `load_state_dict` into its tied default class
accepts an untied file without a word (the last of the two keys wins), with wrong logits.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from ..config import ConfigError, MiniMindConfig
from ..files import atomic_path
from ..model import MiniMindForCausalLM

EMBED_KEY, HEAD_KEY = "model.embed_tokens.weight", "lm_head.weight"


def minimind_weight_name(weight: str, hidden_size: int, use_moe: bool = False) -> str:
    """MiniMind's file name for a weight kind and width: ("pretrain", 768) -> "pretrain_768.pth";
    the MoE model's "pretrain_768_moe.pth"."""
    if not weight or os.sep in weight:
        raise ConfigError(f"weight name must be a non-empty file-name prefix such as 'pretrain'; got {weight!r}")
    return f"{weight}_{hidden_size}{'_moe' if use_moe else ''}.pth"


def expected_shapes(config: MiniMindConfig) -> dict[str, torch.Size]:
    """Every state-dict key of the dense model and its shape, in the model's order (built on the meta device)."""
    with torch.device("meta"):
        model = MiniMindForCausalLM(config)
    return {k: v.shape for k, v in model.state_dict().items()}


def _describe(c: MiniMindConfig) -> str:
    moe = f", num_experts={c.num_experts}" if c.use_moe else ""
    return (f"hidden_size={c.hidden_size}, num_hidden_layers={c.num_hidden_layers}, "
            f"vocab_size={c.vocab_size}, tie_word_embeddings={c.tie_word_embeddings}, use_moe={c.use_moe}{moe}")


_DENSE_MLP, _ROUTER = ".mlp.gate_proj.weight", ".mlp.gate.weight"


def check_moe_kind(state: Mapping[str, torch.Tensor], config: MiniMindConfig, source: str) -> None:
    """ConfigError when `state` is a dense model and `config` the MoE one, or the other way round."""
    dense = next((k for k in state if k.endswith(_DENSE_MLP)), None)
    moe = next((k for k in state if k.endswith(_ROUTER)), None)
    if config.use_moe and dense is not None and moe is None:
        raise ConfigError(f"{source} holds a dense model ({dense}, no router) but --use_moe builds the "
                          f"mixture-of-experts model; drop --use_moe")
    if not config.use_moe and moe is not None:
        raise ConfigError(f"{source} holds a mixture-of-experts model ({moe}) but the model is dense; "
                          f"pass --use_moe (and its --num_experts)")


def _and_more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def _shape(shape) -> str:
    return f"[{', '.join(str(n) for n in shape)}]"


def check_dense_state(state: Mapping[str, torch.Tensor], config: MiniMindConfig, *, source: str = "state dict"):
    """Raise ConfigError (one line, naming the key and the shapes) unless `state` has exactly the
    dense model's keys with its shapes. Problems are reported shape first, then missing, then unknown keys."""
    want = expected_shapes(config)
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"{source}: {key} is a {type(value).__name__}, not a tensor")
    check_moe_kind(state, config, source)
    wrong = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k])]
    missing = [k for k in want if k not in state]
    unknown = sorted(k for k in state if k not in want)
    if wrong:
        k = wrong[0]
        raise ConfigError(f"{source}: {k} has shape {_shape(state[k].shape)} but the model ({_describe(config)}) "
                          f"expects {_shape(want[k])}{_and_more(wrong)}")
    if missing:
        k = missing[0]
        raise ConfigError(f"{source}: missing {k} (shape {_shape(want[k])}) that the model "
                          f"({_describe(config)}) needs{_and_more(missing)}")
    if unknown:
        k = unknown[0]
        raise ConfigError(f"{source}: unknown key {k} (shape {_shape(state[k].shape)}) that the model "
                          f"({_describe(config)}) does not have{_and_more(unknown)}")


def _fill_tied(state: Mapping[str, torch.Tensor], config: MiniMindConfig, source: str) -> dict:
    """With tied embeddings, either name of the shared matrix suffices; both must agree when both are given."""
    state = dict(state)
    if not config.tie_word_embeddings:
        return state
    present = [k for k in (EMBED_KEY, HEAD_KEY) if k in state]
    if len(present) == 2:
        embed, head = state[EMBED_KEY], state[HEAD_KEY]
        if embed.shape == head.shape and not torch.equal(embed, head):
            diff = (embed.double() - head.double()).abs().max().item()
            raise ConfigError(f"{source}: {EMBED_KEY} and {HEAD_KEY} differ (max abs {diff:.3g}), an untied model, "
                              f"but tie_word_embeddings=True shares them; pass --no-tie_word_embeddings")
    elif present:
        state[EMBED_KEY] = state[HEAD_KEY] = state[present[0]]
    return state


def is_tied(state: Mapping[str, torch.Tensor]) -> bool | None:
    """Whether a MiniMind state dict holds a tied model: its two shared keys hold equal tensors (MiniMind's
    file of a tied model has the one matrix twice). None when one of the keys is not there."""
    embed, head = state.get(EMBED_KEY), state.get(HEAD_KEY)
    if not (isinstance(embed, torch.Tensor) and isinstance(head, torch.Tensor)):
        return None
    return embed.shape == head.shape and torch.equal(embed, head)


def check_tying(state: Mapping[str, torch.Tensor], config: MiniMindConfig, source: str) -> None:
    """ConfigError when a file holds a tied model and `config` unties it. (Two different matrices under a
    tied config are refused by `dense_state_dict`: they cannot be one.)"""
    if is_tied(state) and not config.tie_word_embeddings:
        raise ConfigError(f"{source} holds a tied model ({EMBED_KEY} and {HEAD_KEY} are equal) but the model has "
                          f"tie_word_embeddings=False; pass --tie_word_embeddings")


def _not_finite(state: Mapping[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def _count(value: torch.Tensor) -> str:
    nan, inf = int(value.isnan().sum()), int(value.isinf().sum())
    return f"{nan} nan and {inf} inf of its {value.numel()} values"


def check_finite(state: Mapping[str, torch.Tensor], *, source: str = "state dict") -> None:
    """ConfigError (one line naming the first tensor) when a tensor of `state` holds nan or inf: a model
    started or exported from it would only ever compute nan."""
    bad = _not_finite(state)
    if bad:
        raise ConfigError(f"{source}: {bad[0]} is not finite ({_count(state[bad[0]])}){_and_more(bad)}; "
                          f"refusing weights that are not finite")


def _check_cast(cast: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], dtype, source: str) -> None:
    """ConfigError when casting finite weights to `dtype` made some infinite (beyond float16's range)."""
    bad = _not_finite(cast)
    if bad:
        top = state[bad[0]].abs().max().item()
        raise ConfigError(f"{source}: {bad[0]} overflows {str(dtype).removeprefix('torch.')} (max abs {top:.4g}, "
                          f"largest finite {torch.finfo(dtype).max:.4g}){_and_more(bad)}")


def dense_state_dict(state: Mapping[str, torch.Tensor], config: MiniMindConfig, *, source: str = "state dict",
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The dense model's state dict from `state`, checked strictly and for finite values, cast to `dtype`
    (which must hold them: float16 ends at 65504), in the model's key order.

    With tied embeddings the result names the one tensor under both keys (as `model.state_dict()` does),
    whether `state` gave one of them or both.
    """
    state = _fill_tied(state, config, source)
    check_dense_state(state, config, source=source)
    check_finite(state, source=source)
    out = {k: state[k].detach().to(dtype) for k in expected_shapes(config)}
    _check_cast(out, state, dtype, source)
    if config.tie_word_embeddings:
        out[HEAD_KEY] = out[EMBED_KEY]
    return out


def load_minimind_state_dict(path: str, config: MiniMindConfig, *,
                             dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Read a MiniMind `.pth` into the dense model's state dict (CPU, `dtype`); ConfigError on any mismatch.

    `model.load_state_dict(load_minimind_state_dict(path, model.config), strict=True)` then loads it.
    """
    if not os.path.isfile(path):
        raise ConfigError(f"MiniMind weights {path} not found")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types (pickle, zip, unsupported global) for a bad file
        raise ConfigError(f"cannot read MiniMind weights {path}: {str(e).splitlines()[0] if str(e) else e!r}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} holds a {type(loaded).__name__}, not a MiniMind state dict")
    if isinstance(loaded.get("model"), dict) and "optimizer" in loaded:
        raise ConfigError(f"{path} is a MiniMind resume checkpoint (model and optimizer); pass the weights file "
                          f"{{weight}}_{{hidden_size}}.pth that MiniMind writes beside it")
    check_tying(loaded, config, path)
    return dense_state_dict(loaded, config, source=path, dtype=dtype)


def save_minimind_state_dict(dense_state: Mapping[str, torch.Tensor], path: str, *,
                             config: MiniMindConfig | None = None, overwrite: bool = False,
                             dtype: torch.dtype = torch.float16) -> str:
    """Write `dense_state` as MiniMind's trainer does: every tensor cast to `dtype` (half) on the CPU,
    one `torch.save` of the dict. With `config` the state is first checked strictly, and tied
    embeddings are written under both keys, as in MiniMind's files. Atomic; an existing file is
    refused unless `overwrite`."""
    if os.path.isdir(path):
        raise ConfigError(f"{path} is a directory; MiniMind weights are one file such as "
                          f"{minimind_weight_name('pretrain', config.hidden_size if config else 768, bool(config and config.use_moe))}")
    if os.path.exists(path) and not overwrite:
        raise ConfigError(f"{path} already exists; pass --overwrite to replace it")
    if config is not None:
        dense_state = dense_state_dict(dense_state, config, dtype=dtype)
    # A copy per key, as MiniMind's `v.half().cpu()`: tied keys become two equal tensors in the file.
    half = {k: v.detach().to(device="cpu", dtype=dtype, copy=True) for k, v in dense_state.items()}
    with atomic_path(path) as tmp:
        torch.save(half, tmp)
    return path
