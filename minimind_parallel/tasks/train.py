"""`train`: pretrain MiniMind-3 on a jsonl corpus in any layout, with MiniMind's semantics
(jingyaogong/minimind: trainer/train_pretrain.py, dataset/lm_dataset.py).

    python -m evaluation.parallel train --tp_size 2 -- --data_path data/stdlib.jsonl \\
        --tokenizer_path data/tokenizer --sequence_parallel --save_dir runs/tiny [--resume]

The task composes its rooms: the data (`data.feed`, `data.pretrain`: rows, sampler, held-out
rows), the step (`training.train_step`: exact token mean over DP, mixed precision, global
grad-norm clipping, AdamW), the schedule (`lr_schedule.cosine_lr`), held-out loss (`heldout`),
checkpoints (`checkpoint`) and what a person sees (`metrics`). The launcher checks every input
and builds the token caches before any rank starts (`check`); ranks only open them.

One optimizer step takes --accumulation_steps microbatches of --batch_size rows on every DP
replica (the pipeline's microbatches under PP), so the global batch is dp x batch_size x
accumulation_steps rows. The run is --max_steps steps (as many epochs as they take; the launcher
says so when that is past --epochs), else --epochs x steps per epoch; the learning rate follows
MiniMind's cosine over that many steps, fixed at the start and saved: a resume must make the same
run (the same total, global batch, seed, rows and data file), which the launcher checks against
the checkpoint before any rank starts.

A run stops early, with one line and exit 1, when a step's loss or grad norm is not finite (the
step is not taken, nothing is saved: the last checkpoint is the last finite state) or a save
fails (a full disk). The ranks tell the launcher through a file (the job's report), so the line
is the launcher's, not a rank's traceback.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import checkpoint, launcher
from ..config import DTYPES, ConfigError
from ..context_parallel import ContextLayout
from ..data.batches import cp_tokens
from ..data.feed import DataFormat, Rows, heldout_batches, heldout_split, open_dataset
from ..data.identity import check_same_file, file_identity
from ..data.pretrain import PretrainSampler, check_fits_model
from ..data.tokenizer import load_tokenizer
from ..distributed import comm
from ..files import atomic_path, check_directory
from ..groups import ProcessGroups, first_on_node
from ..job import Job
from ..model import MiniMindForCausalLM
from ..options import (Parser, add_model_args, check_at_least, check_common, check_number,
                       collective_timeout)
from ..loss_normalisation import token_sum, world_token_mean
from ..training import build_parallel_model, make_optimizer, train_step, wrap_data_parallel
from ..training.heldout import heldout_loss
from ..training.lr_schedule import cosine_lr
from ..training.metrics import (MetricsFile, format_eval, format_line, interval_rates, model_flops_per_token,
                                peak_memory_bytes, peak_tflops, write_loss_plot)
from ..training.mixed_precision import LossScaler, Precision, PrecisionMode
from .task import Task
from .weights import read_initial_weights

MIB = 2 ** 20


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="train", description="pretrain MiniMind-3 on a jsonl corpus (MiniMind's train_pretrain.py)")
    add_model_args(p)
    p.add_argument("--num_hidden_layers", type=int, default=8)
    p.add_argument("--data_path", required=True, help="jsonl, one row per line (--data_format)")
    p.add_argument("--data_format", type=DataFormat.parse, choices=DataFormat.values(), default=DataFormat.TEXT,
                   help="text: {\"text\": ...} rows (pretraining); conversations: {\"conversations\": [...]} "
                        "rows rendered with the tokenizer's chat template, the loss on the assistant's tokens (sft)")
    p.add_argument("--tokenizer_path", required=True, help="directory with MiniMind's tokenizer.json")
    p.add_argument("--max_seq_len", dest="seq_len", type=int, default=340)
    p.add_argument("--batch_size", dest="micro_batch_size", type=int, help="rows per microbatch per DP rank")
    p.add_argument("--accumulation_steps", dest="num_microbatches", type=int, help="microbatches per step")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_steps", type=int, default=None,
                   help="the run's optimizer steps, as many epochs as they take (default: --epochs x steps per epoch)")
    p.add_argument("--grad_clip", type=float, default=1.0, help="global grad-norm clip (0: none)")
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--precision", type=PrecisionMode.parse, choices=PrecisionMode.values(), default=PrecisionMode.MIXED,
                   help="mixed: float32 parameters, --dtype compute under autocast (MiniMind); pure: all --dtype")
    p.add_argument("--log_interval", type=int, default=100)
    p.add_argument("--save_interval", type=int, default=1000)
    p.add_argument("--save_dir", default=None, help="checkpoints (and, by default, metrics and the loss curve)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint of --save_dir")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in a --save_dir that holds an earlier run's checkpoints")
    p.add_argument("--keep_last", type=int, default=0, metavar="N",
                   help="keep the newest N checkpoints, removing older ones after each save (0: keep all)")
    p.add_argument("--from_weight", default=None, metavar="PTH",
                   help="start from MiniMind weights ({weight}_{dim}.pth) or a checkpoint / save directory of the "
                        "same model")
    p.add_argument("--eval_data_path", default=None, help="held-out jsonl")
    p.add_argument("--eval_fraction", type=float, default=0.0, help="hold out this fraction of --data_path instead")
    p.add_argument("--eval_interval", type=int, default=0, help="held-out loss every N steps (and at the end)")
    p.add_argument("--eval_batches", type=int, default=8, help="held-out global batches per evaluation")
    p.add_argument("--peak_tflops", type=float, default=None, help="per-rank peak for MFU (default: by device)")
    p.add_argument("--out_dir", default=None, help="metrics.jsonl and loss.png (default --save_dir, else runs/train)")
    p.add_argument("--stop_at_step", type=int, default=None, metavar="N",
                   help="end this process after step N, saving a checkpoint there; --resume continues the run")
    p.set_defaults(micro_batch_size=32, num_microbatches=8, learning_rate=5e-4, dtype="bfloat16",
                   tie_word_embeddings=True)  # MiniMind's default (--no-tie_word_embeddings: two matrices)
    return p


# ---------------------------------------------------------------- data, steps, outputs

@dataclass(frozen=True, kw_only=True)
class TrainData:
    train: Rows
    heldout: Rows | None


def open_data(args, tok) -> TrainData:
    """The training rows and the held-out rows (own file, a held-out fraction, or none)."""
    dataset = open_dataset(args.data_path, tok, args.seq_len, args.data_format)
    train_rows, held = heldout_split(len(dataset), args.eval_fraction, args.seed)
    heldout = None
    if args.eval_data_path:
        eval_set = open_dataset(args.eval_data_path, tok, args.seq_len, args.data_format)
        heldout = Rows(eval_set, np.arange(len(eval_set)))
    elif len(held):
        heldout = Rows(dataset, held)
    return TrainData(train=Rows(dataset, train_rows), heldout=heldout)


def rows_per_replica(args) -> int:
    return args.micro_batch_size * args.num_microbatches


def make_sampler(args, num_rows: int, dp_rank: int, dp: int) -> PretrainSampler:
    return PretrainSampler(num_rows, batch_size=rows_per_replica(args), dp_rank=dp_rank, dp_size=dp, seed=args.seed)


def total_steps(args, steps_per_epoch: int) -> int:
    """--max_steps (running past --epochs when it takes more), else --epochs x steps per epoch."""
    return args.epochs * steps_per_epoch if args.max_steps is None else args.max_steps


def evaluating(args) -> bool:
    return bool(args.eval_data_path) or args.eval_fraction > 0


def out_dir(args) -> str:
    return args.out_dir or args.save_dir or os.path.join("runs", "train")


# ---------------------------------------------------------------- launcher side: every check

def check(job: Job) -> None:
    """Every bad input refused before a rank starts; the token caches are built here (tokenising
    the data is how a malformed line or an empty file is found). Creates no directory."""
    args = job.task
    check_at_least(args, 1, ("epochs", "log_interval", "save_interval", "eval_batches"))
    check_at_least(args, 0, ("warmup_steps", "eval_interval", "keep_last"))
    for name in ("max_steps", "stop_at_step"):
        if getattr(args, name) is not None:
            check_at_least(args, 1, (name,))
    check_number(args, "grad_clip", minimum=0.0)
    check_number(args, "peak_tflops", minimum=0.0, exclusive=True)
    if not 0 <= args.eval_fraction < 1:
        raise ConfigError(f"eval_fraction must be in [0, 1); got eval_fraction={args.eval_fraction}")
    if args.eval_interval and not evaluating(args):
        raise ConfigError(f"--eval_interval {args.eval_interval} needs held-out data: --eval_data_path or --eval_fraction")
    tok = load_tokenizer(args.tokenizer_path)
    config, par = job.model, job.parallel
    check_fits_model(tokenizer_vocab=tok.vocab_size, model_vocab=config.vocab_size, max_seq_len=args.seq_len,
                     max_positions=config.max_position_embeddings)
    check_common(job, [(args, par)], sizes=("micro_batch_size", "num_microbatches"),
                 steps=" with --precision pure: use --precision mixed" if args.precision == PrecisionMode.PURE else None)
    check_data(args, tok, par)
    check_outputs(args, config)
    if args.resume:
        check_resume(args, run_length(args, par))


def check_data(args, tok, par) -> None:
    data = open_data(args, tok)
    total = total_steps(args, make_sampler(args, len(data.train), 0, par.dp).steps_per_epoch)
    cosine_lr(1, total, args.learning_rate, args.warmup_steps)  # warmup_steps < total steps
    if data.heldout is not None and len(data.heldout) < rows_per_replica(args) * par.dp:
        raise ConfigError(f"held-out data must hold one global batch (dp_size * batch_size * accumulation_steps "
                          f"rows); got {len(data.heldout)} rows, global batch {rows_per_replica(args) * par.dp}")


def check_outputs(args, config) -> None:
    """The save and output directories (checked, not created) and what --resume / --from_weight read."""
    if args.resume and args.from_weight:
        raise ConfigError(f"--resume continues a checkpoint, --from_weight starts from weights: give one; "
                          f"got --resume and --from_weight {args.from_weight}")
    if args.resume and not args.save_dir:
        raise ConfigError("--resume continues the latest checkpoint of --save_dir; got no --save_dir")
    if args.resume and not os.path.exists(args.save_dir):
        raise ConfigError(f"--resume: --save_dir {args.save_dir} does not exist")
    if args.save_dir:
        checkpoint.check_save_dir(args.save_dir)
        earlier = checkpoint.latest_checkpoint(args.save_dir)
        if earlier and not (args.resume or args.overwrite):
            raise ConfigError(f"--save_dir {args.save_dir} holds an earlier run's checkpoint "
                              f"({os.path.basename(earlier)}): pass --resume to continue it or --overwrite to "
                              f"start a new run there")
    if args.resume:
        path = checkpoint.latest_checkpoint(args.save_dir)
        if path is None:
            raise ConfigError(f"--resume: no complete checkpoint in --save_dir {args.save_dir}")
        checkpoint.check_checkpoint_config(path, config)
    if args.from_weight:
        read_initial_weights(args.from_weight, config)
    check_directory("--out_dir", out_dir(args))


# ---------------------------------------------------------------- launcher side: the run's length, resuming

@dataclass(frozen=True, kw_only=True)
class RunLength:
    """What the command asks for: this many steps of this many rows from these rows of this file."""

    total_steps: int
    steps_per_epoch: int
    num_rows: int          # training rows (the held-out fraction set aside)
    global_batch: int      # rows of one step: dp x batch_size x accumulation_steps
    dp: int


def run_length(args, par) -> RunLength:
    train_rows = len(open_data(args, load_tokenizer(args.tokenizer_path)).train)
    sampler = make_sampler(args, train_rows, 0, par.dp)
    return RunLength(total_steps=total_steps(args, sampler.steps_per_epoch), steps_per_epoch=sampler.steps_per_epoch,
                num_rows=train_rows, global_batch=sampler.global_batch_size, dp=par.dp)


def check_resume(args, p: RunLength) -> None:
    """The run of this command is the run the checkpoint is part of: the same data file, rows, seed,
    global batch (the data position is a step of global batches; another --dp_size with
    --batch_size / --accumulation_steps keeping dp x batch_size x accumulation_steps continues at
    the same sample) and total steps (the learning-rate schedule spans them)."""
    path = checkpoint.latest_checkpoint(args.save_dir)
    extra = checkpoint.read_extra(path)
    if "data" in extra:   # checkpoints saved before the identity was recorded are not checked
        check_same_file("--resume: --data_path", args.data_path, extra["data"])
    sampler = extra.get("sampler", {})
    now = {"num_rows": (p.num_rows, "training rows (--eval_fraction sets rows aside)"), "seed": (args.seed, "--seed"),
           "global_batch_size": (p.global_batch, f"rows per step (dp_size {p.dp} x batch_size "
                                                 f"{args.micro_batch_size} x accumulation_steps {args.num_microbatches}"
                                                 f"; another dp_size continues at the same sample when the product "
                                                 f"stays {sampler.get('global_batch_size')})")}
    for key, (value, what) in now.items():
        if sampler.get(key) != value:
            raise ConfigError(f"--resume: the checkpoint's run has {key}={sampler.get(key)}, this command "
                              f"{key}={value}: {what}")
    if extra.get("total_steps") != p.total_steps:
        raise ConfigError(f"--resume: the checkpoint's run is {extra.get('total_steps')} steps, this command makes "
                          f"{p.total_steps} (--epochs {args.epochs}, --max_steps {args.max_steps}): its learning-rate "
                          f"schedule was fixed at its start; give the --epochs / --max_steps it started with")
    if args.stop_at_step is not None and args.stop_at_step <= extra["step"] < p.total_steps:
        raise ConfigError(f"--stop_at_step must be past the checkpoint's step; got --stop_at_step {args.stop_at_step}, "
                          f"checkpoint step {extra['step']}")


def launch_train(job: Job) -> int:
    """Say what the run will do (or that a resumed run is already finished), then one torchrun job;
    a run the ranks stopped early (the job's report file) is one line on stderr, exit 1."""
    args = job.task
    p = run_length(args, job.parallel)
    if args.resume:
        path = checkpoint.latest_checkpoint(args.save_dir)
        step = checkpoint.read_extra(path)["step"]
        if step >= p.total_steps:
            print(f"{job.launch.task}: the run in --save_dir {args.save_dir} is finished: step {step} of "
                  f"{p.total_steps} ({os.path.basename(path)}); nothing to resume")
            return 0
    if args.max_steps is not None and args.max_steps > args.epochs * p.steps_per_epoch:
        print(f"{job.launch.task}: --max_steps {args.max_steps} runs past --epochs {args.epochs} "
              f"({p.steps_per_epoch} steps per epoch): {math.ceil(args.max_steps / p.steps_per_epoch)} epochs",
              flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        outcome = os.path.join(tmp, "outcome.json")
        code = launcher.run_job(replace(job, report=outcome))
        if code == 0 and os.path.exists(outcome):
            with open(outcome) as f:
                print(f"error: {job.launch.task}: {json.load(f)['stopped']}", file=sys.stderr)
            return 1
        return code


# ---------------------------------------------------------------- every rank

@dataclass
class Interval:
    """What the steps since the last log line add up to."""

    start: float
    steps: int = 0
    data_s: float = 0.0
    loss_sum: torch.Tensor | None = None   # this replica's sum of per-token losses (last stage)
    targets: torch.Tensor | None = None
    aux_sum: torch.Tensor | None = None    # this replica's MoE aux losses summed over the steps (last stage)

    def add(self, stats, data_s: float) -> None:
        self.steps += 1
        self.data_s += data_s
        self.targets = stats.targets if self.targets is None else self.targets + stats.targets
        if stats.loss is not None:
            part = token_sum(stats.loss, stats.targets)
            self.loss_sum = part if self.loss_sum is None else self.loss_sum + part
        aux = stats.schedule.aux_loss
        if aux is not None:
            self.aux_sum = aux.double() if self.aux_sum is None else self.aux_sum + aux.double()


class RunStopped(Exception):
    """The run stopped early for the reason its one line gives (a step that was not finite, a save
    that failed); raised on every rank alike."""


class Run:
    """One rank's training run: built once, then `train()`."""

    def __init__(self, job: Job, device):
        args = job.task
        self.args, self.device, self.argv, self.task = args, device, list(job.argv), job.launch.task
        self.config, self.par = job.model, job.parallel
        self.groups = ProcessGroups.build(self.par, timeout=collective_timeout(job.launch))
        self.precision = Precision.of(args.precision, DTYPES[args.dtype], device)
        tok = load_tokenizer(args.tokenizer_path)
        self.data = open_data(args, tok)
        self.sampler = make_sampler(args, len(self.data.train), self.groups.dp_rank, self.par.dp)
        self.total = total_steps(args, self.sampler.steps_per_epoch)
        self.data_identity = file_identity(args.data_path)
        self.model = wrap_data_parallel(self._build_model(), self.groups)
        self.optimizer = make_optimizer(self.model, args.learning_rate, self.groups, args.bucket_size_mb,
                                        args.pp_schedule)
        self.scaler = LossScaler() if self.precision.needs_loss_scaling else None
        self.last_checkpoint: tuple[str, int] | None = None   # (path, step) of the newest checkpoint of the run
        self.step = self._resume() if args.resume else 0
        self.heldout = [] if self.data.heldout is None else [self._mine(b) for b in heldout_batches(
            self.data.heldout, rows_per_replica=rows_per_replica(args), dp_rank=self.groups.dp_rank,
            dp=self.par.dp, max_batches=args.eval_batches)]
        self.flops_per_token = model_flops_per_token(self.config, args.seq_len)
        self.peak, self.peak_source = peak_tflops(device, args.peak_tflops)
        self.lead = dist.get_rank() == 0
        self.metrics = MetricsFile(os.path.join(out_dir(args), "metrics.jsonl")) if self.lead else None

    def _build_model(self):
        args = self.args
        if args.from_weight:
            dense = read_initial_weights(args.from_weight, self.config)
        else:
            torch.manual_seed(args.seed)
            dense = MiniMindForCausalLM(self.config).state_dict()
        return build_parallel_model(self.config, self.par, self.groups, dense, dtype=self.precision.param_dtype,
                                    device=self.device)

    def _resume(self) -> int:
        """Load the latest checkpoint; the run's length is the saved one (the launcher checked this
        command makes the same run)."""
        path = checkpoint.latest_checkpoint(self.args.save_dir)
        extra = checkpoint.load_checkpoint(path, model=self.model, optimizer=self.optimizer, config=self.config,
                                           par=self.par, groups=self.groups)
        self.sampler.load_state_dict(extra["sampler"])
        self.total = int(extra.get("total_steps", self.total))
        if self.scaler is not None and extra.get("loss_scaler") is not None:
            self.scaler.load_state_dict(extra["loss_scaler"])
        self.last_checkpoint = (path, int(extra["step"]))
        return int(extra["step"])

    def _save(self) -> None:
        extra = {"step": self.step, "sampler": self.sampler.state_dict(), "total_steps": self.total,
                 "data": self.data_identity, "max_seq_len": self.args.seq_len,  # generate warns beyond it
                 "loss_scaler": None if self.scaler is None else self.scaler.state_dict()}
        try:
            path = checkpoint.save_checkpoint(self.args.save_dir, self.step, model=self.model,
                                              optimizer=self.optimizer, config=self.config, par=self.par,
                                              groups=self.groups, extra=extra, keep_last=self.args.keep_last)
        except checkpoint.CheckpointSaveError as e:
            self.stop(f"{e}; {self.kept()}")
        self.last_checkpoint = (path, self.step)
        if self.lead:
            tqdm.write(f"step {self.step} | saved {path}", file=sys.stdout)
            write_loss_plot(self.metrics.records(), os.path.join(out_dir(self.args), "loss.png"),
                            title=self._title())

    def kept(self) -> str:
        """What a stopped run leaves to resume from."""
        if self.last_checkpoint is None:
            return "no checkpoint of this run was saved" + ("" if self.args.save_dir else " (no --save_dir)")
        path, step = self.last_checkpoint
        return f"the last checkpoint is {path} (step {step}); --resume continues from it"

    def stop(self, reason: str):
        """End the run on every rank with `reason` (one line), recorded in the metrics file."""
        if self.lead:
            self.metrics.append({"kind": "stop", "step": self.step, "reason": reason, "time": time.time()})
        raise RunStopped(reason)

    def _title(self) -> str:
        p = self.par
        return (f"MiniMind-3 {self.config.num_hidden_layers}x{self.config.hidden_size}, dp{p.dp} pp{p.pp} tp{p.tp}"
                f"{' sp' if p.sequence_parallel else ''}, {self.args.precision} {self.args.dtype}")

    def next_batch(self):
        return self._mine(self.data.train.batch(next(self.sampler)))

    def _mine(self, batch):
        """This rank's part of its replica's rows [b, S]: on the device, and under context
        parallelism its CP rank's tokens [b, S/C] (every rank of a TP/CP group reads the same rows)."""
        batch = type(batch)(*(t.to(self.device, non_blocking=True) for t in batch))
        return cp_tokens(batch, ContextLayout.of(self.par, self.args.seq_len), self.groups.cp_rank)

    def train(self) -> None:
        if self.lead:
            self.metrics.append({"kind": "run", "time": time.time(), "resumed_from": self.step,
                                 "total_steps": self.total, "argv": self.argv, "peak_tflops": self.peak,
                                 "peak_tflops_source": self.peak_source, "world": self.par.world_size})
            epochs = math.ceil(self.total / self.sampler.steps_per_epoch)
            tqdm.write(f"{self.task}: {self.total} steps ({epochs} epoch{'s' * (epochs > 1)} of "
                       f"{self.sampler.steps_per_epoch} steps) of {rows_per_replica(self.args) * self.par.dp} x "
                       f"{self.args.seq_len} tokens; MFU against {self.peak} TFLOP/s per rank "
                       f"({self.peak_source}); starting at step {self.step}", file=sys.stdout)
        bar = tqdm(total=self.total, initial=self.step, desc=self.task, unit="step", file=sys.stderr,
                   dynamic_ncols=True, disable=not self.lead)
        interval = Interval(start=time.perf_counter())
        try:
            while self.step < self.total:
                interval = self.one_step(interval)
                bar.update(1)
                if self.args.stop_at_step == self.step:
                    break
        finally:
            bar.close()
        if self.lead:
            write_loss_plot(self.metrics.records(), os.path.join(out_dir(self.args), "loss.png"), title=self._title())

    def one_step(self, interval: Interval) -> Interval:
        args = self.args
        t0 = time.perf_counter()
        batch = self.next_batch()
        data_s = time.perf_counter() - t0
        self.step += 1
        lr = cosine_lr(self.step, self.total, args.learning_rate, args.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        stats = train_step(self.model, self.optimizer, self.groups, *batch, num_microbatches=args.num_microbatches,
                           schedule=args.pp_schedule, token_weighted_dp=True, grad_clip=args.grad_clip,
                           precision=self.precision, scaler=self.scaler)
        if stats.nonfinite:
            self.stop_not_finite(stats)
        interval.add(stats, data_s)
        last = self.step == self.total
        logged = self.step % args.log_interval == 0 or last
        if logged:
            self.log(interval, lr, stats.grad_norm)
        aside = time.perf_counter()   # evaluation and saving are not training time
        if self.heldout and ((args.eval_interval and self.step % args.eval_interval == 0) or last):
            self.evaluate()
        if args.save_dir and (self.step % args.save_interval == 0 or last or self.step == args.stop_at_step):
            self._save()
        if logged:
            return Interval(start=time.perf_counter())
        interval.start += time.perf_counter() - aside
        return interval

    def stop_not_finite(self, stats) -> None:
        """A step whose loss or grad norm is not finite (every rank knows): it was not taken, and the
        run stops before any save, so the last checkpoint is the last finite state."""
        loss, _ = world_token_mean(None if stats.loss is None else token_sum(stats.loss, stats.targets),
                                   stats.targets, self.groups)
        values = {"loss": loss, "grad norm": stats.grad_norm.item()}
        what = " and ".join(f"the {q} is {values[q]:g}" for q in stats.nonfinite)
        self.stop(f"step {self.step}: {what}, not finite: the step was not taken and nothing saved; {self.kept()}")

    def log(self, interval: Interval, lr: float, grad_norm: torch.Tensor) -> None:
        """A "train" record: collective (loss over the world, peak memory over the ranks)."""
        loss, _ = world_token_mean(interval.loss_sum, interval.targets, self.groups)
        aux = self.aux_mean(interval)
        peak = torch.tensor(float(peak_memory_bytes(self.device)), dtype=torch.float64, device=self.device)
        comm.all_reduce(peak, dist.group.WORLD, op=dist.ReduceOp.MAX)
        if not self.lead:
            return
        rates = interval_rates(steps=interval.steps, seconds=time.perf_counter() - interval.start,
                               data_seconds=interval.data_s, rows_per_replica=rows_per_replica(self.args),
                               dp=self.par.dp, seq_len=self.args.seq_len, ranks=self.par.world_size,
                               flops_per_token=self.flops_per_token, peak=self.peak)
        record = {"kind": "train", "step": self.step, "total_steps": self.total, "epoch": (self.step - 1) // self.sampler.steps_per_epoch,
                  "loss": loss, "lr": lr, "grad_norm": grad_norm.item(), **rates,
                  "peak_mem_mib": peak.item() / MIB, "time": time.time()}
        if aux is not None:
            record["aux_loss"] = aux
        self.metrics.append(record)
        tqdm.write(format_line(record), file=sys.stdout)

    def aux_mean(self, interval: Interval) -> float | None:
        """The MoE aux loss of the interval's steps, averaged over them and the DP replicas (None:
        a dense model). Collective over the world (MoE models only)."""
        if not self.config.use_moe:
            return None
        steps = torch.tensor(interval.steps, dtype=torch.float64, device=self.device)
        mean, _ = world_token_mean(interval.aux_sum, steps, self.groups)
        return mean

    def evaluate(self) -> None:
        loss, ppl = heldout_loss(self.model, self.groups, self.heldout, num_microbatches=self.args.num_microbatches,
                                 precision=self.precision)
        if self.lead:
            record = {"kind": "eval", "step": self.step, "eval_loss": loss, "eval_ppl": ppl, "time": time.time()}
            self.metrics.append(record)
            tqdm.write(format_eval(record), file=sys.stdout)


def run_rank(job: Job, device) -> int:
    """Train; a run stopped early tells the launcher (every node's first rank writes the job's
    report file, the ranks exit 0 and the launcher says it in one line), or without the launcher
    says it and exits 1."""
    try:
        Run(job, device).train()
    except RunStopped as e:
        if job.report is None:
            if dist.get_rank() == 0:
                print(f"error: {job.launch.task}: {e}", file=sys.stderr)
            return 1
        if first_on_node():
            with atomic_path(job.report) as tmp, open(tmp, "w") as f:
                json.dump({"stopped": str(e)}, f)
    return 0


TASK = Task(name="train", parser=parser, check=check, launch=launch_train, run_rank=run_rank)
