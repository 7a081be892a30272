"""The numbers a person reads of a training run. The held-out loss is the dense model's mean over
every target token of the held-out rows, in float64 to round-off, whatever the layout:
data-parallel replicas and context-parallel ranks hold different numbers of targets (rows
padded after different lengths, -100 targets spread unevenly over the ranks), and batches of
different target counts weigh by their counts. Tokens/s counts every replica's rows and MFU
every rank; a train run at dp 2 logs both, and its held-out loss is the dense model's."""
import math

import numpy as np

import pytest
import torch

from distributed import run_ranks
from minimind_parallel import cli
from minimind_parallel.config import MiniMindConfig, ParallelConfig
from minimind_parallel.context_parallel import ContextLayout
from minimind_parallel.data.feed import Rows, open_dataset
from minimind_parallel.data.tokenizer import load_tokenizer
from minimind_parallel.data.batches import IGNORE_INDEX, Batch, count_targets, cp_tokens, dp_rows, shift_labels
from minimind_parallel.groups import ProcessGroups
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.options import model_config
from minimind_parallel.training import build_parallel_model, wrap_data_parallel
from minimind_parallel.training.heldout import heldout_loss
from minimind_parallel.training.metrics import interval_rates, model_flops_per_token
from minimind_parallel.training.mixed_precision import Precision
from test_train import corpus, data_args, records, train_in_ranks  # noqa: F401  (corpus: the fixture)

SEQ, VOCAB, ROWS = 16, 64, 4
# Target tokens per row of each held-out batch: the batches, the DP replicas (rows 0-1 / 2-3) and the
# CP ranks (load-balanced chunks 0+3 / 1+2 of 4 tokens) all hold different counts.
LENGTHS = ([SEQ, 3, 9, 2], [5, 13, 16, 7])


def padded_batch(lengths: list[int], seed: int) -> Batch:
    """Rows of `lengths` real tokens, then padding whose labels are -100 (MiniMind's), shifted once."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), SEQ), generator=g)
    labels = ids.clone()
    for r, n in enumerate(lengths):
        ids[r, n:] = 0
        labels[r, n:] = IGNORE_INDEX
    return Batch(ids, shift_labels(labels))


def _heldout(par: ParallelConfig):
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)
    config = MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=VOCAB, intermediate_size=64, tie_word_embeddings=False)
    dense = MiniMindForCausalLM(config).double()
    model = wrap_data_parallel(build_parallel_model(config, par, groups, dense.state_dict(), dtype=torch.float64),
                               groups)
    batches = [padded_batch(lengths, seed) for seed, lengths in enumerate(LENGTHS)]
    layout = ContextLayout.of(par, SEQ)
    mine = [cp_tokens(dp_rows(b, groups.dp_rank, par.dp), layout, groups.cp_rank) for b in batches]
    loss, ppl = heldout_loss(model, groups, mine, num_microbatches=1,
                             precision=Precision.of("pure", torch.float64, "cpu"))
    every_row = Batch(*(torch.cat(t) for t in zip(*batches)))
    with torch.no_grad():
        dense_loss = dense(every_row.input_ids, targets=every_row.targets).loss.item()    # the mean over all targets of both batches at once
    counts = [int(count_targets(b.targets)) for b in mine]   # this rank's targets of each batch
    return loss, ppl, dense_loss, counts


@pytest.mark.parametrize("par", [ParallelConfig(dp=2), ParallelConfig(cp=2),
                                 ParallelConfig(dp=2, cp=2, cp_comm_type="ring")],
                         ids=["dp2", "cp2", "dp2_cp2_ring"])
def test_the_heldout_loss_is_the_dense_token_mean_over_unevenly_padded_ranks(par):
    results = run_ranks(_heldout, par.world_size, par)
    for loss, ppl, dense_loss, _ in results:
        assert loss == pytest.approx(dense_loss, rel=1e-12, abs=0)
        assert ppl == pytest.approx(math.exp(dense_loss), rel=1e-12)
    # the layout really is uneven: the ranks' shares of the two batches' targets differ
    shares = {tuple(c / sum(counts) for c in counts) for *_, counts in results}
    assert len(shares) == par.world_size


# ---------------------------------------------------------------- tokens/s and MFU

def test_tokens_per_second_counts_every_replica_and_mfu_every_rank():
    """Four replicas of a tp2 layout (8 ranks) each training 8 rows of 32 positions per 0.5 s step
    move 4 x 8 x 32 / 0.5 tokens/s; every rank works as hard as the one replica of tp2 alone, so
    the MFU is that replica's."""
    one = dict(steps=3, seconds=1.5, data_seconds=0.3, rows_per_replica=8, seq_len=32, flops_per_token=1e6, peak=0.5)
    alone, replicated = interval_rates(dp=1, ranks=2, **one), interval_rates(dp=4, ranks=8, **one)
    assert replicated["tokens_per_s"] == 4 * 8 * 32 / 0.5 == 4 * alone["tokens_per_s"]
    assert replicated["mfu"] == pytest.approx(alone["mfu"], rel=1e-15) and alone["mfu"] == pytest.approx(
        1e6 * 8 * 32 / 0.5 / (2 * 0.5e12), rel=1e-15)
    assert replicated["step_ms"] == alone["step_ms"] == 500.0 and replicated["data_share"] == pytest.approx(0.2)
    assert replicated["loading_tokens_per_s"] == alone["loading_tokens_per_s"] == pytest.approx(3 * 8 * 32 / 0.3)
    assert interval_rates(dp=4, ranks=8, **{**one, "peak": None})["mfu"] is None


def test_a_dp2_run_logs_the_global_tokens_per_second_and_the_dense_heldout_loss(corpus, tmp_path):
    """At learning rate 0 the weights stay the seeded initial model, so the held-out loss the run
    logs is the dense model's on the same rows (both global batches of 2 x 4 x 2 rows)."""
    argv = ["train", "--dp_size", "2", "--", *data_args(
        corpus, max_steps=2, learning_rate=0, dtype="float32", peak_tflops=0.5, out_dir=tmp_path,
        eval_data_path=corpus / "heldout.jsonl", eval_batches=2)]
    train_in_ranks(argv[1:3], argv[4:])
    _, args = cli.parse(argv)
    config = model_config(args)
    lines, (evaluation,) = records(tmp_path, "train"), records(tmp_path, "eval")
    global_tokens = 2 * 4 * 2 * 32          # dp x batch_size x accumulation_steps rows of max_seq_len
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert r["tokens_per_s"] * r["step_ms"] / 1e3 == pytest.approx(global_tokens, rel=1e-9)
        assert r["mfu"] == pytest.approx(model_flops_per_token(config, 32) * r["tokens_per_s"] / (2 * 0.5e12))
    torch.manual_seed(args.seed)
    dense = MiniMindForCausalLM(config)
    heldout = open_dataset(str(corpus / "heldout.jsonl"), load_tokenizer(args.tokenizer_path), args.seq_len)
    rows = Rows(heldout, np.arange(len(heldout))).batch(np.arange(2 * 16))
    with torch.no_grad():
        dense_loss = dense(rows.input_ids, targets=rows.targets).loss.item()
    assert evaluation["step"] == 2 and evaluation["eval_loss"] == pytest.approx(dense_loss, rel=1e-5)
