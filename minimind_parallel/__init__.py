"""minimind-parallel: Megatron-style model parallelism for MiniMind-3, on torch.distributed."""
from .config import ConfigError, MiniMindConfig, ParallelConfig, check_layout
from .groups import ProcessGroups
from .model import CausalLMOutput, MiniMindForCausalLM
from .parallel_model import ParallelMiniMindForCausalLM
from .sharding import gather_state_dict, shard_state_dict

__all__ = ["ConfigError", "MiniMindConfig", "ParallelConfig", "check_layout", "ProcessGroups", "CausalLMOutput",
           "MiniMindForCausalLM", "ParallelMiniMindForCausalLM", "gather_state_dict", "shard_state_dict"]
