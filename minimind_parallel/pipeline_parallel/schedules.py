"""Running a pipeline schedule over M microbatches: one executor of a stage's order of actions.

A schedule (GPipe, 1F1B; one stage: gradient accumulation) is the list of actions
`order.schedule_order` gives for this stage; `run_order` executes it. Each stage runs its order
on its own; the p2p calls line the stages up.

The loss of every
microbatch (a mean over its target tokens) is weighted by its share of this replica's target
tokens -- 1/M when all microbatches have as many; under CP by its share of every CP rank's --
so the accumulated grads and the reported loss are those of the mean over all target tokens of
the batch, exactly as the dense model averages; the backward runs on it times C under CP
(`loss_normalisation` says what each group sums and divides). DP, CP and tied-embedding grads
are reduced once, after the last microbatch, by `training.finalize_grads` (or DDP over DP x CP
without a pipeline).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..data_parallel import unwrap
from ..zero.fully_shard import reduced_after_the_schedule, resharded_after_the_forwards
from ..distributed import comm
from ..groups import ProcessGroups
from ..distributed.ranges import span
from ..loss_normalisation import (aux_loss_factor, aux_loss_weight, backward_loss, cp_loss_factor, microbatch_weights,
                                  replica_loss)
from . import p2p
from ..tensor_parallel.deferred_wgrad import WeightGradStore, attach_weight_grad_store
from .order import Action, Schedule, Step, forward, posted, schedule_order, virtual_stage
from .releases import release_points, released_at


@dataclass
class StepResult:
    loss: torch.Tensor | None                    # mean over the batch's target tokens, detached (last stage only)
    logits: list = field(default_factory=list)   # per microbatch [b, S, V(/T)], when asked (last stage)
    max_in_flight: int = 0    # most microbatches forwarded and not yet backwarded (activations held)
    busy_s: float = 0.0       # seconds in forward/backward compute (the rest of wall_s is p2p wait;
    wall_s: float = 0.0       # on CUDA only meaningful with the benchmark's synchronisation)
    aux_loss: torch.Tensor | None = None         # the MoE layers' aux loss, detached (last stage; None: dense)


def deallocate_output_tensor(out: torch.Tensor) -> None:
    """Free a sent output's storage but keep the tensor as the root of this stage's backward.

    Once the next stage has the activation, only its autograd node and shape are needed here:
    backward(out, grad) never reads out's values (a residual add ends every stage and saves
    nothing). Without this each in-flight microbatch would keep one [S(/T), B, H] activation
    twice -- here and on the next stage (Megatron's deallocate_output_tensor). The stand-in is
    a 0-stride view of one element, so autograd still sees the right shape.
    """
    assert out._base is None, "a view keeps its base alive: deallocating it would free nothing"
    out.data = torch.empty((), dtype=out.dtype, device=out.device).expand(out.shape)


class _Stage:
    """One rank's stage of the pipeline: the forward and backward steps `run_order` calls."""

    def __init__(self, model: nn.Module, groups: ProcessGroups, microbatches: list, *, collect_logits: bool,
                 loss_scale=1.0, forward_context=nullcontext):
        self.model, self.groups, self.microbatches = model, groups, microbatches
        self.collect_logits = collect_logits
        self.loss_scale, self.forward_context = loss_scale, forward_context
        par, ids = groups.par, microbatches[0][0]
        hidden = unwrap(model).config.hidden_size
        seq = ids.shape[1] // par.sequence_shards
        dtype = next(model.parameters()).dtype
        self.like = dict(size=(seq, ids.shape[0], hidden), dtype=dtype, device=ids.device)  # [S/T, b, H]
        self.loss_weights = microbatch_weights(microbatches, dtype, groups.cp)   # [M]; summed over M and CP: 1
        self.grad_scale = cp_loss_factor(par)    # grads are averaged over DP x CP but the CP ranks' losses add up
        self.held: dict = {}        # (microbatch, chunk) -> (input, output), awaiting its backward
        self.aux_roots: dict = {}   # (microbatch, chunk) -> the chunk's scaled MoE aux loss, backward beside its output
        self.aux_scale = aux_loss_weight(len(microbatches)) * aux_loss_factor(par)
        self.losses, self.logits, self.aux_losses = [], [], []
        self.max_in_flight, self.busy = 0, 0.0
        self.weight_grads: WeightGradStore | None = None   # a zero-bubble schedule's deferred wgrads

    def is_last(self, chunk: int) -> bool:
        """Whether `chunk` of this stage is the model's last (its output is the loss)."""
        return self.groups.is_last_stage and chunk == self.groups.par.virtual_stages - 1

    def forward(self, i: int, x, chunk: int = 0):
        """Microbatch i through model chunk `chunk` of this stage; x: the received activation (None
        on the first chunk of the first stage). -> the output activation, or after the model's
        last chunk the loss scaled by its share of the targets."""
        ids, targets = self.microbatches[i]
        if x is not None:
            x.requires_grad_()      # its grad is what this stage sends back
        start = time.perf_counter()
        with self._grad_sync(i), span("forward"), self.forward_context():
            out = self.model(ids, targets, hidden_states=x, **({"chunk": chunk} if chunk else {}))
        self.busy += time.perf_counter() - start
        if not self.is_last(chunk):
            self._hold_aux_loss(i, chunk)
            return out
        loss = out.loss * self.loss_weights[i].to(out.loss.dtype)
        self.losses.append(loss.detach())
        if out.aux_loss is not None:          # what backward runs on: the LM loss + the aux loss
            self.aux_losses.append(out.aux_loss.detach() * aux_loss_weight(len(self.microbatches)))
            loss = loss + out.aux_loss * self.aux_scale
        if self.collect_logits and out.logits is not None:   # --loss_chunks: no whole logits
            self.logits.append(out.logits.detach())
        return backward_loss(loss, self.loss_scale, self.grad_scale)   # the reported loss is not scaled

    def _hold_aux_loss(self, i: int, chunk: int) -> None:
        """The MoE layers' aux loss of microbatch i in model chunk `chunk` of an earlier (virtual)
        stage (None: dense): its backward runs beside that chunk's output grad, scaled as the last
        stage scales its own (`loss_normalisation`; the aux loss of a layer enters backward on the
        chunk that holds it, as Megatron-LM's MoEAuxLossAutoScaler)."""
        of = getattr(unwrap(self.model), "stage_aux_loss", None)
        aux = of(chunk) if of is not None else None
        if aux is None:
            return
        self.aux_losses.append(aux.detach() * aux_loss_weight(len(self.microbatches)))
        if torch.is_grad_enabled() and aux.requires_grad:
            self.aux_roots[i, chunk] = backward_loss(aux * self.aux_scale, self.loss_scale, self.grad_scale)

    def _grad_sync(self, i: int):
        """DDP (one stage only) all-reduces in the backward of its last forward: earlier ones under no_sync."""
        if isinstance(self.model, DistributedDataParallel) and i < len(self.microbatches) - 1:
            return self.model.no_sync()
        return nullcontext()

    def hold(self, unit: tuple[int, int], x, out) -> None:
        self.held[unit] = (x, out)
        self.max_in_flight = max(self.max_in_flight, len(self.held))

    def backward(self, unit: tuple[int, int], grad):
        """Backward of held (microbatch, chunk) `unit`; grad: of its output (None after the last
        chunk, whose output is the loss). -> the grad of its input activation (None on the first
        chunk of the first stage). With a WeightGradStore (zb) this is B: the linears' wgrads are
        queued for the unit's W."""
        x, out = self.held.pop(unit)
        aux = self.aux_roots.pop(unit, None)      # the chunk's own MoE aux loss (None: the last chunk's is in the loss)
        store = self.weight_grads
        start = time.perf_counter()
        with span("backward"), (store.collecting(unit) if store is not None else nullcontext()):
            if aux is None:
                torch.autograd.backward(out, grad_tensors=grad)
            else:                            # this stage's MoE aux loss too (its grad: 1, scaled in)
                torch.autograd.backward([out, aux], grad_tensors=[grad, None])
        self.busy += time.perf_counter() - start
        if x is None:
            return None
        input_grad, x.grad = x.grad, None    # the input itself dies here, its grad goes upstream
        return input_grad

    def weight(self, unit: tuple[int, int]) -> None:
        """W of `unit`: the weight grads its B deferred."""
        start = time.perf_counter()
        with span("weight"):
            self.weight_grads.run(unit)
        self.busy += time.perf_counter() - start

    def send_forward(self, out) -> None:
        p2p.send_forward(out, self.groups)
        if not self.groups.is_last_stage:
            deallocate_output_tensor(out)

    def send_forward_recv_backward(self, out):
        grad = p2p.send_forward_recv_backward(out, self.groups, self.like)
        if not self.groups.is_last_stage:
            deallocate_output_tensor(out)
        return grad

    def result(self, wall_s: float) -> StepResult:
        loss = replica_loss(self.losses, self.groups.cp)          # summed over M and the CP ranks' parts
        return StepResult(loss, self.logits, self.max_in_flight, self.busy, wall_s, self._pipeline_aux())

    def _pipeline_aux(self) -> torch.Tensor | None:
        """The reported MoE aux loss, every stage's layers' summed onto the last stage (None: dense,
        or off the last stage). Collective over PP for an MoE model."""
        if not unwrap(self.model).config.use_moe:
            return None
        mine = torch.stack(self.aux_losses).sum() if self.aux_losses else torch.zeros((), device=self.like["device"])
        if self.groups.pp is not None:
            mine = comm.all_reduce(mine.double(), self.groups.pp).to(mine.dtype)
        return mine if self.groups.is_last_stage else None


def run_order(stage: _Stage, order: list[Action], releases: dict[int, int] | None = None) -> None:
    """Execute this stage's actions in order. A forward receives its input, runs and sends its
    output; a backward receives its output's grad, runs and sends its input's grad. A paired
    action's send and the next action's receive are one exchange (order.py), whose result is
    that next action's input. Every received grad, sent input grad and finished output is
    dropped as soon as it is dead: nothing of an earlier microbatch stays bound. An order with
    chunks or W steps runs with posted sends (`run_posted`), freeing each send at its point of
    `releases` (releases.py)."""
    if posted(order):
        run_posted(stage, order, releases)
        return
    groups, like = stage.groups, stage.like
    inbox, received = None, False    # the next action's input, when a paired exchange brought it
    for action in order:
        i = action.microbatch
        if action.step is Step.FORWARD:
            x = inbox if received else p2p.recv_forward(groups, like)
            inbox = None
            out = stage.forward(i, x)
            stage.hold(action.unit, x, out)
            x = None                # held by the stage until its backward, which frees it
            if action.paired:       # the output goes down, the next backward's grad comes up
                inbox = stage.send_forward_recv_backward(out)
            else:
                stage.send_forward(out)
            out = None              # the previous loss's graph would keep its input alive
        else:
            grad = inbox if received else p2p.recv_backward(groups, like)
            inbox = None
            input_grad = stage.backward(action.unit, grad)
            grad = None             # dead once backward has used it
            if action.paired:       # the input grad goes up, the next forward's activation comes down
                inbox = p2p.send_backward_recv_forward(input_grad, groups, like)
            else:
                p2p.send_backward(input_grad, groups)
            input_grad = None       # sent: dead
        received = action.paired


def run_posted(stage: _Stage, order: list[Action], releases: dict[int, int]) -> None:
    """Execute an order with chunks (virtual stage chunk*P + p) or W steps. A forward waits for
    its input from the previous virtual stage (stage p-1, or P-1 for chunk c > 0 of stage 0),
    a backward for its output's grad from the next; every send is posted and not waited for
    (p2p.post_send; order.simulate proves the orders finish so). `releases` (releases.py) says
    after which action's receive each send is waited and what it sent freed (a sent output
    deallocated): the first whose message proves the peer has it, so the wait returns at once and
    every buffer dies at a fixed point of the order. Under zb a WeightGradStore is handed to the
    model's linears for the step: B queues their wgrads, W runs them."""
    groups, like, pp = stage.groups, stage.like, stage.groups.par.pp
    last = pp * groups.par.virtual_stages - 1
    due = released_at(releases)
    sends = {}                              # index of the sending action -> (handle, what it sent, output?)
    if any(a.step is Step.WEIGHT for a in order):
        stage.weight_grads = WeightGradStore()
        attach_weight_grad_store(stage.model, stage.weight_grads)
    try:
        for k, action in enumerate(order):
            vs = virtual_stage(action, pp, groups.pp_rank)
            if action.step is Step.FORWARD:
                x = p2p.recv_posted(groups, like, forward=True) if vs > 0 else None
                _release(sends, due.get(k, ()))
                out = stage.forward(action.microbatch, x, action.chunk)
                stage.hold(action.unit, x, out)
                x = None
                if vs < last:
                    sends[k] = (p2p.post_send(out, groups, forward=True), out, True)
                out = None
            elif action.step is Step.BACKWARD:
                grad = p2p.recv_posted(groups, like, forward=False) if vs < last else None
                _release(sends, due.get(k, ()))
                input_grad = stage.backward(action.unit, grad)
                grad = None
                if vs > 0:
                    sends[k] = (p2p.post_send(input_grad, groups, forward=False), input_grad, False)
                input_grad = None
            else:
                stage.weight(action.unit)
        _release(sends, list(sends))    # not on an error: a peer that failed would never receive
    finally:
        if stage.weight_grads is not None:
            attach_weight_grad_store(stage.model, None)


def _release(sends: dict, indices) -> None:
    """Wait the posted sends of the actions `indices` and free what they sent (a sent output is
    deallocated to its one-element stand-in, an input grad dropped)."""
    for k in indices:
        handle, sent, is_output = sends.pop(k)
        handle.wait()
        if is_output:
            deallocate_output_tensor(sent)
        handle = sent = None


def all_forwards(stage: _Stage) -> None:
    """Forward-only (evaluation): every microbatch through, nothing kept for backward; with
    virtual stages chunk by chunk, each chunk's microbatches in turn (posted sends)."""
    groups = stage.groups
    with torch.no_grad():
        if groups.par.virtual_stages == 1:
            for i in range(len(stage.microbatches)):
                stage.send_forward(stage.forward(i, p2p.recv_forward(groups, stage.like)))
            return
        pp, v = groups.par.pp, groups.par.virtual_stages
        orders = [[forward(i, chunk=c) for c in range(v) for i in range(len(stage.microbatches))] for _ in range(pp)]
        run_posted(stage, orders[groups.pp_rank], release_points(orders, pp, v)[groups.pp_rank])


def forward_backward(model: nn.Module, groups: ProcessGroups, microbatches: list, *,
                     schedule: Schedule = Schedule.ONE_F_ONE_B, forward_only: bool = False, collect_logits: bool = False, loss_scale=1.0,
                     forward_context=nullcontext) -> StepResult:
    """Run every microbatch [Batch(ids [b, S], targets [b, S]), ...] (`data.batches`) through
    this rank's stage, accumulating the grads of the mean loss over all their target tokens. With one stage both
    schedules are plain gradient accumulation (forward, backward per microbatch: 1F1B without
    warm-up); a DDP model then all-reduces once, in the last backward.
    `loss_scale` (a float or 0-dim tensor) multiplies the loss before backward only (the replica's
    share of the global batch's targets, a float16 loss scale); `forward_context()` is entered
    around every forward (autocast for mixed precision), never around backward."""
    stage = _Stage(model, groups, microbatches, collect_logits=collect_logits, loss_scale=loss_scale,
                   forward_context=forward_context)
    start = time.perf_counter()
    if forward_only:      # no schedule: every microbatch (chunk by chunk) through
        with resharded_after_the_forwards(model, groups):   # --zero 3: FSDP2's shards again after
            all_forwards(stage)
    else:
        pp, v = groups.par.pp, groups.par.virtual_stages
        orders = [schedule_order(pp, p, len(microbatches), schedule, v) for p in range(pp)]
        order = orders[groups.pp_rank]
        with reduced_after_the_schedule(model, groups):   # --zero 3: FSDP2 reduce-scatters once, after the last backward
            run_order(stage, order, release_points(orders, pp, v)[groups.pp_rank] if posted(order) else None)
    return stage.result(time.perf_counter() - start)


def bubble_fraction(pp: int, num_microbatches: int, schedule: Schedule = Schedule.ONE_F_ONE_B,
                    virtual_stages: int = 1) -> float:
    """The idle share of every stage with equal stage times: GPipe and 1F1B (P-1)/(M+P-1);
    interleaved (P-1)/(V M + P-1); ZB-H1 at T_F = T_B = T_W (P-1)/(3M + P-1).
    A measured counterpart per stage: 1 - StepResult.busy_s / StepResult.wall_s."""
    p, m = pp, num_microbatches
    if schedule == Schedule.INTERLEAVED:
        return (p - 1) / (virtual_stages * m + p - 1)
    if schedule == Schedule.ZERO_BUBBLE:
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)
