"""The time model's pipeline bubble of 1F1B and ZB-H1 at the pp2 models whose idle docs/pipeline.md
measured (M 4, micro_batch_size 2, fp32, heads 8/4), beside ZB-H1's bubble with B and W taken equal,
at the uncalibrated CPU profile (`hardware.CPU_DEFAULT`) or a calibration file (docs/planning.md).

    PYTHONPATH=. python scripts/zb_bubble_predicted.py [--calibration FILE.json]
"""
from __future__ import annotations

import argparse

from minimind_parallel.config import MiniMindConfig
from minimind_parallel.pipeline_parallel.order import Schedule
from minimind_parallel.planning import Candidate, Workload, step_time
from minimind_parallel.planning.hardware import CPU_DEFAULT, load_calibration
from minimind_parallel.planning.time_model import weight_step_seconds

MODELS = ((4, 256, 128, False), (8, 512, 256, False), (4, 256, 128, True))   # L, H, S, MoE (E 4, top-2)


def row(hw, layers: int, hidden: int, seq: int, moe: bool) -> str:
    c = MiniMindConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                       vocab_size=1024, use_moe=moe, num_experts=4, num_experts_per_tok=2)
    w = Workload(model=c, seq_len=seq, global_batch_size=8, world_size=2, dtype="float32")
    cells = []
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE):
        k = Candidate(pp=2, num_microbatches=4, micro_batch_size=2, pp_schedule=schedule)
        t = step_time(k, w, hw, stage_params=10**6)
        cells.append(f"{t.total * 1e3:.1f} ms, bubble {100 * t.bubble / t.total:.1f} %")
    per_mb, bwd = t.parts["per_microbatch_ms"], t.parts["backward_ms"]
    equal = (k.pp - 1) * (per_mb - bwd)                       # B = W: (P - 1) x the forward and communication
    rest = t.total * 1e3 - t.bubble * 1e3
    weight = weight_step_seconds(c, k, w, hw, last=True) * 1e3
    return (f"| L{layers} H{hidden} S{seq}{' MoE' if moe else ''} | {cells[0]} | {cells[1]} | "
            f"{100 * equal / (rest + equal):.1f} % | {bwd:.2f} | {weight:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", help="a plan --calibrate file (default: the CPU profile)")
    hw = load_calibration(a) if (a := p.parse_args().calibration) else CPU_DEFAULT
    print("| model | 1F1B step, bubble | zb step, bubble | zb bubble at B = W | backward ms | of it W ms |")
    print("|---|---|---|---|---|---|")
    for m in MODELS:
        print(row(hw, *m))


if __name__ == "__main__":
    main()
