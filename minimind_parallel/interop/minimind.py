"""MiniMind's weight file: `{weight}_{hidden_size}.pth`, read strictly and written as MiniMind writes it.

jingyaogong/minimind's trainer (trainer/trainer_utils.py, `lm_checkpoint`) saves
`model.state_dict()` with every tensor cast to half precision and moved to the CPU, under
`{save_dir}/{weight}_{hidden_size}.pth` (e.g. `pretrain_768.pth`). With tied word embeddings the
state dict names the one matrix twice, `model.embed_tokens.weight` and `lm_head.weight`, and the
file holds both (two equal half-precision copies); the RoPE tables are non-persistent buffers and
are not in it. The keys are the dense model's (`minimind_parallel/model.py`).

MiniMind itself loads with `strict=False`; here every key of the dense model must be present with
its exact shape and no other key may be, so a file of another size is refused with one line
naming the first key that differs, instead of training from a silently half-loaded model.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from ..config import ConfigError, MiniMindConfig
from ..files import atomic_path
from ..model import MiniMindForCausalLM

EMBED_KEY, HEAD_KEY = "model.embed_tokens.weight", "lm_head.weight"


def minimind_weight_name(weight: str, hidden_size: int) -> str:
    """MiniMind's file name for a weight kind and width: ("pretrain", 768) -> "pretrain_768.pth"."""
    if not weight or os.sep in weight:
        raise ConfigError(f"weight name must be a non-empty file-name prefix such as 'pretrain'; got {weight!r}")
    return f"{weight}_{hidden_size}.pth"


def expected_shapes(config: MiniMindConfig) -> dict[str, torch.Size]:
    """Every state-dict key of the dense model and its shape, in the model's order (built on the meta device)."""
    with torch.device("meta"):
        model = MiniMindForCausalLM(config)
    return {k: v.shape for k, v in model.state_dict().items()}


def _describe(c: MiniMindConfig) -> str:
    return (f"hidden_size={c.hidden_size}, num_hidden_layers={c.num_hidden_layers}, "
            f"vocab_size={c.vocab_size}, tie_word_embeddings={c.tie_word_embeddings}")


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
            raise ConfigError(f"{source}: {EMBED_KEY} and {HEAD_KEY} differ (max abs {diff:.3g}) "
                              f"but tie_word_embeddings=True shares them")
    elif present:
        state[EMBED_KEY] = state[HEAD_KEY] = state[present[0]]
    return state


def dense_state_dict(state: Mapping[str, torch.Tensor], config: MiniMindConfig, *, source: str = "state dict",
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The dense model's state dict from `state`, checked strictly, cast to `dtype`, in the model's key order.

    With tied embeddings the result names the one tensor under both keys (as `model.state_dict()` does),
    whether `state` gave one of them or both.
    """
    state = _fill_tied(state, config, source)
    check_dense_state(state, config, source=source)
    out = {k: state[k].detach().to(dtype) for k in expected_shapes(config)}
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
                          f"{minimind_weight_name('pretrain', config.hidden_size if config else 768)}")
    if os.path.exists(path) and not overwrite:
        raise ConfigError(f"{path} already exists; pass --overwrite to replace it")
    if config is not None:
        dense_state = dense_state_dict(dense_state, config, dtype=dtype)
    # A copy per key, as MiniMind's `v.half().cpu()`: tied keys become two equal tensors in the file.
    half = {k: v.detach().to(device="cpu", dtype=dtype, copy=True) for k, v in dense_state.items()}
    with atomic_path(path) as tmp:
        torch.save(half, tmp)
    return path
