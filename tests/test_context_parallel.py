"""Context parallelism in the whole model: every comm type (all_gather, a2a, ring), load-balanced,
gives the dense model's numbers (logits of each CP rank's tokens, the global loss, every
gradient, AdamW steps) alone (cp2, cp4) and with TP + SP + async + VP, DP, PP (1F1B) and
TP x PP; the contiguous split too; bad CP input is refused before launch with one line.

The layouts of one world size run in one `run_ranks` launch (the suite's time is mostly forking)."""
import pytest

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel import validation
from minimind_parallel.context_parallel import COMM_TYPES, ContextLayout
from minimind_parallel.validation import compare_with_dense, failures, format_report
from test_cli import assert_refused_before_launch

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=128)
SP_ASYNC_VP = dict(sequence_parallel=True, async_communication=True, vocab_parallel=True)

# name -> (layout, validate options); every one for each comm type
LAYOUTS = {
    "cp2": (dict(cp=2), dict()),
    "cp4": (dict(cp=4), dict()),
    "tp2_cp2_sp_async_vp": (dict(tp=2, cp=2, **SP_ASYNC_VP), dict()),
    "dp2_cp2": (dict(dp=2, cp=2), dict()),
    "pp2_cp2_1f1b_tied": (dict(pp=2, cp=2), dict(micro_batch_size=1, num_microbatches=4, tied=True)),
    "tp2_cp2_pp2_sp_async_shared_vp": (dict(tp=2, cp=2, pp=2, shared_sp_gather=True, **SP_ASYNC_VP),
                                       dict(micro_batch_size=1, num_microbatches=4)),
}


def _validate(cases):
    """[(name, ParallelConfig, options)] of this world size -> {name: rows} (worst over ranks)."""
    out = {}
    for name, par, opts in cases:
        opts = dict(opts)
        config = MiniMindConfig(**TINY, tie_word_embeddings=opts.pop("tied", False))
        out[name] = compare_with_dense(config, par, ProcessGroups.build(par), seq_len=32,
                                       micro_batch_size=opts.pop("micro_batch_size", 2),
                                       optimizer_steps=2, seed=7, **opts)
    return out


def cases(world: int, comm_types=COMM_TYPES, load_balance=True):
    return [(f"{name} {comm}", ParallelConfig(**sizes, cp_comm_type=comm, cp_load_balance=load_balance), opts)
            for name, (sizes, opts) in LAYOUTS.items() for comm in comm_types
            if ParallelConfig(**sizes).world_size == world]


def assert_each_matches_dense(world: int, **kw):
    todo = cases(world, **kw)
    results = run_ranks(_validate, world, todo, timeout=900)[0]
    assert sorted(results) == sorted(name for name, _, _ in todo)
    for name, rows in results.items():
        items = {r.item for r in rows}
        assert {"step 0 loss", "step 0 logits", "grad model.layers.1.self_attn.k_proj.weight",
                "param model.layers.0.self_attn.q_proj.weight after 2 steps"} <= items, name
        bad = failures(rows)
        assert not bad, f"{name}\n" + format_report(bad)
        # the forward and the gradients at float32 round-off (later steps: Adam's sign effect, see validation.py)
        first = [r for r in rows if r.item.startswith(("step 0", "grad"))]
        assert max(r.rel_l2 for r in first) < 2e-6, f"{name}\n" + format_report(first)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_comm_type_load_balanced_matches_dense_in_every_layout(world):
    assert_each_matches_dense(world)


def test_contiguous_split_matches_dense_too():
    assert_each_matches_dense(2, load_balance=False)


def test_a_misplaced_token_is_caught():
    """The check can fail: CP rank 1 holding the wrong chunks (the contiguous split's tokens fed
    where the balanced layout's positions are used) does not match the dense model."""
    par = ParallelConfig(cp=2, cp_comm_type="ring")
    rows = run_ranks(_mismatched, 2, par)[0]
    assert failures(rows)


def _mismatched(par):
    original = validation.cp_tokens

    def wrong(batch, layout, cp_rank):  # the tokens of the contiguous split, positions of the balanced one
        return original(batch, ContextLayout(seq_len=layout.seq_len, cp=layout.cp, load_balance=False), cp_rank)

    validation.cp_tokens = wrong        # this rank process only
    return compare_with_dense(MiniMindConfig(**TINY), par, ProcessGroups.build(par), seq_len=32, micro_batch_size=1,
                              optimizer_steps=0, seed=7)


CP = ["validate", "--cp", "--cp_size", "2"]
BAD = [
    (CP + ["--", "--seq_len", "30"], "seq_len must be divisible by 4: 4 chunks (2 x cp_size)"),
    (["validate", "--tp_size", "2", "--cp", "--cp_size", "2", "--", "--seq_len", "36", "--sequence_parallel"],
     "seq_len must be divisible by 8: 4 chunks (2 x cp_size) x tp_size=2 under --sequence_parallel"),
    (CP + ["--", "--seq_len", "34", "--cp_comm_type", "ring"], "seq_len must be divisible by 4"),
    (CP + ["--", "--seq_len", "33", "--no-cp_load_balance"],
     "seq_len must be divisible by 2: 2 chunks (cp_size, no load balance)"),
    (["validate", "--cp", "--cp_size", "4", "--", "--num_key_value_heads", "2", "--cp_comm_type", "a2a"],
     "--cp_comm_type a2a needs the query and kv heads of each TP rank divisible by cp_size"),
    (["validate", "--tp_size", "2", "--cp", "--cp_size", "4", "--", "--cp_comm_type", "a2a"],
     "got 4 query and 2 kv heads per TP rank"),
    (["validate", "--cp_size", "2", "--"], "--cp_size 2 needs --cp"),
    (["validate", "--", "--mode", "cp"], "mode cp is context-parallel and needs --cp"),
    (["benchmark", "--tp_size", "2", "--", "--modes", "tp", "tp_cp", "--estimate"], "mode tp_cp"),
    (CP + ["--", "--cp_comm_type", "p2p"], "invalid choice: 'p2p'"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m for _, m in BAD])
def test_bad_context_parallel_input_is_one_line_and_launches_nothing(argv, message, monkeypatch, capsys):
    assert_refused_before_launch(argv, message, monkeypatch, capsys)
