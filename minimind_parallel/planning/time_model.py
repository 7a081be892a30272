"""`step_time`: the predicted time of one optimizer step of a layout, from a few stated rates
(`Hardware`). Every piece is one line of arithmetic (docs/planning.md states them):

    compute      GEMM FLOPs / gemm_flops + causal attention FLOPs / attention_flops (with CP:
                 the busiest rank's chunk pairs, blockwise, / its own rate) + the block's counted
                 memory-bound bytes (BLOCK_TRAFFIC) / memory_bandwidth, and the dispatched ops x
                 op_overhead_s: on a GPU the host runs ahead of the kernels (the longer of the
                 two), on a CPU they add up; per microbatch per stage; GEMMs and attention
                 backward = 2 x forward; --recompute full re-runs every block's forward (and its
                 TP / CP collectives), selective its norms' and SwiGLU's traffic
    tensor       per block: the row-parallel outputs' all-reduce (reduce-scatter under SP) and the
                 column-parallel inputs' copy / all-gather (one per linear, one per region with
                 --shared_sp_gather), forward and backward; --async_communication overlaps the
                 backward's with the weight-grad GEMM (and re-gathers the input under SP); outside
                 the blocks the embedding's and the head's (--vocab_parallel, SP) and the vocab-
                 parallel loss's three [tokens] all-reduces per loss chunk, and once a step the TP-
                 partial grads' all-reduce; --recompute full re-runs each block's forward collectives
                 but its last (the MLP's row-parallel reduce: torch.utils.checkpoint stops early)
    context      all_gather: K/V gathered forward, their grads reduce-scattered backward; a2a: two
                 all-to-alls each way (q, k, v together; the output); the loss normalisation's two
                 scalars once a step; ring: cp - 1 K/V block passes forward, cp - 1 and cp dK/dV
                 passes backward, each overlapped with one block of attention (on a GPU); the
                 attention itself blockwise (matmuls and an explicit softmax per chunk pair)
    pipeline     M microbatches and the bubble of the schedule: (P - 1) x the slowest stage's microbatch
                 (GPipe and 1F1B); divided by V with V model chunks per stage (interleaved, Narayanan et
                 al. 2021), whose boundaries each send the activation V times; (P - 1) x its forward
                 and communication and what its B outlasts its W (ZB-H1, Qi et al. 2023: (P - 1)
                 (T_F + max(T_B - T_W, 0)), the zb orders simulated at those times): W the weight-grad
                 GEMMs of the linears that defer them (`weight_step_seconds`: attention's, the dense
                 SwiGLU's, the head's), B the rest of the backward (an MoE layer's router and
                 experts keep theirs in B); each boundary's activation sent forward and its grad back
    experts      (--use_moe) the router's GEMM and the experts' at the routed token count, N k rows
                 per rank under balanced routing (whole on every TP rank; under SP each TP rank routes
                 its shard); under EP per MoE layer the count exchange and the tokens' all-to-all
                 out and back, forward and backward (none overlapped), and the aux statistics'
                 all-reduce over dp x cp
    data         the stage's gradients all-reduced over dp x cp (an expert's over its EDP group,
                 dp x cp / ep): under DDP (pp = 1) overlapped with the backward, under a pipeline
                 after it; --zero 1 (the distributed optimizer) instead reduce-scatters each bucket
                 after the last microbatch and all-gathers it after the step, both exposed;
                 --zero 2 reduce-scatters while backward runs (hidden behind it as DDP's, pp = 1);
                 --zero 3 (FSDP2) gathers every block's parameters for its forward and its
                 backward and reduce-scatters its grads, per microbatch (under a pipeline a stage
                 gathers each once per step and reduce-scatters each once after the schedule), each
                 collective with FSDP2's host work around it (hooks, copy-in, copy-out) at
                 `fsdp_collective_s`
    overlaps     only where `Hardware.overlaps_communication` (a GPU's streams); on a CPU gloo runs
                 on the rank's own cores and every collective adds to the step
    optimizer    AdamW's per-element traffic over this rank's parameters (under --zero its slice,
                 one tensor per bucket)

A collective of `n` bytes over `g` ranks on a link (latency a, bandwidth w, per-call cost c):
all-reduce c + 2 (g-1) (a + n / (g w)), all-gather / reduce-scatter / all-to-all
c + (g-1) (a + n / (g w)), a p2p send c + a + n / w. c is what a call costs inside a step beyond
the same call back to back (`Link.call_s`: a CPU's gloo, fitted by plan --calibrate to real steps,
step_costs.py; 0 on GPUs).
`collectives_of_step` lists a step's collectives as costed (tests/test_collective_counts.py checks
them against the real calls). Which link: a group whose ranks span more than one
node's (the grid dp x pp x cp x tp, TP fastest) crosses nodes.
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field
from operator import attrgetter

from ..config import DTYPES, Choice, CPCommType, MiniMindConfig, Recompute
from ..pipeline_parallel.order import Schedule
from ..zero.buckets import DEFAULT_BUCKET_MB
from .hardware import Hardware, Link
from .space import Candidate, Workload

# Dispatched aten ops of one block's forward and backward together, and per parameter tensor of
# AdamW's step (foreach off), counted under a TorchDispatchMode on the book's block (H 768).
OPS_PER_BLOCK = 340
OPS_PER_PARAM_STEP = 10
# The memory-bound traffic (elementwise ops, reductions, copies: each op's tensor inputs and outputs)
# of one MiniMind block, counted by `op_count.OpCount` on the block in float32, in elements per token
# by the width each op streams: the hidden state (norms, residuals), the MLP's (SiLU and the gate
# product), the query and key/value projections' (their norms, RoPE, the attention layout's copies),
# GQA's repeat of k and v to every query head (when kv heads < heads), the head dim (RoPE's tables),
# per head (the q/k norms' statistics), per token; and per block, the norms' weights (hidden and
# head dim wide). Forward, backward.
BLOCK_TRAFFIC = (dict(hidden=20, inter=5, q=17, gqa=4, kv=17, head_dim=4, heads=6, kv_heads=6, token=12),
                 dict(hidden=65, inter=9, q=36, gqa=4, kv=40, head_dim=4, heads=9, kv_heads=9, token=18))
BLOCK_WEIGHT_TRAFFIC = (dict(hidden=2, head_dim=2), dict(hidden=4, head_dim=4))
# A zero-bubble W step's dispatched ops per deferred linear (deferred_wgrad.py: two reshapes, the
# transpose and the GEMM), counted by `OpCount` on the block's W step.
OPS_PER_DEFERRED_WGRAD = 4
# CP's blockwise attention: dispatched ops per visible chunk pair, forward and backward together
# (431 counted at cp 2 over the 5 pairs of a load-balanced rank: scores, mask, log-sum-exp, merge).
OPS_PER_CHUNK_PAIR = 86
# AdamW's memory accesses per element (foreach off: its lerp_, mul_, addcmul_, sqrt, div, add_,
# addcdiv_ and the weight decay's mul_), counted by `OpCount`.
ADAMW_ACCESSES = 21


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
            return link.call_s + link.latency_s + self.nbytes / link.bandwidth
        if g <= 1:
            return 0.0
        steps = 2 * (g - 1) if self.kind == Op.ALL_REDUCE else g - 1
        return link.call_s + steps * (link.latency_s + self.nbytes / (g * link.bandwidth))


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


def causal_attention_flops(rows: float, seq: int, q_width: float) -> float:
    """Fused causal attention's forward FLOPs over `rows` whole sequences: QK^T and PV (2 x 2 S^2 per
    query dim each), half of them under the causal mask."""
    return 2 * rows * seq * seq * q_width


def chunk_pairs(cp: int, load_balance: bool) -> tuple[int, float]:
    """CP's blockwise attention on its busiest rank: (visible chunk pairs, chunk length as a share of
    the sequence). Load-balanced: 2C chunks of S/(2C), rank i holding i and 2C-1-i, which see i + 1 and
    2C - i chunks (2C + 1 pairs on every rank); contiguous: C chunks of S/C, the last rank's seeing C."""
    return (2 * cp + 1, 1 / (2 * cp)) if load_balance else (cp, 1 / cp)


