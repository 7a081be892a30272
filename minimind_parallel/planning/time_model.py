"""`step_time`: the predicted time of one optimizer step of a layout, from a few stated rates
(`Hardware`). Every piece is one line of arithmetic (docs/planning.md states them):

    compute      GEMM FLOPs / gemm_flops + causal attention FLOPs / attention_flops + elementwise
                 bytes / memory_bandwidth, and the dispatched ops x op_overhead_s: on a GPU the
                 host runs ahead of the kernels (the longer of the two), on a CPU they add up;
                 per microbatch per stage;
                 backward = 2 x forward; --recompute full re-runs every block's forward
    tensor       per block: the row-parallel outputs' all-reduce (reduce-scatter under SP) and the
                 column-parallel inputs' copy / all-gather (one per linear, one per region with
                 --shared_sp_gather), forward and backward; --async_communication overlaps the
                 backward's with the weight-grad GEMM (and re-gathers the input under SP)
    context      all_gather: K/V gathered forward, their grads reduce-scattered backward; a2a: four
                 all-to-alls each way; ring: cp - 1 K/V block passes each way, each overlapped
                 with one block of attention
    pipeline     M microbatches and the bubble of the schedule: (P - 1) x the slowest stage's microbatch
                 (GPipe and 1F1B); divided by V with V model chunks per stage (interleaved, Narayanan et
                 al. 2021), whose boundaries each send the activation V times; (P - 1) x its forward
                 and communication, the backward's weight-grad half filling the rest (ZB-H1, Qi et
                 al. 2023: (P - 1)(T_F + T_B - T_W) with T_B = T_W); each boundary's activation sent
                 forward and its grad back
    experts      (--use_moe) the router's GEMM and the experts' at the routed token count, N k rows
                 per rank under balanced routing (whole on every TP rank; under SP each TP rank routes
                 its shard); under EP per MoE layer the count exchange and the tokens' all-to-all
                 out and back, forward and backward (none overlapped), and the aux statistics'
                 all-reduce over dp x cp
    data         the stage's gradients all-reduced over dp x cp (an expert's over its EDP group,
                 dp x cp / ep): under DDP (pp = 1) overlapped with the backward, under a pipeline
                 after it; --zero 1 (the distributed optimizer) instead reduce-scatters each bucket
                 after the last microbatch and all-gathers it after the step, both exposed;
                 --zero 2 reduce-scatters while backward runs (hidden behind it as DDP's, pp = 1)
    optimizer    AdamW's per-element traffic over this rank's parameters (under --zero its slice,
                 one tensor per bucket)

A collective of `n` bytes over `g` ranks on a link (latency a, bandwidth w): all-reduce
2 (g-1) (a + n / (g w)), all-gather / reduce-scatter (g-1) (a + n / (g w)), all-to-all
(g-1) (a + n / (g w)), a p2p send a + n / w. Which link: a group whose ranks span more than one
node's (the grid dp x pp x cp x tp, TP fastest) crosses nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import DTYPES, Choice, CPCommType, MiniMindConfig, Recompute
from ..pipeline_parallel.order import Schedule
from ..zero.buckets import DEFAULT_BUCKET_MB
from .hardware import Hardware, Link
from .space import Candidate, Workload

# Dispatched aten ops of one block's forward and backward together, and per parameter tensor of
# AdamW's step (foreach off), counted under a TorchDispatchMode on the book's block (H 768).
OPS_PER_BLOCK = 340
OPS_PER_PARAM_STEP = 10
# Elementwise passes over the hidden state per block (norms, residuals, RoPE, SwiGLU; forward and
# backward), in units of one [tokens, H] tensor read or written; AdamW's per element accesses.
ELEMENTWISE_PASSES_PER_BLOCK = 40
ADAMW_ACCESSES = 12


class Op(Choice):
    """A collective's kind, as the time model costs it."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    P2P = "p2p"


@dataclass(frozen=True)
class Collective:
    kind: Op
    nbytes: float
    ranks: int

    def seconds(self, link: Link) -> float:
        g = self.ranks
        if self.nbytes <= 0:        # nothing to move: never issued
            return 0.0
        if self.kind == Op.P2P:
            return link.latency_s + self.nbytes / link.bandwidth
        if g <= 1:
            return 0.0
        steps = 2 * (g - 1) if self.kind == Op.ALL_REDUCE else g - 1
        return steps * (link.latency_s + self.nbytes / (g * link.bandwidth))


