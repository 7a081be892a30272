"""Expert parallelism in the whole MoE model: every layout gives the dense MoE model's numbers
(logits, the LM loss and the aux loss over the global batch, every gradient -- each rank's experts
against the same experts of the dense model -- and AdamW steps): ep4, dp2 x ep2, tp2 x ep2 (SP,
async, VP), pp2 x ep2 (1F1B, two microbatches: the aux loss of each, as MiniMind's gradient
accumulation), cp2 x ep2 (ring) and tp2 x pp2 x ep2; MiniMind's per-replica aux loss
(--moe_aux_loss local) equals the mean of the dense model's over each replica's rows.

The layouts of one world size run in one `run_ranks` launch (the suite's time is mostly forking)."""
import pytest

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.validation import compare_with_dense, failures, format_report

# 4 experts, top-2: with 2 x 16 tokens per rank every expert sees tokens on every rank
TINY_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=128,
                use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                router_aux_loss_coef=0.1)   # MiniMind's 5e-4 would hide an aux-loss gradient in round-off
SP_ASYNC_VP = dict(sequence_parallel=True, async_communication=True, vocab_parallel=True)

# name -> (layout, validate options); 4 ranks but one, in two launches
LAYOUTS = {
    "ep4": (dict(dp=4, ep=4), dict()),
    "dp2_ep2": (dict(dp=4, ep=2), dict()),
    "dp2_cp2_ep2_ring": (dict(dp=2, cp=2, ep=2, cp_comm_type="ring"), dict()),   # EP over each replica's CP pair
    "tp2_ep2_sp_async_vp": (dict(tp=2, dp=2, ep=2, **SP_ASYNC_VP), dict()),
    "pp2_ep2_1f1b_tied": (dict(pp=2, dp=2, ep=2), dict(micro_batch_size=1, num_microbatches=2, tied=True)),
    # MiniMind's per-replica aux loss: the mean of the dense model's over each replica's rows
    "dp2_ep2_local_aux": (dict(dp=4, ep=2, moe_aux_loss="local"), dict()),
    "tp2_pp2_ep2_sp": (dict(tp=2, pp=2, dp=2, ep=2, sequence_parallel=True), dict(micro_batch_size=1,
                                                                                   num_microbatches=2)),
}


def _validate(cases):
    """[(name, ParallelConfig, options)] of this world size -> {name: rows} (worst over ranks)."""
    out = {}
    for name, par, opts in cases:
        opts = dict(opts)
        config = MiniMindConfig(**TINY_MOE, tie_word_embeddings=opts.pop("tied", False))
        out[name] = compare_with_dense(config, par, ProcessGroups.build(par), seq_len=16,
                                       micro_batch_size=opts.pop("micro_batch_size", 2),
                                       optimizer_steps=2, seed=7, **opts)
    return out


def cases(world: int):
    return [(name, ParallelConfig(**sizes), opts) for name, (sizes, opts) in LAYOUTS.items()
            if ParallelConfig(**sizes).world_size == world]


@pytest.mark.parametrize("world", [4, 8])
def test_every_expert_parallel_layout_matches_the_dense_moe_model(world):
    todo = cases(world)
    results = run_ranks(_validate, world, todo, timeout=1200)[0]
    assert sorted(results) == sorted(name for name, _, _ in todo)
    for name, rows in results.items():
        items = {r.item for r in rows}
        assert {"step 0 loss", "step 0 aux loss", "step 0 logits", "grad model.layers.1.mlp.gate.weight",
                "grad model.layers.0.mlp.experts.3.down_proj.weight",
                "param model.layers.1.mlp.experts.0.up_proj.weight after 2 steps"} <= items, name
        bad = failures(rows)
        assert not bad, f"{name}\n" + format_report(bad)
        first = [r for r in rows if r.item.startswith(("step 0", "grad"))]
        assert max(r.rel_l2 for r in first) < 2e-6, f"{name}\n" + format_report(first)