def blockwise_attention_flops(rows: float, seq: int, q_width: float, *, cp: int, load_balance: bool) -> float:
    """The forward FLOPs of CP's blockwise attention on its busiest rank: every visible chunk pair's
    QK^T and PV in full (a diagonal pair is masked, not skipped), 2 x 2 L^2 per query dim each."""
    pairs, share = chunk_pairs(cp, load_balance)
    chunk = seq * share
    return pairs * 4 * rows * chunk * chunk * q_width


def block_traffic(c: MiniMindConfig, tokens: float, *, tp: int, sequence_parallel: bool) -> tuple[float, float]:
    """Elements the memory-bound ops of one block read and write, (forward, backward), for `tokens`
    tokens on a rank (BLOCK_TRAFFIC): under TP the projections' and the MLP's widths are split, and the
    hidden state's ops run on a T-th of the tokens under SP (replicated without)."""
    moe_inter = c.num_experts_per_tok * c.moe_intermediate_size if c.use_moe else c.intermediate_size
    gqa = c.num_attention_heads * c.head_dim / tp if c.num_key_value_heads < c.num_attention_heads else 0
    width = dict(hidden=c.hidden_size, inter=moe_inter / tp, q=c.num_attention_heads * c.head_dim / tp, gqa=gqa,
                 kv=c.num_key_value_heads * c.head_dim / tp, head_dim=c.head_dim, heads=c.num_attention_heads / tp,
                 kv_heads=c.num_key_value_heads / tp, token=1)
    sharded = tokens / tp if sequence_parallel else tokens

    def elements(per_token: dict, weights: dict) -> float:
        split = sum(n * width[k] for k, n in per_token.items() if k not in ("hidden", "token"))
        whole = per_token["hidden"] * width["hidden"] + per_token["token"]
        return tokens * split + sharded * whole + sum(n * width[k] for k, n in weights.items())

    return tuple(elements(t, w) for t, w in zip(BLOCK_TRAFFIC, BLOCK_WEIGHT_TRAFFIC))


