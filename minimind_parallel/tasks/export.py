"""`export`: a checkpoint of any layout as MiniMind's weight file or a Hugging Face folder.

    python -m evaluation.parallel export -- --checkpoint runs/tiny --format minimind --out runs/tiny/pretrain_128.pth
    python -m evaluation.parallel export -- --checkpoint runs/tiny --format hf --out runs/tiny/hf \\
        --tokenizer_path data/tokenizer

No ranks: the launcher process reads every saved shard into the dense state dict
(`checkpoint.read_dense_state`) and writes it with `interop.save_minimind_state_dict` (half
precision, both tied keys, as MiniMind's trainer writes) or `interop.export_hf` (config.json for
Qwen3, model.safetensors, the tokenizer files). An existing output is refused unless --overwrite.
The output line says whether the model is tied (the HF config's `tie_word_embeddings` says it too).
"""
from __future__ import annotations

import argparse
import os

import torch

from ..config import ConfigError, MiniMindConfig
from ..files import check_directory
from ..interop import dense_state_dict, export_hf, minimind_weight_name, save_minimind_state_dict
from ..interop.huggingface import EXPORT_DTYPES, check_export_folder, load_export_tokenizer
from ..job import Job, LaunchOptions, TaskOptions
from ..options import Parser, add_rope_scaling_arg, launcher_layout
from .task import Task
from .weights import add_checkpoint_arg, check_checkpoint, read_source

FORMATS = ("minimind", "hf")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="export", description="a checkpoint as MiniMind's .pth or a Hugging Face folder")
    add_checkpoint_arg(p, required=True)
    p.add_argument("--format", choices=FORMATS, required=True)
    add_rope_scaling_arg(p)   # --format hf: the config.json's rope_scaling
    p.add_argument("--out", required=True, help="minimind: a .pth file, or a folder to write "
                                                "{weight}_{hidden}.pth in; hf: a folder")
    p.add_argument("--weight", default="pretrain", help="minimind, --out a folder: the file's {weight} prefix")
    p.add_argument("--tokenizer_path", default=None, help="hf: the tokenizer folder whose files go with the model")
    p.add_argument("--dtype", choices=tuple(EXPORT_DTYPES), default=None,
                   help="hf: the weights' dtype (default float32); a MiniMind .pth is half precision")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return p


def minimind_path(args, config: MiniMindConfig) -> str:
    """--out, or MiniMind's file name in --out when it is a folder ({weight}_{hidden}[_moe].pth)."""
    if os.path.isdir(args.out):
        return os.path.join(args.out, minimind_weight_name(args.weight, config.hidden_size, config.use_moe))
    return args.out


def check_single_process(launch, task: str) -> None:
    """A task run by the launcher process alone takes no rank grid."""
    sizes = {"tp_size": launch.tp_size, "pp_size": launch.pp_size, "cp_size": launch.cp_size,
             "dp_size": launch.dp_size, "ep_size": launch.ep_size, "nnodes": launch.nnodes}
    given = {k: v for k, v in sizes.items() if v != 1}
    if given:
        raise ConfigError(f"{task} runs in one process and reads a checkpoint of any layout; got "
                          + ", ".join(f"--{k} {v}" for k, v in given.items()))


def check_out_parent(out: str) -> None:
    """ConfigError when --out cannot be made: a path above it is a file, or nothing can be created
    in the folder it goes in."""
    check_directory(f"--out {out}", os.path.dirname(os.path.abspath(out)))


def resolve(launch: LaunchOptions, args: argparse.Namespace, argv: tuple[str, ...]) -> Job:
    """No model arguments: the model is the checkpoint's, read when the task runs."""
    return Job(launch=launch, task=TaskOptions.of(args), model=None, parallel=launcher_layout(launch), argv=argv)


def check(job: Job) -> None:
    launch, args = job.launch, job.task
    check_single_process(launch, "export")
    check_out_parent(args.out)
    config = check_checkpoint(args.checkpoint)
    if args.format == "minimind":
        if args.dtype is not None or args.tokenizer_path is not None:
            raise ConfigError(f"--format minimind writes MiniMind's half-precision .pth (no tokenizer); got "
                              f"--dtype {args.dtype}, --tokenizer_path {args.tokenizer_path}")
        minimind_weight_name(args.weight, config.hidden_size, config.use_moe)
        path = minimind_path(args, config)
        if os.path.exists(path) and not args.overwrite:
            raise ConfigError(f"{path} already exists; pass --overwrite to replace it")
    else:
        if args.tokenizer_path is None:
            raise ConfigError("--format hf writes the tokenizer files with the model: give --tokenizer_path DIR")
        check_export_folder(args.out, args.overwrite)
        load_export_tokenizer(args.tokenizer_path, config)
    check_weights(args)


def export_dtype(args) -> torch.dtype:
    """The dtype the weights are written in: MiniMind's half precision, or the HF folder's --dtype."""
    return torch.float16 if args.format == "minimind" else EXPORT_DTYPES[args.dtype or "float32"]


def check_weights(args) -> None:
    """Read the checkpoint whole once before anything is written: every tensor finite, and finite in the
    dtype it is written in (ConfigError naming the tensor)."""
    config, dense = read_source(args, None)
    dense_state_dict(dense, config, source=args.checkpoint, dtype=export_dtype(args))


def launch_export(job: Job) -> int:
    """Read the checkpoint whole and write the export, here in the launcher process."""
    args = job.task
    config, dense = read_source(args, None)
    if args.format == "minimind":
        out = save_minimind_state_dict(dense, minimind_path(args, config), config=config,
                                       overwrite=args.overwrite)
    else:
        out = export_hf(dense, config, args.out, tokenizer_dir=args.tokenizer_path, overwrite=args.overwrite,
                        dtype=export_dtype(args))
    print(f"export: {args.format} {out} from {args.checkpoint} ({tying(config)})")
    return 0


def tying(config) -> str:
    """Which model the export holds: MiniMind's default class ties, so an untied one needs saying."""
    if config.tie_word_embeddings:
        return "tied: lm_head.weight is model.embed_tokens.weight, MiniMind's default"
    return "untied: lm_head.weight is its own matrix; MiniMind loads it with MiniMindConfig(tie_word_embeddings=False)"


def run_rank(job: Job, device) -> int:
    raise RuntimeError("export runs in the launcher process; it starts no ranks")


TASK = Task(name="export", parser=parser, resolve=resolve, check=check, launch=launch_export, run_rank=run_rank)
