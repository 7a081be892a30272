"""Where a task's weights come from: a checkpoint of any layout (`--checkpoint DIR`, read whole in
one process) or MiniMind's weight file (`--from_weight PATH.pth`, read strictly against the model
arguments). Shared by `export` and `generate`; every check runs before anything starts."""
from __future__ import annotations

import argparse

import torch

from ..config import ConfigError, MiniMindConfig
from ..options import model_config


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
    from ..checkpoint import checkpoint_model_config, resolve_checkpoint
    return checkpoint_model_config(resolve_checkpoint(path))


def check_source(args) -> MiniMindConfig:
    """The model config of the weights args name (the checkpoint's, or the model arguments' for a .pth,
    which is read and checked strictly here)."""
    if (args.checkpoint is None) == (args.from_weight is None):
        raise ConfigError(f"give exactly one of --checkpoint DIR and --from_weight PATH.pth; got "
                          f"--checkpoint {args.checkpoint}, --from_weight {args.from_weight}")
    if args.checkpoint is not None:
        return check_checkpoint(args.checkpoint)
    from ..interop import load_minimind_state_dict
    config = model_config(args)
    load_minimind_state_dict(args.from_weight, config)
    return config


def read_source(args) -> tuple[MiniMindConfig, dict[str, torch.Tensor]]:
    """(config, the dense model's state dict in float32) of the weights args name."""
    from ..interop import dense_state_dict, load_minimind_state_dict
    if args.checkpoint is not None:
        from ..checkpoint import read_dense_state
        config, state = read_dense_state(args.checkpoint)
        return config, dense_state_dict(state, config, source=args.checkpoint)
    config = model_config(args)
    return config, load_minimind_state_dict(args.from_weight, config)