def selective_traffic(c: MiniMindConfig, tokens: float, *, tp: int, sequence_parallel: bool) -> float:
    """Elements `--recompute selective` re-reads and re-writes in backward: the forward's hidden-state
    (norms) and MLP-wide (SwiGLU) traffic."""
    moe_inter = c.num_experts_per_tok * c.moe_intermediate_size if c.use_moe else c.intermediate_size
    fwd = BLOCK_TRAFFIC[0]
    return (tokens / tp if sequence_parallel else tokens) * fwd["hidden"] * c.hidden_size + tokens * fwd["inter"] * moe_inter / tp


def attention_seconds(c: MiniMindConfig, k: Candidate, w: Workload, hw: Hardware) -> tuple[float, float]:
    """One block's attention on one rank, (work, dispatch) seconds of its forward and backward together:
    fused causal SDPA without CP, CP's blockwise attention (its chunk pairs' matmuls and explicit
    softmax, at its own calibrated rate, and their ops) with it."""
    q = c.num_attention_heads * c.head_dim / k.tp
    rows = k.micro_batch_size
    if k.cp == 1:
        return 3 * causal_attention_flops(rows, w.seq_len, q) / hw.attention_flops, 0.0
    flops = blockwise_attention_flops(rows, w.seq_len, q, cp=k.cp, load_balance=k.cp_load_balance)
    pairs, _ = chunk_pairs(k.cp, k.cp_load_balance)
    return 3 * flops / hw.blockwise_rate, pairs * OPS_PER_CHUNK_PAIR * hw.op_overhead_s


def stage_compute(c: MiniMindConfig, k: Candidate, w: Workload, hw: Hardware, *, last: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch on one rank of a stage (the last one adds the head)."""
    layers = c.num_hidden_layers // k.pp
    tokens = k.micro_batch_size * w.seq_len / k.cp                       # this rank's tokens
    gemm = 2 * tokens * block_matmul_params(c) / k.tp + moe_forward_flops(c, k, w)   # forward FLOPs of one block
    attention, attention_ops = attention_seconds(c, k, w, hw)
    b = DTYPES[w.dtype].itemsize
    fwd_traffic, bwd_traffic = (n * b / hw.memory_bandwidth
                                for n in block_traffic(c, tokens, tp=k.tp, sequence_parallel=k.sequence_parallel))
    fwd_block = gemm / hw.gemm_flops + attention / 3 + fwd_traffic
    bwd_block = 2 * gemm / hw.gemm_flops + 2 * attention / 3 + bwd_traffic
    ops = OPS_PER_BLOCK * hw.op_overhead_s + attention_ops
    fwd, bwd = layers * hw.dispatched(fwd_block, ops / 3), layers * hw.dispatched(bwd_block, 2 * ops / 3)
    if k.recompute == Recompute.FULL:
        bwd += layers * hw.dispatched(fwd_block, ops / 3)
    elif k.recompute == Recompute.SELECTIVE:       # the norms and SwiGLU re-made: their forward traffic
        bwd += layers * selective_traffic(c, tokens, tp=k.tp, sequence_parallel=k.sequence_parallel) * b \
            / hw.memory_bandwidth
    if last:
        vocab = c.vocab_size / k.tp if k.vocab_parallel else c.vocab_size
        head = 2 * tokens * c.hidden_size * vocab / hw.gemm_flops + 4 * tokens * vocab * 4 / hw.memory_bandwidth
        fwd, bwd = fwd + head, bwd + 2 * head
    return fwd, bwd


def deferred_linears(c: MiniMindConfig, k) -> tuple[int, float]:
    """One block's linears whose weight grads a zero-bubble W step computes on one TP rank
    (tensor_parallel/deferred_wgrad.py), (how many, their parameters): attention's q, k, v and o and
    the dense SwiGLU's gate and up, its down_proj too without the lean SwiGLU (--recompute selective
    and full fuse it into a Function whose backward keeps its weight grad). An MoE layer's router and
    experts are whole nn.Linears: their weight grads stay in B."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    count, params = 4, c.hidden_size * (2 * q + 2 * kv)
    if not c.use_moe:
        mlp = 3 if k.recompute == Recompute.NONE else 2
        count, params = count + mlp, params + mlp * c.hidden_size * c.intermediate_size
    return count, params / k.tp


