"""The analytic memory model against --estimate on random layouts: every byte, every stage.

Each case draws a small model and a layout (TP 1/2/4, PP 1/2/4, DP 1/2, SP, async, shared gather,
VP, tied embeddings, GQA, fp32/bf16, 1 to 5 microbatches, GPipe, 1F1B, interleaved (2 or 4 chunks
per stage, M a multiple of P) or ZB-H1, one stage; with --cp
also CP 1/2/4 with every comm type and load balance on or off, --recompute none/selective/full and
--loss_chunks 1/2/3/4/8; with --moe MiniMind's MoE model: 2/4/8 experts, top-1/2, widths
16/64/256, the experts over 1 or 2 of the DP x CP ranks; with --zero 3, DP 2 or 4 and the experts over
1, 2 or 4 of them)
from a seeded generator, measures one step on fake tensors and compares the model's peak with it.
One line per case (a layout `predict_memory` refuses in one line is skipped, its reason printed); exit 1
if any differs.

    python scripts/memory_model_sweep.py [--seed=0] [--cases 100] [--min_tokens_per_hidden 2] [--cp] [--moe]
        [--schedules interleaved zb]   (only those schedules, only pipeline layouts)
        [--recompute none|selective|full] [--microbatches M] [--dtype float32|bfloat16]

--min_tokens_per_hidden keeps at least that many tokens per microbatch per unit of hidden size
(S*B >= k*H): the model's domain. 0 also draws the few-token layouts where a block's weights
outweigh its activations and the peak can fall in a moment the model does not list (under
--zero 3 it lists FSDP2's, and refuses in one line the few-token layouts it does not follow).
"""
from __future__ import annotations

import argparse
import random
from dataclasses import replace

import torch

from minimind_parallel import ConfigError, MiniMindConfig, ParallelConfig
from minimind_parallel.config import CPCommType, Recompute
from minimind_parallel.memory import estimate_step_memory, predict_memory
from minimind_parallel.memory.analytic.predict import MODELLED_SCHEDULES
from minimind_parallel.pipeline_parallel import Schedule
from minimind_parallel.pipeline_parallel.order import check_schedule


def draw(rng: random.Random, min_tokens_per_hidden: float, cp_layouts: bool = False,
         schedules: tuple = MODELLED_SCHEDULES):
    """One random case -> (config, par, sizes) or None when the draw is not a valid layout.
    cp_layouts: context parallelism and --recompute drawn too (a CP size of 1 included);
    `schedules`: those drawn from."""
    if cp_layouts:
        return draw_cp(rng, min_tokens_per_hidden, schedules)
    tp, pp, dp = rng.choice([1, 2, 2, 4]), rng.choice([1, 2, 2, 4]), rng.choice([1, 1, 2])
    sp = tp > 1 and rng.random() < 0.6
    async_ = sp and rng.random() < 0.5
    shared = sp and not async_ and rng.random() < 0.5
    vp = tp > 1 and rng.random() < 0.4
    heads, kv = rng.choice([(8, 4), (8, 8), (4, 2), (8, 2)])
    if kv % tp:
        return None
    c = MiniMindConfig(hidden_size=rng.choice([32, 64, 128]), num_hidden_layers=pp * rng.choice([1, 2]),
                       num_attention_heads=heads, num_key_value_heads=kv, vocab_size=rng.choice([128, 512, 2048, 8192]),
                       tie_word_embeddings=rng.random() < 0.4, max_position_embeddings=256)
    par = ParallelConfig(tp=tp, pp=pp, dp=dp, sequence_parallel=sp, async_communication=async_,
                         shared_sp_gather=shared, vocab_parallel=vp)
    bsz = rng.choice([1, 2])
    seqs = [s for s in (8, 16, 32, 64, 128) if s * bsz >= min_tokens_per_hidden * c.hidden_size] or [256]
    sizes = dict(seq_len=rng.choice(seqs), micro_batch_size=bsz, num_microbatches=rng.choice([1, 2, 3, 5]),
                 schedule=rng.choice(list(schedules)), dtype=rng.choice([torch.float32, torch.bfloat16]),
                 stage=rng.randrange(pp))
    return _chunked(rng, c, par, sizes)


def _chunked(rng: random.Random, c: MiniMindConfig, par: ParallelConfig, sizes: dict):
    """Interleaved: V = 2 or 4 chunks of one layer per stage, M a multiple of P (one stage: V = 1)."""
    if sizes["schedule"] != Schedule.INTERLEAVED or par.pp == 1:
        return c, replace(par, virtual_stages=1), sizes
    v = rng.choice([2, 4])
    sizes = dict(sizes, num_microbatches=par.pp * rng.choice([1, 2]))
    return replace(c, num_hidden_layers=par.pp * v), replace(par, virtual_stages=v), sizes