@dataclass
class StepTime:
    """Seconds of one step and its parts (the slowest stage's, with the bubble and the step's tail)."""

    compute: float = 0.0
    tp_exposed: float = 0.0
    cp_exposed: float = 0.0
    ep_exposed: float = 0.0
    pp_p2p: float = 0.0
    bubble: float = 0.0
    dp_exposed: float = 0.0
    optimizer: float = 0.0
    parts: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return (self.compute + self.tp_exposed + self.cp_exposed + self.ep_exposed + self.pp_p2p + self.bubble
                + self.dp_exposed + self.optimizer)

    def as_ms(self) -> dict:
        return {k: 1e3 * getattr(self, k) for k in ("compute", "tp_exposed", "cp_exposed", "ep_exposed", "pp_p2p",
                                                      "bubble", "dp_exposed", "optimizer")}


def crosses_nodes(span: int, w: Workload) -> bool:
    """A group of consecutive ranks `span` wide (its stride x its size) leaves a node when wider than one."""
    return w.nnodes > 1 and span > w.ranks_per_node


def block_matmul_params(c: MiniMindConfig) -> int:
    """A block's matrices split over TP: attention's and the dense SwiGLU's (a MoE block: attention's)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    mlp = 0 if c.use_moe else 3 * c.hidden_size * c.intermediate_size
    return c.hidden_size * (2 * q + 2 * kv) + mlp


def expert_params(c: MiniMindConfig) -> int:
    """One expert's SwiGLU matrices (gate, up, down)."""
    return 3 * c.hidden_size * c.moe_intermediate_size


def moe_tokens(k: Candidate, w: Workload) -> float:
    """The tokens one rank routes per MoE layer: its CP shard, under SP its TP shard of that (without SP
    every TP rank routes the same tokens)."""
    return k.micro_batch_size * w.seq_len / k.cp / (k.tp if k.sequence_parallel else 1)


def moe_forward_flops(c: MiniMindConfig, k: Candidate, w: Workload) -> float:
    """One MoE layer's forward GEMM FLOPs on one rank: the router (H -> E) and, under balanced routing,
    N k routed rows through the experts on every rank (each EP rank's E / ep experts get N k ep / E rows
    each from its group)."""
    if not c.use_moe:
        return 0.0
    n = moe_tokens(k, w)
    return 2 * n * c.hidden_size * c.num_experts + 2 * n * c.num_experts_per_tok * expert_params(c)