def weight_step_seconds(c: MiniMindConfig, k, w: Workload, hw: Hardware, *, last: bool) -> float:
    """Seconds of one microbatch's W step on one rank of a stage under zb: the deferred linears'
    weight-grad GEMMs (dY^T X, the forward's FLOPs of each) and their ops; the last stage's head
    too, unless the chunked loss (--loss_chunks > 1) keeps its weight grad in B."""
    layers = c.num_hidden_layers // k.pp
    tokens = k.micro_batch_size * w.seq_len / k.cp
    count, params = deferred_linears(c, k)
    flops, linears = layers * 2 * tokens * params, layers * count
    if last and k.loss_chunks == 1:
        vocab = c.vocab_size / k.tp if k.vocab_parallel else c.vocab_size
        flops, linears = flops + 2 * tokens * c.hidden_size * vocab, linears + 1
    return hw.dispatched(flops / hw.gemm_flops, linears * OPS_PER_DEFERRED_WGRAD * hw.op_overhead_s)


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


def recomputed_forward(tensor_fwd: list, context_fwd: list) -> list:
    """The forward collectives `--recompute full` runs again in backward: every one of the block but
    its last, the MLP's row-parallel reduce, whose output no op of the block saves
    (torch.utils.checkpoint stops the re-run once every saved tensor is made again)."""
    return tensor_fwd[:-1] + context_fwd


def head_collectives(c: MiniMindConfig, k: Candidate, w: Workload) -> tuple[list, list]:
    """The TP collectives outside the blocks of one microbatch on the last stage (its embedding too at
    pp 1): (forward, backward). --vocab_parallel: the embedding's partial rows all-reduced (reduce-
    scattered under SP), the head's column input copied in (gathered under SP), and the loss's three
    all-reduces of [tokens] (max, target logit, sum of exps; float32 at least) per loss chunk; SP
    alone: the embedding's output split (its grad gathered) and the final norm's output gathered for
    the replicated head."""
    if k.tp == 1:
        return [], []
    b = DTYPES[w.dtype].itemsize
    tokens = k.micro_batch_size * w.seq_len / k.cp
    n = tokens * c.hidden_size * b
    gather, scatter, reduce = (Collective(op, n, k.tp) for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE))
    sp, fwd, bwd = k.sequence_parallel, [], []
    if k.pp == 1 and k.vocab_parallel:
        fwd, bwd = ([scatter], [gather]) if sp else ([reduce], [])
    elif k.pp == 1 and sp:
        bwd = [gather]
    if k.vocab_parallel:
        fwd, bwd = fwd + ([gather] if sp else []), bwd + [scatter if sp else reduce]
        fwd += [Collective(Op.ALL_REDUCE, tokens / k.loss_chunks * max(b, 4), k.tp)] * (3 * k.loss_chunks)
    elif sp:
        fwd = fwd + [gather]
    return fwd, bwd


