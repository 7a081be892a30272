"""--zero 3's facet of the memory model (FSDP2's `fully_shard`, zero/fully_shard.py): the sizes of
its parameter groups, one per block and the root's (the embedding, the final norm, the head), as
FSDP2 lays them out over the W = DP x CP ranks (torch/distributed/fsdp/_fully_shard:
_fsdp_param.py, _fsdp_collectives.py).

    shard       this rank's rows of a parameter: dim 0 padded to a multiple of W, 1/W of it (rank 0
                holds ceil(d0 / W) rows, never padding); its grad and AdamW's two states alike
    gathered    a group's all-gather output, its unsharded parameters (one padded storage each)
                and its reduce-scatter input: the padded dim-0 of every parameter of the group
    unsaved     the gathered bytes autograd never saves: the untied embedding (its backward needs
                the ids only); every other unsharded parameter is saved by the op that reads it
                and so is filed under activations from the first forward on
    experts     under expert parallelism (ep_size > 1) each MoE layer's local experts are a group
                of their own over the EDP ranks (D x C / ep: zero/fully_shard.py's
                `shard_experts`), so a block's group is its other parameters; with one EDP rank
                (ep = D x C) the experts stay whole outside FSDP2 (fsdp_experts.py replays both)
"""
from __future__ import annotations

from dataclasses import dataclass

from ...moe.placement import expert_of
from .stage_sizes import StageSizes, numel


@dataclass(frozen=True)
class FsdpSizes:
    """Bytes of FSDP2's groups on this rank (rank 0 of the DP x CP group)."""

    block: int            # one block's gathered parameters (every block holds the same shapes)
    block_shard: int      # its shard on this rank
    root: int             # the root group's gathered parameters
    root_shard: int
    root_unsaved: int     # the gathered untied embedding
    shards: tuple         # every parameter's shard, in the model's order (the order AdamW steps them)
    # ep_size > 1: one MoE layer's local experts, their own group over the EDP ranks
    experts: int = 0        # gathered (0: one EDP rank, the experts whole outside FSDP2)
    experts_shard: int = 0  # this rank's shard of them (whole: one EDP rank)
    experts_dense: int = 0  # their dense bytes (and so their unsharded grads')

    @property
    def params(self) -> int:
        return sum(self.shards)


def _rows(shape: tuple, world: int) -> int:
    """Rows of dim 0 on rank 0 (ceil(d0 / W)) times the rest: one shard's elements."""
    return -(-shape[0] // world) * numel(shape[1:])


def fsdp_sizes(s: StageSizes) -> FsdpSizes:
    """The groups of `s`'s parameters (pp = 1: the whole model) over W = dp * cp ranks (under
    expert parallelism the experts over the W / ep EDP ranks)."""
    world, b = s.par.dp * s.par.cp, s.b
    edp = world // s.par.ep
    own = s.par.ep > 1   # the experts in groups of their own
    shards = {name: b * _rows(shape, edp if own and expert_of(name) is not None else world)
              for name, shape in s.shapes.items()}
    top = next(name for name in shards if name.startswith("model.layers.")).split(".")[2]
    block = [name for name in shards if name.startswith(f"model.layers.{top}.")]
    experts = [name for name in block if own and expert_of(name) is not None]
    block = [name for name in block if name not in experts]
    root = [name for name in shards if not name.startswith("model.layers.")]
    embed = "model.embed_tokens.weight"
    expert_shard = sum(shards[k] for k in experts)
    return FsdpSizes(block=world * sum(shards[k] for k in block), block_shard=sum(shards[k] for k in block),
                     root=world * sum(shards[k] for k in root), root_shard=sum(shards[k] for k in root),
                     root_unsaved=world * shards[embed] if not s.tied_here else 0,
                     shards=tuple(shards.values()), experts=edp * expert_shard if edp > 1 else 0,
                     experts_shard=expert_shard, experts_dense=sum(b * numel(s.shapes[k]) for k in experts))


def held_shards(s: StageSizes, z: FsdpSizes) -> tuple:
    """The parameter shards this rank holds as tensors (AdamW's two states alike): FSDP2 gives the
    ranks past a parameter's last row (dim 0 shorter than W ceil-rows, as an MoE router's E rows
    over dp x cp ranks) an empty local shard, which holds no bytes the tracker sees; the others
    hold their padded rows. The rank: CP rank `s.cp_rank` of DP rank 0 (the DP x CP mesh is
    DP-major), the rank --estimate measures."""
    world, rank = s.par.dp * s.par.cp, s.cp_rank
    return tuple(0 if rank * -(-shape[0] // world) >= shape[0] else shard
                 for shape, shard in zip(s.shapes.values(), z.shards))

