"""`generate`: text in, text out, from a checkpoint of any layout or MiniMind's weight file.

    python -m evaluation.parallel generate [--tp_size T] -- (--checkpoint DIR | --from_weight PATH.pth) \\
        --tokenizer_path DIR --prompt TEXT --max_new_tokens N [--temperature 0 --top_p 1 --seed=0]
        [--chat [--system TEXT] | --interactive]

`--chat` asks the prompt as the user's turn of a conversation (and `--system` as its system turn),
rendered with the tokenizer's chat template up to the assistant's generation prompt, and prints
only the answer, generated until `<|im_end|>` (MiniMind's eval_llm.py). `--interactive` is a chat
that keeps the conversation: each line read is the next user turn, answered with the whole
conversation as the prompt; Ctrl-D or Ctrl-C ends it (exit 0). It runs in the launcher's process
(--tp_size 1).

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

from .. import processes
from ..config import DTYPES, ConfigError, check_layout
from ..data.chat import ChatTemplate
from ..data.tokenizer import load_tokenizer
from ..generation import chat_prompt_ids, check_generation_args, generate, new_text, prompt_ids
from ..groups import ProcessGroups
from ..job import Job
from ..model import MiniMindForCausalLM
from ..options import Parser, add_model_args, add_rope_scaling_arg, check_world, collective_timeout, resolve_device
from ..parallel_generation import build_generation_model, check_generation_layout, generate_parallel, generation_layout
from .task import Task, launch_once
from .weights import add_source_args, check_source, read_source, trained_length


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="generate", description="generate text from a checkpoint or MiniMind weights")
    add_model_args(p)   # the model of --from_weight (a checkpoint carries its own)
    p.add_argument("--num_hidden_layers", type=int, default=8)
    add_source_args(p)
    add_rope_scaling_arg(p)
    p.add_argument("--tokenizer_path", required=True, help="directory with MiniMind's tokenizer.json")
    p.add_argument("--prompt", default=None, help="the text to continue (--chat: the user's question)")
    p.add_argument("--chat", action="store_true",
                   help="ask --prompt as a user turn in the tokenizer's chat template; print only the answer")
    p.add_argument("--system", default=None, help="--chat: the conversation's system turn")
    p.add_argument("--interactive", action="store_true",
                   help="a chat that keeps the conversation, a user turn per line read (Ctrl-D / Ctrl-C ends it)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_p", type=float, default=1.0, help="sample from the smallest set of tokens of this mass")
    p.set_defaults(seed=0, tie_word_embeddings=True)  # MiniMind's default (--no-tie_word_embeddings: two matrices)
    return p


def chatting(args) -> bool:
    return args.chat or args.interactive


def conversation_start(args) -> list[dict]:
    """The messages before the first user turn: the system turn, when --system gives one."""
    return [] if args.system is None else [{"role": "system", "content": args.system}]


def _prompt(args, config, messages: list[dict] | None = None):
    """(tokenizer, bos + the prompt's ids); with --chat, the conversation's ids up to the assistant's
    turn (`messages`, else the system turn and --prompt as the user's)."""
    tok = load_tokenizer(args.tokenizer_path)
    if not chatting(args):
        return tok, prompt_ids(tok, args.prompt, vocab_size=config.vocab_size)
    if messages is None:
        messages = conversation_start(args) + [{"role": "user", "content": args.prompt or ""}]
    return tok, chat_prompt_ids(tok, ChatTemplate.of_tokenizer(args.tokenizer_path), messages,
                                vocab_size=config.vocab_size)


def check_mode(args, tp_size: int) -> None:
    if args.interactive and tp_size > 1:
        raise ConfigError(f"--interactive reads the conversation in the launcher's process: run it with --tp_size 1; "
                          f"got --tp_size {tp_size}")
    if args.prompt is None and not args.interactive:
        raise ConfigError("give --prompt TEXT (or --interactive for a conversation)")
    if args.system is not None and not chatting(args):
        raise ConfigError(f"--system is the system turn of a chat: add --chat; got --system {args.system!r}")


def check(job: Job) -> None:
    launch, args = job.launch, job.task
    check_generation_layout(job.parallel)
    check_mode(args, launch.tp_size)
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
              f"(train --max_seq_len {trained}); the text past position {trained} is extrapolation "
              f"(--inference_rope_scaling: YaRN, as MiniMind's)",
              file=sys.stderr)


def sample_args(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def dense_model(job: Job, device) -> MiniMindForCausalLM:
    config, dense = read_source(job.task, job.model)
    model = MiniMindForCausalLM(config)
    model.load_state_dict(dense, strict=True)
    return model.to(device=device, dtype=DTYPES[job.task.dtype]).eval()


def generate_dense(job: Job, device, model: MiniMindForCausalLM | None = None,
                   messages: list[dict] | None = None) -> list[int]:
    """The new token ids (eos included when drawn) from the dense model in this process (`messages`:
    the conversation so far, with --chat)."""
    args = job.task
    model = dense_model(job, device) if model is None else model
    tok, ids = _prompt(args, model.config, messages)
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
    """The prompt and its continuation, as text; with --chat the answer alone."""
    text = new_text(load_tokenizer(args.tokenizer_path), new_ids)
    print(text if chatting(args) else args.prompt + text)
    sys.stdout.flush()


def interactive(job: Job, device, read=input) -> int:
    """A conversation on the dense model: each line `read` is a user turn (--prompt, when given, the
    first), answered with the whole conversation so far as the prompt; ends at end of input (Ctrl-D)
    or on Ctrl-C, with exit 0 and nothing left running."""
    args = job.task
    model, tok = dense_model(job, device), load_tokenizer(args.tokenizer_path)
    messages = conversation_start(args)
    pending = args.prompt
    try:
        while True:
            question = pending if pending is not None else read("> ")
            pending = None
            messages.append({"role": "user", "content": question})
            answer = new_text(tok, generate_dense(job, device, model, messages))
            messages.append({"role": "assistant", "content": answer})
            print(answer, flush=True)
    except (EOFError, KeyboardInterrupt, processes.Interrupted):
        print(flush=True)
        return 0


def launch_generate(job: Job) -> int:
    """One rank: here, on the dense model; T ranks: one torchrun job of the TP model."""
    device = torch.device(resolve_device(job.launch))
    if job.task.interactive:
        return interactive(job, device)
    if job.launch.tp_size > 1:
        return launch_once(job)
    show(job.task, generate_dense(job, device))
    return 0


def run_rank(job: Job, device) -> int:
    new_ids = generate_on_rank(job, device)
    if dist.get_rank() == 0:
        show(job.task, new_ids)
    return 0


TASK = Task(name="generate", parser=parser, check=check, launch=launch_generate, run_rank=run_rank)