def step_collectives(c: MiniMindConfig, k: Candidate, w: Workload) -> tuple[list, list, list]:
    """The collectives of a step outside its microbatches on the last stage, (tensor, context,
    pipeline): under TP the grads of the parameters each rank holds whole but sees a part of (the q/k
    norms on its heads; under SP the norms on its tokens too) all-reduced in one buffer; under CP the
    loss normalisation's two scalars (the targets' count, the replica's loss); under PP the tied
    embedding's grad summed with the first stage's copy."""
    b = DTYPES[w.dtype].itemsize
    layers = c.num_hidden_layers // k.pp
    tensor, context, pipeline = [], [], []
    if k.tp > 1:
        partial = layers * 2 * c.head_dim + ((2 * layers + 1) * c.hidden_size if k.sequence_parallel else 0)
        tensor = [Collective(Op.ALL_REDUCE, partial * b, k.tp)]
    if k.cp > 1:
        context = [Collective(Op.ALL_REDUCE, 4, k.cp)] * 2
    if k.pp > 1 and c.tie_word_embeddings:
        vocab = c.vocab_size / k.tp if k.vocab_parallel else c.vocab_size
        pipeline = [Collective(Op.ALL_REDUCE, vocab * c.hidden_size * b, 2)]
    return tensor, context, pipeline


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
    if k.cp_comm_type == CPCommType.A2A:   # q, k, v to heads in one all-to-all, the output back in another
        each = [Collective(Op.ALL_TO_ALL, q + kv, k.cp), Collective(Op.ALL_TO_ALL, q, k.cp)]
        return each, each
    # ring (context_parallel/ring.py): forward C - 1 K/V passes; backward C - 1 K/V passes and C passes
    # of the dK/dV accumulators (home after C steps), each the K/V's size
    return [Collective(Op.P2P, kv, 2)] * (k.cp - 1), [Collective(Op.P2P, kv, 2)] * (2 * k.cp - 1)


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


