"""Numeric validation: a parallel layout against the dense single-device model.

Both models start from the same dense weights and see the same global batch. Compared: forward
logits and loss, the gradient of every parameter (each shard against the matching slice of the
dense gradient), and N AdamW steps (logits/loss every `log_interval` steps, every parameter at
the end). Each rank compares its own shards; the report takes the worst rank per item.

Under pipeline parallelism the dense model sees the whole global batch (M microbatches x
micro_batch_size x dp) in one forward; the pipeline runs its schedule over the M microbatches.
Each stage reports the gradients and parameters it holds; the loss and the logits exist only
on the last stage and are compared there.

Under context parallelism each CP rank feeds its tokens of the same rows (`data.batches.cp_tokens`)
and compares its logits with the same tokens of the dense logits (`ContextLayout.split` along the
sequence); the loss is the global one (summed over CP by the schedule).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from .config import MiniMindConfig, MoEAuxLoss, ParallelConfig
from .context_parallel import ContextLayout
from .data.batches import Batch, cp_tokens, dp_rows, random_batch, split_microbatches
from .data_parallel import unwrap, wrap_data_parallel
from .groups import ProcessGroups
from .loss_normalisation import equal_replicas_mean
from .model import MiniMindForCausalLM
from .pipeline_parallel import Schedule, forward_backward
from .plan import stage_of, tp_split_dim
from .training import build_parallel_model, finalize_grads, make_optimizer
from .zero.buckets import DEFAULT_BUCKET_MB
from .zero import DistributedOptimizer
from .zero.fully_shard import whole

# float32: 10x the dense model's own float32-vs-float64 error on the test configurations
# (scripts/tolerance_baseline.py: forward + grads max-abs 5.7e-7, relative-L2 2.2e-6; params
# after AdamW steps relative-L2 2.0e-4). A parallel layout only reorders sums: about 1-2x that.
DEFAULT_TOL = {  # (max-abs, relative-L2): an item fails only when it exceeds both
    torch.float64: (1e-9, 1e-9),
    torch.float32: (6e-6, 2e-5),
    torch.bfloat16: (5e-2, 5e-2),
    torch.float16: (1e-2, 1e-2),
}
# Parameters after AdamW steps, and the loss and logits of later steps, get a wider relative-L2
# bound below float64 (scripts/tolerance_baseline.py: the dense float32 model's own logits after
# 3 steps end 2.1e-4 from float64's, its parameters 2.0e-4): Adam's first update
# is lr * g / (|g| + eps) ~ lr * sign(g), so an element whose gradient is within round-off of
# zero can move by up to 2 lr on one side and not the other (the dense float32 model itself ends
# 2.0e-4 from float64, above). Forward values, losses and gradients keep the round-off bounds
# above; float64 shows the steps themselves are exact.
PARAM_RTOL = {torch.float64: 1e-9, torch.float32: 2e-3, torch.bfloat16: 1e-1, torch.float16: 5e-2}


@dataclass
class Row:
    item: str
    max_abs: float
    rel_l2: float
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.atol or self.rel_l2 <= self.rtol


def error(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    a, e = actual.detach().double(), expected.detach().double()
    diff = a - e
    return diff.abs().max().item(), (diff.norm() / e.norm().clamp(min=1e-30)).item()


def dense_slice(key: str, dense: torch.Tensor, par: ParallelConfig, tp_rank: int) -> torch.Tensor:
    dim = tp_split_dim(key, par)
    return dense if dim is None else dense.chunk(par.tp, dim=dim)[tp_rank]


def logits_slice(dense_logits, par: ParallelConfig, tp_rank: int):
    return dense_logits.chunk(par.tp, dim=-1)[tp_rank] if par.vocab_parallel else dense_logits


@dataclass(kw_only=True)
class _Pair:
    """The dense model and this rank's parallel model on the same global batch, stepped together."""
    dense: nn.Module
    model: nn.Module                 # this rank's stage (DDP-wrapped when DP runs without a pipeline)
    groups: ProcessGroups
    batch: Batch                     # the global batch [dp * M * b, S]
    mine: slice                      # this DP rank's rows of it
    layout: ContextLayout            # which tokens of each row this CP rank holds
    microbatches: list
    schedule: Schedule
    backward: bool
    atol: float
    rtol: float                      # step 0 (forward from the same weights) and the grads
    later_rtol: float                # the loss and logits after AdamW steps (see PARAM_RTOL)
    optimizer: object = None         # the parallel model's (under --zero it reduces the grads)

    def step(self, step: int, compare: bool) -> list[Row]:
        """Forward both (and backward, grads finalised); -> the loss and logits rows when compared
        (the last stage only)."""
        ref = self._dense_aux_loss(self.dense(self.batch.input_ids, targets=self.batch.targets))
        out = forward_backward(self.model, self.groups, self.microbatches, schedule=self.schedule,
                                 forward_only=not self.backward, collect_logits=compare)
        rows = self._output_rows(step, out, ref) if compare and out.loss is not None else []
        if self.backward:
            ref.objective.backward()                                    # the LM loss (+ the MoE aux loss)
            finalize_grads(self.model, self.groups, self.optimizer)
        return rows

    def _dense_aux_loss(self, ref):
        """The dense model's output with the MoE aux loss over the tokens the layout's aux loss
        counts: each microbatch of the global batch (every replica's rows of it; MiniMind's
        gradient accumulation: the mean over the M microbatches), or with --moe_aux_loss local
        each replica's rows of it (the mean over replicas too). One microbatch, global: the
        whole batch's, as computed."""
        m, par = len(self.microbatches), self.groups.par
        local = par.moe_aux_loss == MoEAuxLoss.LOCAL and par.dp > 1
        if ref.aux_loss is None or (m == 1 and not local):
            return ref
        b = self.microbatches[0][0].shape[0]                            # rows per microbatch of a replica
        parts = [[range(d * m * b + i * b, d * m * b + (i + 1) * b) for d in range(par.dp)] for i in range(m)]
        if local:
            parts = [[rows] for microbatch in parts for rows in microbatch]
        aux = [self.dense(self.batch.input_ids[idx], targets=self.batch.targets[idx]).aux_loss
               for idx in (torch.tensor([r for rows in part for r in rows]) for part in parts)]
        return replace(ref, aux_loss=torch.stack(aux).mean())

    def _output_rows(self, step: int, out, ref) -> list[Row]:
        par = self.groups.par
        loss = equal_replicas_mean(out.loss.clone(), self.groups)     # the global batch's loss
        rtol = self.rtol if step == 0 else self.later_rtol
        rows = [Row(f"step {step} loss", *error(loss, ref.loss), self.atol, rtol)]
        if ref.aux_loss is not None:
            aux = equal_replicas_mean(out.aux_loss.clone(), self.groups)
            rows.append(Row(f"step {step} aux loss", *error(aux, ref.aux_loss), self.atol, rtol))
        if not out.logits:   # --loss_chunks: the logits never exist whole (loss and grads still compared)
            return rows
        logits = torch.cat(out.logits)                                  # [M*b, S, V(/T)]
        want = ref.logits[self.mine]                                    # [M*b, S, V]
        if par.cp > 1:
            want = self.layout.split(want, self.groups.cp_rank, dim=1)  # -> [M*b, S/C, V]
        want = logits_slice(want, par, self.groups.tp_rank)
        return rows + [Row(f"step {step} logits", *error(logits, want), self.atol, rtol)]

    def grad_rows(self, rtol: float) -> list[Row]:
        """One row per parameter: its grad against the same slice of the dense grad; under --zero
        the part of it this rank owns (the other ranks' rows cover the rest: worst over ranks)."""
        if not isinstance(self.optimizer, DistributedOptimizer):
            return self.shard_rows("grad {name}", lambda p: p.grad, rtol)
        dense = dict(self.dense.named_parameters(remove_duplicate=False))
        par, tp_rank = self.groups.par, self.groups.tp_rank
        rows = []
        for buffer in self.optimizer.buffers:
            for piece, i in buffer.pieces():
                mine = buffer.mains[i].grad[piece.shard_offset:piece.shard_offset + piece.numel]
                want = dense_slice(piece.name, dense[piece.name].grad, par, tp_rank).reshape(-1)[piece.lo:piece.hi]
                rows.append(Row(f"grad {piece.name}", *error(mine, want), self.atol, rtol))
        return rows

    def shard_rows(self, item: str, of, rtol: float) -> list[Row]:
        """One row per parameter: `of(param)` of each shard against the same slice of the dense
        model's; `item` is formatted with the parameter's name."""
        # Tied names both map to the one dense Parameter (a pipeline holds them on two stages).
        dense = dict(self.dense.named_parameters(remove_duplicate=False))
        par, tp_rank = self.groups.par, self.groups.tp_rank
        return [Row(item.format(name=name), *error(whole(of(p)), dense_slice(name, of(dense[name]), par, tp_rank)),
                    self.atol, rtol)
                for name, p in unwrap(self.model).named_parameters()]


