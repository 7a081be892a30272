"""The calibration's fit of a CPU step (planning/step_costs.py): a factor on the isolated rates and
three host costs, each the rate of a count the time model makes of a step -- its work, the
dispatched ops, the collectives, FSDP2's all-gathers and reduce-scatters -- fitted back from steps
predicted at known values; each count the one the real calls have (the collectives checked against
the real calls in tests/test_collective_counts.py, FSDP2's at its hooks in tests/test_planning.py).
All in this process: no ranks."""
from dataclasses import replace

import numpy as np
import pytest

from minimind_parallel.config import MiniMindConfig
from minimind_parallel.planning import Hardware, Link
from minimind_parallel.planning.ranking import evaluate, model_flops_per_token
from minimind_parallel.planning.step_costs import (FIT_LAYOUTS, IN_STEP_LAYERS, TERMS, cost_rows, fit_costs,
                                                   fit_workload, nonnegative_least_squares, with_costs)
from minimind_parallel.planning.time_model import collectives_of_step, fsdp_collectives_per_microbatch

MODEL = MiniMindConfig(hidden_size=64, num_hidden_layers=IN_STEP_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=128)
SEQ, DTYPE = 32, "float32"
CPU = Hardware(name="test", source="hand-checked", gemm_flops=1e11, attention_flops=3e10, memory_bandwidth=1e10,
               op_overhead_s=0.0, peak_flops=1e11, intra=Link(latency_s=5e-5, bandwidth=1e9),
               inter=Link(latency_s=5e-5, bandwidth=1e9), async_dispatch=False, overlaps_communication=False,
               blockwise_attention_flops=1e10)
ZERO3 = next(k for k in FIT_LAYOUTS if k.zero == 3)


def _step(hw: Hardware, k) -> float:
    w = fit_workload(MODEL, SEQ, k, DTYPE)
    return evaluate(k, w, hw, "cpu", model_flops_per_token(w)).time.total


def _fitted(hw: Hardware) -> tuple:
    return (CPU.gemm_flops / hw.gemm_flops, hw.op_overhead_s, hw.intra.call_s, hw.fsdp_collective_s)


def test_the_work_scale_and_host_costs_are_fitted_back_from_steps_predicted_at_them():
    """Steps predicted at known values give those values back (every rate divided by the one scale);
    the fit's rows are the model's counts: a call's cost once per collective of the step, FSDP2's once
    per its 3 L + 2 collectives, the work's the step's work at the isolated rates."""
    known = (1.7, 7e-6, 9e-4, 3e-4)
    measured = [_step(with_costs(CPU, *known), k) for k in FIT_LAYOUTS]
    fitted, fit = fit_costs(CPU, MODEL, SEQ, DTYPE, measured)
    assert _fitted(fitted) == pytest.approx(known, rel=1e-6)
    assert fitted.inter.call_s == fitted.intra.call_s
    assert fitted.memory_bandwidth == pytest.approx(CPU.memory_bandwidth / known[0])
    assert fitted.blockwise_attention_flops == pytest.approx(CPU.blockwise_attention_flops / known[0])
    for k, m in zip(FIT_LAYOUTS, measured):
        assert _step(fitted, k) == pytest.approx(m, rel=1e-9)
        assert fit["fitted_steps"][k.describe()]["measured_ms"] == pytest.approx(1e3 * m, abs=1e-3)
    t_link, a = cost_rows(CPU, MODEL, SEQ, DTYPE)
    work, op, call, fsdp = (TERMS.index(t) for t in TERMS)
    for k, row, base in zip(FIT_LAYOUTS, a, t_link):
        w = fit_workload(MODEL, SEQ, k, DTYPE)
        assert row[fsdp] == pytest.approx(fsdp_collectives_per_microbatch(IN_STEP_LAYERS) if k == ZERO3 else 0)
        if k != ZERO3:     # (collectives_of_step lists ZeRO 1/2's buckets; zero 3's are FSDP2's)
            assert row[call] == pytest.approx(len(collectives_of_step(k, w, stage_params=1)))
        assert row[work] + base == pytest.approx(_step(CPU, k)) and row[op] > 0
    assert a[FIT_LAYOUTS.index(ZERO3), call] == pytest.approx(fsdp_collectives_per_microbatch(IN_STEP_LAYERS))


def test_a_term_the_steps_would_make_negative_is_zero_and_the_rest_fit_the_steps():
    """Steps all link (no work, no op) give no negative term: the nonnegative least squares keeps the
    others as the unconstrained fit of their columns would."""
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nonnegative_least_squares(a, np.array([2.0, 3.0, 5.0])) == pytest.approx([2.0, 3.0])
    assert nonnegative_least_squares(a, np.array([-1.0, 3.0, 2.0])) == pytest.approx([0.0, 2.5])
    measured = [_step(with_costs(CPU, 0.0, 0.0, 2e-3, 0.0), k) for k in FIT_LAYOUTS]
    assert _fitted(fit_costs(CPU, MODEL, SEQ, DTYPE, measured)[0]) == pytest.approx((0.0, 0.0, 2e-3, 0.0), abs=1e-12)


def test_fsdp2s_host_cost_is_paid_once_per_its_collective_and_a_gpu_profile_has_none():
    """--zero 3's step grows by FSDP2's collectives x fsdp_collective_s (3 L + 2 per microbatch: the
    blocks gathered twice and scattered once, the root once each), and no other layout's does."""
    per = 1e-3
    for k in FIT_LAYOUTS:
        grown = _step(replace(CPU, fsdp_collective_s=per), k) - _step(CPU, k)
        assert grown == pytest.approx(per * fsdp_collectives_per_microbatch(IN_STEP_LAYERS) if k == ZERO3 else 0,
                                      abs=1e-12)
    from minimind_parallel.planning.hardware import GPU_PROFILES
    assert all(p.fsdp_collective_s == 0 for p in GPU_PROFILES.values())