def draw_cp(rng: random.Random, min_tokens_per_hidden: float, schedules: tuple = MODELLED_SCHEDULES):
    """A layout with context parallelism: CP 1/2/4 x TP 1/2 x PP 1/2 x DP 1/2, any comm type, load
    balance on or off, SP/async/VP, --recompute none/selective/full, --loss_chunks (smaller grids:
    the world is dp*pp*cp*tp)."""
    case = draw(rng, min_tokens_per_hidden, schedules=schedules)
    if case is None:
        return None
    c, par, sizes = case
    tp, pp = rng.choice([1, 2]), rng.choice([1, 1, 2])
    cp = rng.choice([1, 2, 2, 4])
    comm = rng.choice(list(CPCommType))
    if c.num_key_value_heads % (tp * (cp if comm == CPCommType.A2A else 1)):
        return None
    sp = tp > 1 and par.sequence_parallel
    par = replace(par, tp=tp, pp=pp, cp=cp, cp_comm_type=comm, cp_load_balance=rng.random() < 0.6,
                  sequence_parallel=sp, async_communication=sp and par.async_communication,
                  shared_sp_gather=sp and par.shared_sp_gather, vocab_parallel=tp > 1 and par.vocab_parallel,
                  recompute=rng.choice(list(Recompute)), loss_chunks=rng.choice([1, 1, 2, 3, 4, 8]))
    c = replace(c, num_hidden_layers=pp * rng.choice([1, 2]))
    chunks = 2 * cp if par.cp_load_balance else cp
    seqs = [s for s in (16, 32, 64, 128) if s % chunks == 0 and s * sizes["micro_batch_size"]
            >= min_tokens_per_hidden * c.hidden_size * cp] or [256]
    sizes = dict(sizes, seq_len=rng.choice(seqs), stage=rng.randrange(pp), cp_rank=rng.randrange(cp))
    return _chunked(rng, c, par, sizes)


def with_moe(rng: random.Random, case, zero_bubble: bool = False):
    """The case's model as MiniMind's MoE one, its experts over EP ranks carved from DP x CP (None:
    no valid draw). A zb draw under PP only with `zero_bubble` (--schedules): the default draws
    skip it as they did before the MoE model under zb was modelled, so that each seed draws the
    cases its documented counts came from."""
    if case is None:
        return None
    c, par, sizes = case
    if par.pp > 1 and sizes["schedule"] == Schedule.ZERO_BUBBLE and not zero_bubble:
        return None
    experts = rng.choice([2, 4, 8])
    ep = rng.choice([e for e in (1, 2, 4) if (par.dp * par.cp) % e == 0 and experts % e == 0])
    c = replace(c, use_moe=True, num_experts=experts, num_experts_per_tok=rng.choice([1, 2]),
                moe_intermediate_size=rng.choice([16, 64, 256]))
    return c, replace(par, ep=ep), sizes


def with_expert_data_parallel(rng: random.Random, c: MiniMindConfig, par: ParallelConfig,
                              eps: tuple = (1, 2, 4)) -> ParallelConfig | None:
    """--zero 3 with MoE: DP 2 or 4 and the experts over 1, 2 or 4 (`eps`: those of them) of the DP x CP
    ranks, so that the experts' own FSDP2 group spans one EDP rank (ep = dp x cp: the experts whole)
    or more (None: no EP size of `eps` fits)."""
    dp = rng.choice([2, 4])
    fits = [e for e in eps if (dp * par.cp) % e == 0 and c.num_experts % e == 0]
    return replace(par, dp=dp, ep=rng.choice(fits)) if fits else None


def refused(par: ParallelConfig, sizes: dict) -> bool:
    """Whether the schedule refuses the layout before launch (check_schedule), as the command
    line would: not a case."""
    try:
        check_schedule(sizes["schedule"], par, sizes["num_microbatches"])
    except ConfigError:
        return True
    return False


