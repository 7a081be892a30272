"""Tensor, sequence and vocab parallelism: collectives, region switches, layers, loss."""
from .async_linear import LinearWithAsyncCommunication, linear_with_async_communication
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, column_parallel,
                     mark_partial_grad)
from .mappings import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tensor_parallel_region)
