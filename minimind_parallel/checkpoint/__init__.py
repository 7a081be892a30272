"""Checkpoints with `torch.distributed.checkpoint`: every parameter and optimizer state as a shard
placed by the parallel plan (DCP reshards on load), atomic saves behind a `latest` marker, and the
checks the launcher runs before any rank starts. See docs/checkpoints.md."""
from .directory import (check_checkpoint_config, check_save_dir, latest_checkpoint, read_checkpoint_config,
                        resolve_checkpoint)
from .dense import checkpoint_model_config, read_dense_state
from .state import load_checkpoint, save_checkpoint

__all__ = ["check_checkpoint_config", "check_save_dir", "checkpoint_model_config", "latest_checkpoint",
           "load_checkpoint", "read_checkpoint_config", "read_dense_state", "resolve_checkpoint", "save_checkpoint"]
