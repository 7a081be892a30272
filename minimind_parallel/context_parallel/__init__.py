"""Context parallelism: the sequence split over the CP group, attention across it.

    layout      which tokens each CP rank holds (load-balanced 2C chunks, or the contiguous split)
    blockwise   causal attention block by block, merged by log-sum-exp; GQA without copies
    mappings    the CP region switches: gather K/V, all-to-all between sequence and head shards
    ring        ring attention: K/V blocks around the ring, dK/dV carried home
    attention   `context_parallel_attention`: the three paths behind `--cp_comm_type`
"""
from .attention import COMM_TYPES, context_parallel_attention
from .layout import ContextLayout

__all__ = ["COMM_TYPES", "ContextLayout", "context_parallel_attention"]