def compare_with_dense(config: MiniMindConfig, par: ParallelConfig, groups: ProcessGroups, *, seq_len: int,
                       micro_batch_size: int, num_microbatches: int = 1, pp_schedule: Schedule = Schedule.ONE_F_ONE_B,
                       dtype=torch.float32, lr: float = 1e-3, optimizer_steps: int = 3, log_interval: int = 1,
                       check_backward: bool = True, seed: int = 1234, device="cpu", perturb: str | None = None,
                       atol: float | None = None, rtol: float | None = None,
                       initial_state: dict | None = None, bucket_size_mb: float = DEFAULT_BUCKET_MB) -> list[Row]:
    """Rows of (item, max-abs error, relative-L2 error, tolerances), worst over all ranks. Both models
    start from `initial_state` (a dense state dict, loaded strictly) when given, else a seeded init.
    Under --zero (`par.zero`) the parallel model steps with the distributed optimizer (buckets of
    `bucket_size_mb` MiB) and each rank compares the grads of the slices it owns."""
    atol = DEFAULT_TOL[dtype][0] if atol is None else atol
    rtol = DEFAULT_TOL[dtype][1] if rtol is None else rtol
    torch.manual_seed(seed)
    dense = MiniMindForCausalLM(config)
    if initial_state is not None:
        dense.load_state_dict(initial_state, strict=True)
    dense = dense.to(device=device, dtype=dtype)
    model = build_parallel_model(config, par, groups, dense.state_dict(), dtype=dtype, device=device)
    if perturb is not None:
        _perturb(model, perturb, config, groups)
    local = micro_batch_size * num_microbatches                     # rows of this DP rank
    batch = random_batch(seed + 1, local * par.dp, seq_len, config.vocab_size, device)
    layout = ContextLayout.of(par, seq_len)
    rows = cp_tokens(dp_rows(batch, groups.dp_rank, par.dp), layout, groups.cp_rank)   # [M*b, S/C]
    pair = _Pair(dense=dense, model=wrap_data_parallel(model, groups), groups=groups, batch=batch,
                 mine=slice(groups.dp_rank * local, (groups.dp_rank + 1) * local), layout=layout,
                 microbatches=split_microbatches(*rows, num_microbatches),
                 schedule=pp_schedule, backward=check_backward or optimizer_steps > 0, atol=atol, rtol=rtol,
                 later_rtol=max(rtol, PARAM_RTOL[dtype]))
    opt_dense = make_optimizer(dense, lr)
    opt_par = pair.optimizer = make_optimizer(pair.model, lr, groups, bucket_size_mb, pp_schedule)
    rows = pair.step(0, compare=True)
    if check_backward:
        rows += pair.grad_rows(rtol)
    for step in range(1, optimizer_steps + 1):
        opt_dense.step(), opt_par.step()
        opt_dense.zero_grad(set_to_none=True), opt_par.zero_grad(set_to_none=True)
        rows += pair.step(step, compare=step % log_interval == 0 or step == optimizer_steps)
    if optimizer_steps > 0:
        rows += pair.shard_rows(f"param {{name}} after {optimizer_steps} steps", lambda p: p,
                                max(rtol, PARAM_RTOL[dtype]))
    return worst_over_ranks(rows, device)


