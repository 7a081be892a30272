"""`sft`: supervised fine-tuning of MiniMind-3 on conversations in any layout, with MiniMind's
semantics (jingyaogong/minimind: trainer/train_full_sft.py, dataset/lm_dataset.py's SFTDataset).

    python -m evaluation.parallel sft --tp_size 2 -- --data_path data/conversations.jsonl \\
        --tokenizer_path data/tokenizer --from_weight runs/tiny/pretrain_128.pth --sequence_parallel \\
        --save_dir runs/sft [--resume]

The `train` task with conversation rows (`--data_format conversations`, `data.sft`: the chat
template rendered, the loss only on the assistant's tokens, padded or truncated to --max_seq_len)
and MiniMind's SFT defaults: learning rate 1e-5, 2 epochs, batch 16, no accumulation, max_seq_len
768. Everything else is train's, shared rather than copied: the layouts, the launcher's checks,
the sampler, the step (`training.train_step` with `token_weighted_dp`: the loss is the mean over
the unmasked target tokens of the global batch, whose count differs per microbatch, CP rank and DP
replica; `loss_normalisation`), checkpoints and --resume, metrics, held-out loss.

--from_weight starts from MiniMind's pretrained weight file (`pretrain_{hidden}.pth`, what MiniMind's
`--from_weight pretrain` loads and `export --format minimind` writes) or from a checkpoint (or save
directory) of this project of the same model; without it the model starts from random weights.
"""
from __future__ import annotations

import argparse

from ..data.feed import DataFormat
from . import train
from .task import Task


def parser() -> argparse.ArgumentParser:
    p = train.parser()
    p.prog = "sft"
    p.description = "fine-tune MiniMind-3 on conversations (MiniMind's train_full_sft.py)"
    p.set_defaults(data_format=DataFormat.CONVERSATIONS, learning_rate=1e-5, epochs=2, micro_batch_size=16,
                   num_microbatches=1, seq_len=768)
    return p


TASK = Task(name="sft", parser=parser, check=train.check, launch=train.launch_train, run_rank=train.run_rank)
