"""Checkpoints with `torch.distributed.checkpoint`: every parameter and optimizer state as a shard
placed by the parallel plan (DCP reshards on load), atomic saves behind a `latest` marker, and the
checks the launcher runs before any rank starts. See docs/checkpoints.md."""
from .directory import (check_checkpoint_config, check_save_dir, latest_checkpoint, prune, read_checkpoint_config,
                        read_extra, resolve_checkpoint)
from .dense import checkpoint_model_config, read_dense_state
from .state import CheckpointSaveError, load_checkpoint, save_checkpoint

__all__ = ["CheckpointSaveError", "check_checkpoint_config", "check_save_dir", "checkpoint_model_config",
           "latest_checkpoint", "load_checkpoint", "prune", "read_checkpoint_config", "read_dense_state", "read_extra",
           "resolve_checkpoint", "save_checkpoint"]
