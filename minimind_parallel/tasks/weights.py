"""Where a task's weights come from: a checkpoint of any layout (`--checkpoint DIR`, read whole in
one process) or MiniMind's weight file (`--from_weight PATH.pth`, read strictly against the model
arguments). Shared by `export` and `generate`; every check runs before anything starts."""
from __future__ import annotations

import argparse
import os
from dataclasses import replace

import torch

from ..checkpoint import check_checkpoint_config, checkpoint_model_config, read_dense_state, resolve_checkpoint
from ..checkpoint.directory import read_meta
from ..config import ConfigError, MiniMindConfig
from ..interop import dense_state_dict, load_minimind_state_dict
from ..options import rope_scaling


def add_checkpoint_arg(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--checkpoint", default=None, required=required, metavar="DIR",
                   help="a checkpoint, or a save directory (its latest complete checkpoint); any layout")


def add_source_args(p: argparse.ArgumentParser) -> None:
    """--checkpoint DIR or --from_weight PATH.pth (exactly one)."""
    add_checkpoint_arg(p, required=False)
    p.add_argument("--from_weight", default=None, metavar="PTH",
                   help="MiniMind weights ({weight}_{hidden}.pth) for the model of the model arguments")


def check_checkpoint(path: str) -> MiniMindConfig:
    """The model config of the complete checkpoint `path` resolves to; ConfigError when there is none."""
    return checkpoint_model_config(resolve_checkpoint(path))


def check_source(args, model: MiniMindConfig | None) -> MiniMindConfig:
    """The model config of the weights args name (the checkpoint's, or `model`, the model arguments',
    for a .pth); the weights are read and checked here: strictly against the model, tying, finite values."""
    if (args.checkpoint is None) == (args.from_weight is None):
        raise ConfigError(f"give exactly one of --checkpoint DIR and --from_weight PATH.pth; got "
                          f"--checkpoint {args.checkpoint}, --from_weight {args.from_weight}")
    config, _ = read_source(args, model)  # read whole: every key, shape and value checked (finite) before launch
    return config


def trained_length(args) -> int | None:
    """The sequence length the checkpoint's run trained on (`train --max_seq_len`); None for a .pth
    (MiniMind's weight file does not say) or a checkpoint that does not record it."""
    if args.checkpoint is None:
        return None
    return read_meta(args.checkpoint).get("extra", {}).get("max_seq_len")


def read_source(args, model: MiniMindConfig | None) -> tuple[MiniMindConfig, dict[str, torch.Tensor]]:
    """(config, the dense model's state dict in float32) of the weights args name; `model`: the
    model of the model arguments, which a .pth is read against."""
    if args.checkpoint is not None:
        config, state = read_dense_state(args.checkpoint)
        state = dense_state_dict(state, config, source=args.checkpoint)
        return replace(config, rope_scaling=rope_scaling(args)), state   # how to run it: this command's
    return model, load_minimind_state_dict(args.from_weight, model)


def read_initial_weights(path: str, config: MiniMindConfig) -> dict[str, torch.Tensor]:
    """A run's starting weights (`train` / `sft --from_weight`): MiniMind's weight file, read strictly
    against `config`, or a checkpoint (or save directory) of any layout whose model is `config`;
    the dense state dict in float32. ConfigError (one line) when it does not fit."""
    if os.path.isdir(path):
        resolved = resolve_checkpoint(path)
        check_checkpoint_config(resolved, config)
        saved, state = read_dense_state(resolved)
        return dense_state_dict(state, saved, source=path)
    return load_minimind_state_dict(path, config)
