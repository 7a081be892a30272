"""Held-out loss and perplexity: forward-only through the pipeline schedule, every layout.

The loss is the mean over every target token of all held-out batches (each data-parallel
replica's batches summed token-weighted, `loss_normalisation`'s held-out row, as the train task's
log line does for training); perplexity is exp(loss).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from torch import nn

from ..data.batches import Batch, split_microbatches
from ..groups import ProcessGroups
from ..loss_normalisation import replica_targets, token_sum, world_token_mean
from .mixed_precision import Precision
from ..pipeline_parallel import forward_backward


def heldout_loss(model: nn.Module, groups: ProcessGroups, batches: Iterable[Batch], *, num_microbatches: int,
                 precision: Precision) -> tuple[float, float]:
    """-> (mean loss over every held-out target token, perplexity), the same on every rank.
    `batches`: this replica's rows of each held-out global batch. Collective over the world."""
    was_training = model.training
    model.eval()
    loss_sum, count = None, None
    for batch in batches:
        result = forward_backward(model, groups, split_microbatches(*batch, num_microbatches), forward_only=True,
                                  forward_context=precision.forward_context)
        n = replica_targets(batch.targets, groups)   # the replica's targets (CP: all ranks')
        count = n if count is None else count + n
        if result.loss is not None:   # the last stage: this replica's mean over the batch's targets
            part = token_sum(result.loss, n)
            loss_sum = part if loss_sum is None else loss_sum + part
    model.train(was_training)
    loss, _ = world_token_mean(loss_sum, count, groups)
    return loss, math.exp(min(loss, 700.0))  # exp overflows float64 past ~709