def _forced(args, par: ParallelConfig, sizes: dict) -> tuple[ParallelConfig, dict]:
    """The draw with --recompute, --microbatches and --dtype imposed (where given)."""
    if args.recompute:
        par = replace(par, recompute=Recompute(args.recompute))
    if args.microbatches:
        sizes = dict(sizes, num_microbatches=args.microbatches)
    if args.dtype:
        sizes = dict(sizes, dtype=getattr(torch, args.dtype))
    return par, sizes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--min_tokens_per_hidden", type=float, default=2)
    ap.add_argument("--cp", action="store_true", help="draw context-parallel layouts (and --recompute, --loss_chunks)")
    ap.add_argument("--zero", type=int, nargs="+", choices=[1, 2, 3], default=[],
                    help="draw these --zero levels (over dp x cp > 1: dp 2 when the draw has dp x cp = 1) and "
                         "--bucket_size_mb 0.01 / 0.05 / 25 (3: under PP only with --zero3_pipeline, at ep 1; with --moe "
                         "at pp 1 DP 2 or 4, the experts over 1, 2 or 4 of the DP x CP ranks)")
    ap.add_argument("--moe", action="store_true", help="draw MiniMind's MoE model, with expert parallelism")
    ap.add_argument("--recompute", choices=[r.value for r in Recompute], help="every draw under this --recompute")
    ap.add_argument("--microbatches", type=int, help="every draw with this many microbatches")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="every draw in this dtype")
    ap.add_argument("--zero3_pipeline", action="store_true",
                    help="with --zero 3, draw only pipeline layouts (pp_size > 1, fsdp_pipeline.py), with --recompute "
                         "none/selective/full (the draws it refuses are skipped)")
    ap.add_argument("--ep", type=int, nargs="+", choices=[1, 2, 4], default=None,
                    help="with --zero 3 --moe, the experts over only these EP sizes (e.g. 2 4: only expert parallelism), "
                         "with --zero3_pipeline under PP too (DP 2 or 4)")
    ap.add_argument("--schedules", nargs="+", type=Schedule, choices=list(MODELLED_SCHEDULES), default=None,
                    help="draw only these schedules, and only pipeline layouts (pp > 1), where they differ")
    args = ap.parse_args()
    rng, done, bad = random.Random(args.seed), 0, 0
    memo: dict = {}   # the estimate's fake dispatch, remembered from one layout to the next
    while done < args.cases:
        case = draw(rng, args.min_tokens_per_hidden, args.cp, tuple(args.schedules or MODELLED_SCHEDULES))
        if args.moe:
            case = with_moe(rng, case, zero_bubble=args.schedules is not None)
        if case is None or (args.schedules and case[1].pp == 1):
            continue
        c, par, sizes = case
        par, sizes = _forced(args, par, sizes)
        if refused(par, sizes):   # a schedule the imposed microbatches do not fit
            continue
        if args.zero:
            par = replace(par, zero=rng.choice(args.zero), dp=par.dp if par.dp * par.cp > 1 else 2)
            sizes = dict(sizes, bucket_size_mb=rng.choice([0.01, 0.05, 25.0]))
            if (par.zero == 2 and par.pp > 1 and sizes["schedule"] in (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE)
                    and not args.schedules):
                continue   # the default draws skip it, as before it was modelled (--schedules draws it)
            if par.zero == 3 and (par.pp > 1) != args.zero3_pipeline:
                continue   # under PP modelled by fsdp_pipeline (--zero3_pipeline draws it, and only it)
            if par.zero == 3 and args.zero3_pipeline and not args.cp:
                par = replace(par, recompute=rng.choice(list(Recompute)))
            if par.zero == 3 and par.pp > 1 and not (args.ep and c.use_moe):
                par = replace(par, ep=1)   # the default draws: ep 1 under PP, as before ep > 1 was modelled there
            if par.zero == 3 and (par.pp == 1 or args.ep) and c.use_moe:
                par = with_expert_data_parallel(rng, c, par, tuple(args.ep or (1, 2, 4)))
            if par is None or refused(par, sizes):
                continue
        try:
            pred = predict_memory(c, par, **sizes)
        except NotImplementedError as refusal:   # a variant the model refuses in one line: not a case
            print(f"skip  {refusal}", flush=True)
            continue
        done += 1
        estimate = estimate_step_memory(c, par, iters=1, memo=memo, **sizes)
        diff = pred.peak_bytes - estimate.peak_bytes
        bad += diff != 0
        print(f"{'ok ' if diff == 0 else 'BAD'} {diff:+9d} B  {pred.peak_at:28} H{c.hidden_size} L{c.num_hidden_layers} "
              f"heads {c.num_attention_heads}/{c.num_key_value_heads} V{c.vocab_size} tied {c.tie_word_embeddings:d} "
              f"S{sizes['seq_len']} B{sizes['micro_batch_size']} M{sizes['num_microbatches']} {sizes['schedule']} "
              f"V{par.virtual_stages} {str(sizes['dtype'])[6:]} stage {sizes['stage']} cp rank {sizes.get('cp_rank', 0)}  tp{par.tp} pp{par.pp} dp{par.dp} sp{par.sequence_parallel:d} "
              f"async{par.async_communication:d} shared{par.shared_sp_gather:d} vp{par.vocab_parallel:d} "
              f"cp{par.cp} {par.cp_comm_type} lb{par.cp_load_balance:d} {par.recompute} chunks{par.loss_chunks}"
              + (f" zero{par.zero} bucket {sizes['bucket_size_mb']:g} MiB" if par.zero else "")
              + (f" E{c.num_experts} k{c.num_experts_per_tok} I{c.moe_intermediate_size} ep{par.ep}" if c.use_moe else ""),
              flush=True)
    print(f"{done - bad} of {done} cases equal to the byte")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
