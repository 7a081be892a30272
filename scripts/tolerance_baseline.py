"""The dense model's own round-off: the baseline the validation tolerances are stated from.

Runs what `validation.compare_with_dense` runs on the dense side (the same seeds, batch, AdamW
steps), once in --dtype (float32, bfloat16, float16) and once in float64 from the same weights,
and prints the worst relative-L2 and max-abs error against float64 per kind of item:

    forward + grads   step 0 logits and loss, every gradient
    later steps       logits and loss after 1..N AdamW steps
    params            every parameter after N AdamW steps

A parallel layout in float32 computes the same function with other reduction orders: it is about
as far from float64 as the dense float32 model is, so from the dense float32 model at most about
twice that. The float32 entries of `validation.DEFAULT_TOL` (forward + grads) and `PARAM_RTOL`
(params) are 10x these numbers, rounded to one digit. float16 AdamW steps give NaN (eps 1e-8
underflows): the launcher refuses them.

    python scripts/tolerance_baseline.py [--dtype float32] [--seeds 7 1234] [--steps 5]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from minimind_parallel import MiniMindConfig
from minimind_parallel.config import DTYPES
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.training import make_optimizer
from minimind_parallel.data.batches import IGNORE_INDEX, random_batch
from minimind_parallel.validation import error

CONFIGS = {  # the test suite's equivalence and pipeline configurations
    "equivalence": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                        vocab_size=128),
    "pipeline": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                     vocab_size=128),
}


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def trajectory(model, ids, targets, steps: int, lr: float) -> dict:
    """{item: tensor} of the dense model's run: logits/loss every step, grads at step 0, params at the end."""
    out, opt = {}, make_optimizer(model, lr)
    for step in range(steps + 1):
        if step:
            opt.step()
            opt.zero_grad(set_to_none=True)
        logits = model(ids).logits
        loss = loss_of(logits, targets)
        loss.backward()
        out[f"step {step} logits"], out[f"step {step} loss"] = logits.detach(), loss.detach()
        if step == 0:
            out.update({f"grad {n}": p.grad.clone() for n, p in model.named_parameters()})
    out.update({f"param {n}": p.detach().clone() for n, p in model.named_parameters()})
    return out


def larger(a: float, b: float) -> float:
    """max, with NaN the largest."""
    return a if (a != a or a >= b) else b


def kind(item: str) -> str:
    if item.startswith("param"):
        return "params"
    if item.startswith("grad") or item.startswith("step 0 "):
        return "forward + grads"
    return "later steps"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[7, 1234])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    a = p.parse_args(argv)
    dtype = DTYPES[a.dtype]
    worst: dict[str, tuple[float, float, str]] = {}
    for name, sizes in CONFIGS.items():
        for tied in (False, True):
            for seed in a.seeds:
                for rows in (2, 4, 8):
                    torch.manual_seed(seed)
                    low = MiniMindForCausalLM(MiniMindConfig(**sizes, tie_word_embeddings=tied))
                    f64 = MiniMindForCausalLM(MiniMindConfig(**sizes, tie_word_embeddings=tied)).double()
                    f64.load_state_dict(low.state_dict())
                    low = low.to(dtype)
                    ids, targets = random_batch(seed + 1, rows, 16, sizes["vocab_size"])
                    got, want = (trajectory(m, ids, targets, a.steps, a.lr) for m in (low, f64))
                    for item in got:
                        max_abs, rel = error(got[item], want[item])
                        k = kind(item)
                        old = worst.get(k, (0.0, 0.0, ""))
                        worse = rel != rel or rel > old[1]  # NaN (e.g. float16 AdamW) counts as the worst
                        worst[k] = (larger(max_abs, old[0]), larger(rel, old[1]),
                                    f"{name} tied={tied} seed={seed} rows={rows} {item}" if worse else old[2])
    print(f"{'dense ' + a.dtype + ' vs float64':<18}{'max-abs':>11}{'rel-L2':>11}  worst rel-L2 at")
    for k in ("forward + grads", "later steps", "params"):
        max_abs, rel, where = worst[k]
        print(f"{k:<18}{max_abs:>11.2e}{rel:>11.2e}  {where}")


if __name__ == "__main__":
    main()
