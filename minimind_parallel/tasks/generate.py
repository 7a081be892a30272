"""`generate`: text in, text out, from a checkpoint of any layout or MiniMind's weight file.

    python -m evaluation.parallel generate [--tp_size T] -- (--checkpoint DIR | --from_weight PATH.pth) \\
        --tokenizer_path DIR --prompt TEXT --max_new_tokens N [--temperature 0 --top_p 1 --seed=0]

Greedy at temperature 0, else temperature + top-p sampling, with a KV cache (`generation.py`). With
--tp_size 1 the launcher process runs the dense model; with T > 1 it starts T ranks under torchrun,
each holding its TP shard of the same weights (`parallel_generation.py`), and rank 0 prints. The
model is the checkpoint's (its saved config) or, for a .pth, the one the model arguments describe.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from ..config import DTYPES, check_layout
from ..data.tokenizer import load_tokenizer
from ..generation import check_generation_args, generate, new_text, prompt_ids
from ..groups import ProcessGroups
from ..job import Job
from ..model import MiniMindForCausalLM
from ..options import Parser, add_model_args, check_world, collective_timeout, resolve_device
from ..parallel_generation import build_generation_model, check_generation_layout, generate_parallel, generation_layout
from .task import Task, launch_once
from .weights import add_source_args, check_source, read_source, trained_length


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="generate", description="generate text from a checkpoint or MiniMind weights")
    add_model_args(p)   # the model of --from_weight (a checkpoint carries its own)
    p.add_argument("--num_hidden_layers", type=int, default=8)
    add_source_args(p)
    p.add_argument("--tokenizer_path", required=True, help="directory with MiniMind's tokenizer.json")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_p", type=float, default=1.0, help="sample from the smallest set of tokens of this mass")
    p.set_defaults(seed=0, tie_word_embeddings=True)  # MiniMind's default (--no-tie_word_embeddings: two matrices)
    return p


def _prompt(args, config):
    """(tokenizer, bos + the prompt's ids)."""
    tok = load_tokenizer(args.tokenizer_path)
    return tok, prompt_ids(tok, args.prompt, vocab_size=config.vocab_size)


def check(job: Job) -> None:
    launch, args = job.launch, job.task
    check_generation_layout(job.parallel)
    config = check_source(args, job.model)
    _, ids = _prompt(args, config)
    check_layout(config, generation_layout(launch.tp_size))
    check_generation_args(prompt_len=len(ids), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, max_position_embeddings=config.max_position_embeddings)
    check_world(launch, launch.tp_size, args.dtype)
    note_trained_length(len(ids), args.max_new_tokens, trained_length(args))


def note_trained_length(prompt_len: int, max_new_tokens: int, trained: int | None) -> None:
    """One line on stderr when the text runs past the length the model was trained on (it still runs:
    RoPE has the positions, but the model never learned them)."""
    if trained is not None and prompt_len + max_new_tokens > trained:
        print(f"generate: note: bos + prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
              f"{prompt_len + max_new_tokens} positions, beyond the {trained} the model was trained on "
              f"(train --max_seq_len {trained}); the text past position {trained} is extrapolation",
              file=sys.stderr)


def sample_args(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def generate_dense(job: Job, device) -> list[int]:
    """The new token ids (eos included when drawn) from the dense model in this process."""
    args = job.task
    config, dense = read_source(args, job.model)
    model = MiniMindForCausalLM(config)
    model.load_state_dict(dense, strict=True)
    model = model.to(device=device, dtype=DTYPES[args.dtype]).eval()
    tok, ids = _prompt(args, config)
    out = generate(model, torch.tensor([ids]), eos_id=tok.eos_id, **sample_args(args))
    return out[0, len(ids):].tolist()


def generate_on_rank(job: Job, device) -> list[int]:
    """The new token ids from this TP rank's shard (every rank returns the same ids)."""
    launch, args = job.launch, job.task
    config, dense = read_source(args, job.model)
    groups = ProcessGroups.build(generation_layout(launch.tp_size), timeout=collective_timeout(launch))
    model = build_generation_model(config, groups, dense, dtype=DTYPES[args.dtype], device=device)
    tok, ids = _prompt(args, config)
    out = generate_parallel(model, torch.tensor([ids]), eos_id=tok.eos_id, **sample_args(args))
    return out[0, len(ids):].tolist()


def show(args, new_ids: list[int]) -> None:
    """The prompt and its continuation, as text."""
    print(args.prompt + new_text(load_tokenizer(args.tokenizer_path), new_ids))
    sys.stdout.flush()


def launch_generate(job: Job) -> int:
    """One rank: here, on the dense model; T ranks: one torchrun job of the TP model."""
    if job.launch.tp_size > 1:
        return launch_once(job)
    show(job.task, generate_dense(job, torch.device(resolve_device(job.launch))))
    return 0


def run_rank(job: Job, device) -> int:
    new_ids = generate_on_rank(job, device)
    if dist.get_rank() == 0:
        show(job.task, new_ids)
    return 0


TASK = Task(name="generate", parser=parser, check=check, launch=launch_generate, run_rank=run_rank)
