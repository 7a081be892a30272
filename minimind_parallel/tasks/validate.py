"""`validate` on every rank: compare the requested layout with the dense model, print the report."""
from __future__ import annotations

import torch.distributed as dist

from ..cli import apply_mode, model_config, parallel_config
from ..groups import ProcessGroups
from ..training import DTYPES
from ..validation import compare_with_dense, failures, format_report


def run_validate(launch, args, device) -> int:
    apply_mode(args, args.mode)
    config, par = model_config(args), parallel_config(launch, args)
    groups = ProcessGroups.build(par)
    dtype = DTYPES[args.dtype]
    rows = compare_with_dense(config, par, groups, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                              num_microbatches=args.num_microbatches, pp_schedule=args.pp_schedule,
                              dtype=dtype, lr=args.learning_rate, optimizer_steps=args.optimizer_steps,
                              log_interval=args.log_interval, check_backward=args.check_backward, seed=args.seed,
                              device=device, perturb=args.perturb, atol=args.atol, rtol=args.rtol)
    bad = failures(rows)
    if dist.get_rank() == 0:
        print(f"validate: dp={par.dp} pp={par.pp} schedule={args.pp_schedule} microbatches={args.num_microbatches} "
              f"tp={par.tp} sp={par.sequence_parallel} async={par.async_communication} "
              f"shared_gather={par.shared_sp_gather} vp={par.vocab_parallel} dtype={args.dtype} "
              f"layers={config.num_hidden_layers} seq={args.seq_len} steps={args.optimizer_steps}")
        print(format_report(rows))
        print(f"validate: {'FAILED' if bad else 'PASSED'} ({len(rows) - len(bad)} of {len(rows)} items within tolerance)")
    return 1 if bad else 0