def _perturb(model: nn.Module, name: str, config: MiniMindConfig, groups: ProcessGroups) -> None:
    """Add 1e-2 to TP rank 0's shard of parameter `name` on the stage that holds it (shows the
    checker fails)."""
    if groups.tp_rank == 0 and stage_of(name, config.num_hidden_layers, groups.par.pp, groups.par.virtual_stages) == groups.pp_rank:
        with torch.no_grad():
            dict(model.named_parameters())[name].add_(1e-2)


def worst_over_ranks(rows: list[Row], device=None) -> list[Row]:
    """Merge every rank's rows by item, keeping the largest errors. Ranks may hold different items
    (pipeline stages hold different parameters; only the last has the loss): items are ordered by
    phase (step 0, grads, later steps, params), then as first seen in rank order (stage order)."""
    if not dist.is_initialized():
        return rows
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [(r.item, r.max_abs, r.rel_l2, r.atol, r.rtol) for r in rows])
    merged: dict[str, Row] = {}
    for rank_rows in every:
        for item, max_abs, rel_l2, a, r in rank_rows:
            old = merged.get(item)
            merged[item] = Row(item, _worst(max_abs, old.max_abs) if old else max_abs,
                               _worst(rel_l2, old.rel_l2) if old else rel_l2, a, r)
    return sorted(merged.values(), key=lambda row: _phase(row.item))


def _worst(a: float, b: float) -> float:
    """The larger error; NaN counts as the worst."""
    return a if (a != a or a >= b) else b


def _phase(item: str) -> float:
    """step 0 -> 0, grads -> 1, step k -> k + 1, params last."""
    kind, _, rest = item.partition(" ")
    if kind == "step":
        k = int(rest.split()[0])
        return 0 if k == 0 else k + 1
    return 1 if kind == "grad" else float("inf")


def failures(rows: list[Row]) -> list[Row]:
    return [r for r in rows if not r.ok]


def format_report(rows: list[Row]) -> str:
    width = max(len(r.item) for r in rows)
    lines = [f"{'item':<{width}}  {'max_abs':>10}  {'rel_l2':>10}  {'atol':>8}  {'rtol':>8}  ok",
             "-" * (width + 50)]
    for r in rows:
        lines.append(f"{r.item:<{width}}  {r.max_abs:10.3e}  {r.rel_l2:10.3e}  {r.atol:8.1e}  {r.rtol:8.1e}  "
                     f"{'yes' if r.ok else 'NO'}")
    return "\n".join(lines)