def collectives_of_step(k: Candidate, w: Workload, *, stage_params: int) -> list[Collective]:
    """Every collective one rank of the last stage issues in a step of layout `k`, as the time model
    costs them (dense model; DDP's grads in one bucket, ZeRO's in its buckets): the counts a test
    compares with the real calls (profiling.collectives.CollectiveLog)."""
    c, b, m = w.model, DTYPES[w.dtype].itemsize, k.num_microbatches
    layers = c.num_hidden_layers // k.pp
    tf, to, tr = tensor_collectives(c, k, w)
    cf, cb = context_collectives(c, k, w)
    again = recomputed_forward(tf, cf) if k.recompute == Recompute.FULL else []
    hf, hb = head_collectives(c, k, w)
    act = k.micro_batch_size * w.seq_len / k.cp * c.hidden_size * b / (k.tp if k.sequence_parallel else 1)
    p2p = [Collective(Op.P2P, act, 2)] * (2 * k.virtual_stages) if k.pp > 1 else []
    per_mb = layers * (tf + to + tr + cf + cb + again) + hf + hb + p2p
    st, sc, sp = step_collectives(c, k, w)
    g = k.dp * k.cp
    if k.zero == 0:
        grads = [Collective(Op.ALL_REDUCE, stage_params * b, g)]
    else:
        buckets = max(1, -(-stage_params * b // int(DEFAULT_BUCKET_MB * 2**20)))
        each = stage_params * b / buckets
        grads = [Collective(Op.REDUCE_SCATTER, each, g), Collective(Op.ALL_GATHER, each, g)] * buckets
    return [x for x in m * per_mb + st + sc + sp + grads if x.nbytes > 0 and (x.ranks > 1 or x.kind == Op.P2P)]


def data_parallel_seconds(k: Candidate, w: Workload, hw: Hardware, link: Link, *, stage_params: int,
                          expert_params: int, forward: float, backward: float, layers: int,
                          block_params: int = 0) -> tuple[float, int]:
    """The exposed seconds of the grads' reduction (and under --zero the parameters' all-gather), and
    the tensors AdamW steps on this rank under --zero 1/2 (its buckets' slices; 0: the parameters).
    `forward` / `backward`: the step's compute they can hide behind (on a GPU)."""
    b = DTYPES[w.dtype].itemsize
    dense = stage_params - expert_params
    g = k.dp * k.cp
    if k.zero == 0:
        grads = (Collective(Op.ALL_REDUCE, dense * b, g).seconds(link)       # the experts' over EDP
                 + Collective(Op.ALL_REDUCE, expert_params * b, g // k.ep).seconds(link))
        return (hw.hidden(grads, backward) if k.pp == 1 else grads), 0
    if k.zero == 3:
        return fully_sharded_seconds(k, hw, link, stage_bytes=stage_params * b, forward=forward, backward=backward,
                                     layers=layers, block_bytes=block_params * b, expert_bytes=expert_params * b), 0
    # the distributed optimizer: buckets of DEFAULT_BUCKET_MB over dp x cp; --zero 1 reduce-scatters
    # them after backward, --zero 2 while backward runs (hidden behind it as DDP's all-reduce is)
    buckets = max(1, -(-stage_params * b // int(DEFAULT_BUCKET_MB * 2**20)))
    each = stage_params * b / buckets
    scatter = buckets * Collective(Op.REDUCE_SCATTER, each, g).seconds(link)
    gather = buckets * Collective(Op.ALL_GATHER, each, g).seconds(link)
    if k.zero == 2 and k.pp == 1:
        scatter = hw.hidden(scatter, backward)
    return scatter + gather, buckets


def fully_sharded_seconds(k: Candidate, hw: Hardware, link: Link, *, stage_bytes: float, forward: float,
                          backward: float, layers: int, block_bytes: float = 0, expert_bytes: float = 0) -> float:
    """--zero 3 (FSDP2, zero/fully_shard.py): every block and the root are their own unit; per
    microbatch each block's parameters are all-gathered before its forward and again before its
    backward, and its grads reduce-scattered in backward; the root's gathered once (not resharded
    after forward) and its grads reduce-scattered. Over dp x cp; `stage_bytes` the rank's parameters
    unsharded (what the gathers output), `block_bytes` one block's (0: the units' bytes taken equal,
    `stage_bytes` / (layers + 1)), the root the rest. FSDP2 prefetches the next unit's gather on a GPU (hidden behind
    the forward / backward compute); on a CPU every one is exposed. Under expert parallelism each
    block's experts (`expert_bytes`: this rank's, every layer's) are a unit of their own over the
    dp x cp / ep EDP ranks, gathered and reduce-scattered as a block is; over one EDP rank (ep =
    dp x cp) they stay whole, outside FSDP2, with no collective (their EDP group is the rank). Under
    PP (reshard_after_forward False, `reduced_after_the_schedule`) each unit is gathered once per
    step, in the stage's first forward (hidden behind that microbatch's forward on a GPU), and
    reduce-scattered once after the last backward (exposed: no compute is left to hide it behind); a
    middle stage's root holds none.
    And FSDP2's host work per collective (`fsdp_host_seconds`)."""
    g = k.dp * k.cp
    block = block_bytes or stage_bytes / (layers + 1)
    root = stage_bytes - layers * block
    experts = expert_bytes / max(layers, 1) if k.ep > 1 else 0.0   # one block's, out of its unit
    block -= experts
    gather, scatter = ({n: Collective(op, n, g).seconds(link) if n > 0 else 0.0 for n in (block, root)}
                       for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER))
    edp = g // k.ep
    own = [Collective(op, experts, edp).seconds(link) for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER)]
    m = k.num_microbatches
    host = fsdp_host_seconds(k, hw, layers=layers, root=root > 0, experts=experts > 0 and edp > 1)
    if k.pp > 1:   # the stage gathered once, in its first forward; every unit reduce-scattered after the schedule
        return (hw.hidden(layers * (gather[block] + own[0]) + gather[root], forward / m)
                + layers * (scatter[block] + own[1]) + scatter[root] + host)
    fwd = m * (layers * (gather[block] + own[0]) + gather[root])
    bwd = m * (layers * (gather[block] + own[0]) + layers * (scatter[block] + own[1]) + scatter[root])
    return hw.hidden(fwd, forward) + hw.hidden(bwd, backward) + host


def fsdp_collectives_per_microbatch(layers: int) -> int:
    """FSDP2's collectives of one microbatch (pp 1): each block gathered for its forward and again for
    its backward and its grads reduce-scattered, the root gathered once and reduce-scattered."""
    return 3 * layers + 2


def fsdp_host_seconds(k: Candidate, hw: Hardware, *, layers: int, root: bool = True, experts: bool = False) -> float:
    """FSDP2's host work around each of its collectives (its pre-/post-forward and backward hooks, the
    copy into the flat buffer, the copy out into the parameters' views, the DTensor bookkeeping), at
    `Hardware.fsdp_collective_s` per collective: on the rank's own thread, never hidden. At pp 1
    `fsdp_collectives_per_microbatch` per microbatch, and each block's experts' group (`experts`:
    sharded over more than one EDP rank) gathered twice and scattered once more; under PP each unit
    gathered once and reduce-scattered once a step (`root`: the stage holds the root's parameters; the
    experts' groups too)."""
    if k.pp > 1:
        return 2 * (layers + int(root) + (layers if experts else 0)) * hw.fsdp_collective_s
    per = fsdp_collectives_per_microbatch(layers) + (3 * layers if experts else 0)
    return k.num_microbatches * per * hw.fsdp_collective_s


def seconds(coll: list, link: Link) -> float:
    return sum(x.seconds(link) for x in coll)


def pipeline_bubble(k: Candidate, per_mb: float, bwd: float, weight: float = 0.0) -> float:
    """The idle time of the schedule's warm-up and cool-down, from one microbatch's time on a stage
    (`per_mb`, of which `bwd` its backward, and of that `weight` zb's W step): ZB-H1's
    (P - 1)(T_F + max(T_B - T_W, 0)), T_F the rest of the microbatch, T_B = bwd - T_W (what
    `order.simulate` gives the zb orders at those times)."""
    p = k.pp
    if k.pp_schedule == Schedule.INTERLEAVED:
        return (p - 1) * per_mb / k.virtual_stages
    if k.pp_schedule == Schedule.ZERO_BUBBLE:
        return (p - 1) * (per_mb - bwd + max(bwd - 2 * weight, 0.0))
    return (p - 1) * per_mb


# the fields of a layout that stage_compute reads: the layouts equal in them compute alike
COMPUTE_FIELDS = ("pp", "tp", "cp", "micro_batch_size", "sequence_parallel", "vocab_parallel", "recompute",
                  "cp_load_balance")


def last_stage_compute(k: Candidate, w: Workload, hw: Hardware, memo: dict | None) -> tuple[float, float]:
    """stage_compute of the last stage; with a `memo` (of one workload and hardware: the planner's)
    once per COMPUTE_FIELDS' values."""
    if memo is None:
        return stage_compute(w.model, k, w, hw, last=True)
    key = _COMPUTE_KEY(k)
    if key not in memo:
        memo[key] = stage_compute(w.model, k, w, hw, last=True)
    return memo[key]


# the fields of a layout that the per-microbatch communication (`microbatch_seconds`) reads, with
# stage_compute's: the layouts equal in them (a grid's zero levels, its microbatch counts and
# schedules) communicate alike in a microbatch
MICROBATCH_FIELDS = (*COMPUTE_FIELDS, "shared_sp_gather", "async_communication", "loss_chunks", "cp_comm_type", "ep",
                     "dp", "virtual_stages")
# what the remembered path hands microbatch_seconds: those fields alone (it cannot read another)
MicrobatchLayout = namedtuple("MicrobatchLayout", MICROBATCH_FIELDS)
# a layout's values of them, read at once (a tuple, in the fields' order)
_COMPUTE_KEY, _MICROBATCH_KEY = attrgetter(*COMPUTE_FIELDS), attrgetter(*MICROBATCH_FIELDS)


@dataclass(frozen=True)
class MicrobatchSeconds:
    """One microbatch's exposed communication on the last stage (tensor, context, expert, pipeline
    p2p), and the step's collectives outside the microbatches (tensor, context, pipeline)."""

    tp: float
    cp: float
    ep: float
    p2p: float
    step_tp: float
    step_cp: float
    step_pp: float


def microbatch_seconds(k, w: Workload, hw: Hardware, fwd: float, bwd: float) -> MicrobatchSeconds:
    """The per-microbatch and once-a-step collectives of layout `k` (a Candidate, or a
    MicrobatchLayout of its MICROBATCH_FIELDS), `fwd` / `bwd` one microbatch's compute on the stage."""
    c = w.model
    b = DTYPES[w.dtype].itemsize
    layers = c.num_hidden_layers // k.pp
    tp_link = hw.link(crosses_nodes(k.tp, w))
    cp_link = hw.link(crosses_nodes(k.tp * k.cp, w))
    pp_link = hw.link(crosses_nodes(k.tp * k.cp * k.pp, w))
    dp_link = hw.link(crosses_nodes(w.world_size, w))
    # tensor parallelism, per microbatch
    tf, to, tr = tensor_collectives(c, k, w)
    cf, cb = context_collectives(c, k, w)
    wgrad = bwd / 2 / max(layers, 1)                          # one block's weight-grad GEMMs
    overlap = seconds(to, tp_link)
    tp_bwd = hw.hidden(overlap, wgrad) if k.async_communication else overlap
    full = k.recompute == Recompute.FULL                      # full recompute re-runs the forward's collectives
    tp_again, cp_again = (recomputed_forward(tf, []), recomputed_forward([], cf)) if full else ([], [])
    hf, hb = head_collectives(c, k, w)
    tp = layers * (seconds(tf + tp_again, tp_link) + tp_bwd + seconds(tr, tp_link)) + seconds(hf + hb, tp_link)
    # context parallelism, per microbatch
    if k.cp > 1 and k.cp_comm_type == CPCommType.RING:
        attn_step = fwd / max(layers, 1) / k.cp / 3           # one K/V block's share of a block's attention
        cp = layers * sum(hw.hidden(x.seconds(cp_link), attn_step) for x in cf + cp_again + cb)
    else:
        cp = layers * seconds(cf + cp_again + cb, cp_link)
    # mixture of experts: the EP all-to-alls (over the DP link where the EP group leaves the CP one's)
    ef, eb = expert_collectives(c, k, w)
    ep_link = cp_link if k.ep <= k.cp else dp_link
    ep = layers * (seconds(ef, ep_link) + seconds(eb, ep_link))
    # pipeline: each boundary's activation [S/C(/T), B, H] forward, its grad backward
    act = k.micro_batch_size * w.seq_len / k.cp * c.hidden_size * b / (k.tp if k.sequence_parallel else 1)
    p2p = 2 * k.virtual_stages * Collective(Op.P2P, act, 2).seconds(pp_link) if k.pp > 1 else 0.0
    st, sc, sp = step_collectives(c, k, w)
    return MicrobatchSeconds(tp=tp, cp=cp, ep=ep, p2p=p2p, step_tp=seconds(st, tp_link), step_cp=seconds(sc, cp_link),
                             step_pp=seconds(sp, pp_link))


def microbatch_communication(k: Candidate, w: Workload, hw: Hardware, fwd: float, bwd: float,
                             memo: dict | None) -> MicrobatchSeconds:
    """microbatch_seconds; with a `memo` (of one workload and hardware: the planner's) once per
    MICROBATCH_FIELDS' values, computed from those fields alone (a MicrobatchLayout: reading any
    other is an AttributeError, not a wrong share)."""
    if memo is None:
        return microbatch_seconds(k, w, hw, fwd, bwd)
    values = _MICROBATCH_KEY(k)
    key = ("microbatch", values)
    if key not in memo:
        memo[key] = microbatch_seconds(MicrobatchLayout(*values), w, hw, fwd, bwd)
    return memo[key]


def step_time(k: Candidate, w: Workload, hw: Hardware, *, stage_params: int, expert_params: int = 0,
              block_params: int = 0, memo: dict | None = None) -> StepTime:
    """The predicted step of layout `k` (`stage_params`: parameter elements of the largest stage's rank,
    unsharded -- under --zero 3 too, what FSDP2's gathers output --, `expert_params` of them its
    experts', `block_params` one block's: --zero 3's gathers); `memo`: last_stage_compute's and
    microbatch_communication's, across one plan's layouts."""
    c = w.model
    b = DTYPES[w.dtype].itemsize
    layers = c.num_hidden_layers // k.pp
    fwd, bwd = last_stage_compute(k, w, hw, memo)   # (COMPUTE_FIELDS, within MICROBATCH_FIELDS: fwd, bwd follow)
    mb = microbatch_communication(k, w, hw, fwd, bwd, memo)
    t = StepTime()
    dp_link = hw.link(crosses_nodes(w.world_size, w))
    per_mb = fwd + bwd + mb.tp + mb.cp + mb.ep + mb.p2p
    m = k.num_microbatches
    t.compute, t.tp_exposed = m * (fwd + bwd), m * mb.tp + mb.step_tp
    t.cp_exposed, t.pp_p2p = m * mb.cp + mb.step_cp, m * mb.p2p + mb.step_pp
    t.ep_exposed = m * mb.ep
    zb = k.pp > 1 and k.pp_schedule == Schedule.ZERO_BUBBLE
    t.bubble = pipeline_bubble(k, per_mb, bwd, weight_step_seconds(c, k, w, hw, last=True) if zb else 0.0)
    t.dp_exposed, buckets = data_parallel_seconds(k, w, hw, dp_link, stage_params=stage_params,
                                                  expert_params=expert_params, forward=m * fwd, backward=m * bwd,
                                                  layers=layers, block_params=block_params)
    moe_tensors = 1 + 3 * c.num_experts // k.ep - 3 if c.use_moe else 0   # router + experts for the dense MLP
    tensors = buckets or layers * (11 + moe_tensors) + 2
    stepped = stage_params / (k.dp * k.cp) if k.zero else stage_params   # the rank's slice or shard
    if k.zero == 3 and k.ep > 1:   # the experts' shards over EDP (whole where it is one rank)
        stepped += expert_params / (k.dp * k.cp // k.ep) - expert_params / (k.dp * k.cp)
    t.optimizer = hw.dispatched(stepped * ADAMW_ACCESSES * b / hw.memory_bandwidth,
                                OPS_PER_PARAM_STEP * tensors * hw.op_overhead_s)
    t.parts = dict(per_microbatch_ms=1e3 * per_mb, forward_ms=1e3 * fwd, backward_ms=1e3 * bwd)
    return t