def stage_compute(c: MiniMindConfig, k: Candidate, w: Workload, hw: Hardware, *, last: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch on one rank of a stage (the last one adds the head)."""
    layers = c.num_hidden_layers // k.pp
    tokens = k.micro_batch_size * w.seq_len / k.cp                       # this rank's tokens
    q = c.num_attention_heads * c.head_dim / k.tp
    gemm = 2 * tokens * block_matmul_params(c) / k.tp + moe_forward_flops(c, k, w)   # forward FLOPs of one block
    balance = 1.0 if (k.cp == 1 or k.cp_load_balance) else (2 * k.cp - 1) / k.cp   # the last CP rank's share
    attention = 2 * tokens * w.seq_len * q * balance                     # causal: QK^T and PV over S/2 keys
    b = DTYPES[w.dtype].itemsize
    elementwise = ELEMENTWISE_PASSES_PER_BLOCK * tokens * c.hidden_size * b / (k.tp if k.sequence_parallel else 1)
    fwd_block = gemm / hw.gemm_flops + attention / hw.attention_flops + elementwise / 3 / hw.memory_bandwidth
    bwd_block = 2 * gemm / hw.gemm_flops + 2 * attention / hw.attention_flops + 2 * elementwise / 3 / hw.memory_bandwidth
    ops = OPS_PER_BLOCK * hw.op_overhead_s
    fwd, bwd = layers * hw.dispatched(fwd_block, ops / 3), layers * hw.dispatched(bwd_block, 2 * ops / 3)
    if k.recompute == Recompute.FULL:
        bwd += layers * hw.dispatched(fwd_block, ops / 3)
    elif k.recompute == Recompute.SELECTIVE:
        bwd += layers * elementwise / 3 / hw.memory_bandwidth            # norms and SwiGLU re-made
    if last:
        vocab = c.vocab_size / k.tp if k.vocab_parallel else c.vocab_size
        head = 2 * tokens * c.hidden_size * vocab / hw.gemm_flops + 4 * tokens * vocab * 4 / hw.memory_bandwidth
        fwd, bwd = fwd + head, bwd + 2 * head
    return fwd, bwd


def tensor_collectives(c: MiniMindConfig, k: Candidate, w: Workload) -> tuple[list, list, list]:
    """One block's TP collectives of one microbatch: (forward, backward that can overlap the weight
    grads under async, backward that cannot)."""
    if k.tp == 1:
        return [], [], []
    n = k.micro_batch_size * w.seq_len / k.cp * c.hidden_size * DTYPES[w.dtype].itemsize   # [S/C, B, H] bytes
    column = 2 if k.shared_sp_gather else 5    # q k v gate up: one entry into the region each, or one per region
    if k.sequence_parallel:
        fwd = [Collective(Op.ALL_GATHER, n, k.tp)] * column + [Collective(Op.REDUCE_SCATTER, n, k.tp)] * 2
        overlap = [Collective(Op.REDUCE_SCATTER, n, k.tp)] * column
        rest = [Collective(Op.ALL_GATHER, n, k.tp)] * 2
        if k.async_communication:               # the backward re-gathers each column input
            overlap = overlap + [Collective(Op.ALL_GATHER, n, k.tp)] * column
    else:
        fwd = [Collective(Op.ALL_REDUCE, n, k.tp)] * 2
        overlap, rest = [Collective(Op.ALL_REDUCE, n, k.tp)] * column, []
    return fwd, overlap, rest


def context_collectives(c: MiniMindConfig, k: Candidate, w: Workload) -> tuple[list, list]:
    """One block's CP collectives of one microbatch: (forward, backward)."""
    if k.cp == 1:
        return [], []
    b = DTYPES[w.dtype].itemsize
    tokens = k.micro_batch_size * w.seq_len / k.cp
    kv = 2 * tokens * c.num_key_value_heads * c.head_dim / k.tp * b      # this rank's K and V
    q = tokens * c.num_attention_heads * c.head_dim / k.tp * b
    if k.cp_comm_type == CPCommType.ALL_GATHER:
        return [Collective(Op.ALL_GATHER, kv * k.cp, k.cp)], [Collective(Op.REDUCE_SCATTER, kv * k.cp, k.cp)]
    if k.cp_comm_type == CPCommType.A2A:
        each = [Collective(Op.ALL_TO_ALL, q, k.cp), Collective(Op.ALL_TO_ALL, kv / 2, k.cp),
                Collective(Op.ALL_TO_ALL, kv / 2, k.cp), Collective(Op.ALL_TO_ALL, q, k.cp)]
        return each, each
    return [Collective(Op.P2P, kv, 2)] * (k.cp - 1), [Collective(Op.P2P, 2 * kv, 2)] * (k.cp - 1)


def expert_collectives(c: MiniMindConfig, k: Candidate, w: Workload) -> tuple[list, list]:
    """One MoE layer's EP and aux-loss collectives of one microbatch: (forward, backward). Balanced
    routing: the rows this rank's experts receive (M) equal the N k it sends."""
    if not c.use_moe:
        return [], []
    b = DTYPES[w.dtype].itemsize
    stats = [Collective(Op.ALL_REDUCE, (2 * c.num_experts + 1) * 4, k.dp * k.cp)]
    stats = stats * (2 if k.sequence_parallel and k.tp > 1 else 1)   # + TP under SP
    if k.ep == 1:
        return stats, []
    rows = moe_tokens(k, w) * c.num_experts_per_tok * c.hidden_size * b
    counts = Collective(Op.ALL_TO_ALL, 8 * c.num_experts, k.ep)
    tokens = Collective(Op.ALL_TO_ALL, rows, k.ep)
    return [counts, tokens, tokens, *stats], [tokens, tokens]


