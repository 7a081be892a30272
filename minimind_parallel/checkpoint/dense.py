"""A checkpoint of any layout read back as the dense model's state dict, in one process, no ranks.

DCP's index (`.metadata`) gives the dense size and dtype of every saved tensor; loading with
`no_dist=True` into full-size tensors makes DCP read every saved chunk into its place, whatever
TP / PP / DP layout wrote it (the inverse of `placement.placed`). Only the model's tensors are
read (`model.<key>`), never the optimizer's. A tied pair is saved once, under the embedding's
name (`placement.checkpoint_key`); the result names it twice, as `model.state_dict()` does.
"""
from __future__ import annotations

import warnings

import torch

from ..config import MiniMindConfig
from .directory import read_checkpoint_config, resolve_checkpoint
from .placement import TIED_KEY

MODEL_PREFIX = "model."
HEAD_KEY = "lm_head.weight"


def checkpoint_model_config(path: str) -> MiniMindConfig:
    """The MiniMindConfig a checkpoint was saved with (meta.json)."""
    return MiniMindConfig(**read_checkpoint_config(path))


def read_dense_state(path: str) -> tuple[MiniMindConfig, dict[str, torch.Tensor]]:
    """(config, dense state dict) of the complete checkpoint `path` resolves to (a checkpoint, or a
    save directory's latest). Tensors on the CPU in the dtype they were saved in."""
    import torch.distributed.checkpoint as dcp  # here: slow to import (DTensor), needed to read one only
    path = resolve_checkpoint(path)
    config = checkpoint_model_config(path)
    index = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model = {fqn[len(MODEL_PREFIX):]: torch.empty(tuple(info.size), dtype=info.properties.dtype)
             for fqn, info in index.items() if fqn.startswith(MODEL_PREFIX)}
    with warnings.catch_warnings():   # DCP warns that it loads in one process: what no_dist asks for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model}, checkpoint_id=path, no_dist=True)   # every chunk into its full tensor
    if config.tie_word_embeddings and TIED_KEY in model:
        model[HEAD_KEY] = model[TIED_KEY]
    return config, model