def data_parallel_seconds(k: Candidate, w: Workload, link: Link, *, stage_params: int, expert_params: int,
                          backward: float) -> tuple[float, int]:
    """The exposed seconds of the grads' reduction (and under --zero the parameters' all-gather), and
    the tensors AdamW steps on this rank under --zero (its buckets' slices; 0: the parameters)."""
    b = DTYPES[w.dtype].itemsize
    dense = stage_params - expert_params
    if k.zero == 0:
        grads = (Collective(Op.ALL_REDUCE, dense * b, k.dp * k.cp).seconds(link)       # the experts' over EDP
                 + Collective(Op.ALL_REDUCE, expert_params * b, k.dp * k.cp // k.ep).seconds(link))
        return (max(0.0, grads - backward) if k.pp == 1 else grads), 0
    # the distributed optimizer: buckets of DEFAULT_BUCKET_MB over dp x cp; --zero 1 reduce-scatters
    # them after backward, --zero 2 while backward runs (hidden behind it as DDP's all-reduce is)
    buckets = max(1, -(-stage_params * b // int(DEFAULT_BUCKET_MB * 2**20)))
    each = stage_params * b / buckets
    scatter = buckets * Collective(Op.REDUCE_SCATTER, each, k.dp * k.cp).seconds(link)
    gather = buckets * Collective(Op.ALL_GATHER, each, k.dp * k.cp).seconds(link)
    if k.zero == 2 and k.pp == 1:
        scatter = max(0.0, scatter - backward)
    return scatter + gather, buckets


def seconds(coll: list, link: Link) -> float:
    return sum(x.seconds(link) for x in coll)


def pipeline_bubble(k: Candidate, per_mb: float, bwd: float) -> float:
    """The idle time of the schedule's warm-up and cool-down, from one microbatch's time on a stage
    (`per_mb`, of which `bwd` its backward)."""
    p = k.pp
    if k.pp_schedule == Schedule.INTERLEAVED:
        return (p - 1) * per_mb / k.virtual_stages
    if k.pp_schedule == Schedule.ZERO_BUBBLE:
        return (p - 1) * (per_mb - bwd)
    return (p - 1) * per_mb


def step_time(k: Candidate, w: Workload, hw: Hardware, *, stage_params: int, expert_params: int = 0) -> StepTime:
    """The predicted step of layout `k` (`stage_params`: parameter elements of the largest stage's rank,
    `expert_params` of them its experts')."""
    c = w.model
    b = DTYPES[w.dtype].itemsize
    layers = c.num_hidden_layers // k.pp
    fwd, bwd = stage_compute(c, k, w, hw, last=True)
    t = StepTime()
    tp_link = hw.link(crosses_nodes(k.tp, w))
    cp_link = hw.link(crosses_nodes(k.tp * k.cp, w))
    pp_link = hw.link(crosses_nodes(k.tp * k.cp * k.pp, w))
    dp_link = hw.link(crosses_nodes(w.world_size, w))
    # tensor parallelism, per microbatch
    tf, to, tr = tensor_collectives(c, k, w)
    wgrad = bwd / 2 / max(layers, 1)                          # one block's weight-grad GEMMs
    overlap = seconds(to, tp_link)
    tp_bwd = max(0.0, overlap - wgrad) if k.async_communication else overlap
    tp = layers * (seconds(tf, tp_link) + tp_bwd + seconds(tr, tp_link))
    # context parallelism, per microbatch
    cf, cb = context_collectives(c, k, w)
    if k.cp > 1 and k.cp_comm_type == CPCommType.RING:
        attn_step = fwd / max(layers, 1) / k.cp / 3           # one K/V block's share of a block's attention
        cp = layers * sum(max(0.0, x.seconds(cp_link) - attn_step) + 0 for x in cf + cb)
    else:
        cp = layers * (seconds(cf, cp_link) + seconds(cb, cp_link))
    # mixture of experts: the EP all-to-alls (over the DP link where the EP group leaves the CP one's)
    ef, eb = expert_collectives(c, k, w)
    ep_link = cp_link if k.ep <= k.cp else dp_link
    ep = layers * (seconds(ef, ep_link) + seconds(eb, ep_link))
    # pipeline: each boundary's activation [S/C(/T), B, H] forward, its grad backward
    act = k.micro_batch_size * w.seq_len / k.cp * c.hidden_size * b / (k.tp if k.sequence_parallel else 1)
    p2p = 2 * k.virtual_stages * Collective(Op.P2P, act, 2).seconds(pp_link) if k.pp > 1 else 0.0
    per_mb = fwd + bwd + tp + cp + ep + p2p
    m, p = k.num_microbatches, k.pp
    t.compute, t.tp_exposed, t.cp_exposed, t.pp_p2p = m * (fwd + bwd), m * tp, m * cp, m * p2p
    t.ep_exposed = m * ep
    t.bubble = pipeline_bubble(k, per_mb, bwd)
    t.dp_exposed, buckets = data_parallel_seconds(k, w, dp_link, stage_params=stage_params,
                                                  expert_params=expert_params, backward=m * bwd)
    moe_tensors = 1 + 3 * c.num_experts // k.ep - 3 if c.use_moe else 0   # router + experts for the dense MLP
    tensors = buckets or layers * (11 + moe_tensors) + 2
    stepped = stage_params / (k.dp * k.cp) if k.zero else stage_params
    t.optimizer = hw.dispatched(stepped * ADAMW_ACCESSES * b / hw.memory_bandwidth,
                                OPS_PER_PARAM_STEP * tensors * hw.op_overhead_s)
    t.parts = dict(per_microbatch_ms=1e3 * per_mb, forward_ms=1e3 * fwd, backward_ms=1e3 * bwd)
    return t
