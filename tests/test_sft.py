"""The sft task: on MiniMind's conversation rows (the loss only on the assistant's tokens, so every
microbatch, CP rank and DP replica holds a different number of targets) the loss and every
gradient of a step equal the dense model's mean over the unmasked targets of the global batch in
tp2 + SP, pp2 (1F1B, microbatches) and dp2 x cp2 (microbatches); the run trains, saves, resumes
exactly and starts from a checkpoint of the same model."""
import json
import os

import pytest
import torch

from distributed import run_ranks
from helpers import one_line_error, rel_l2
from minimind_parallel import cli, tasks
from minimind_parallel.checkpoint import read_dense_state
from minimind_parallel.config import ConfigError, MiniMindConfig, ParallelConfig
from minimind_parallel.context_parallel import ContextLayout
from minimind_parallel.data.batches import IGNORE_INDEX, Batch, count_targets, cp_tokens, dp_rows, shift_labels
from minimind_parallel.data.conversations import write_conversations
from minimind_parallel.data.sft import SFTDataset
from minimind_parallel.data.tokenizer import load_tokenizer, train_tokenizer
from minimind_parallel.groups import ProcessGroups
from minimind_parallel.loss_normalisation import world_token_mean
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.tasks.train import Run
from minimind_parallel.tasks.weights import read_initial_weights
from minimind_parallel.training import build_parallel_model, train_step, unwrap, wrap_data_parallel
from minimind_parallel.training.metrics import curves
from minimind_parallel.training.mixed_precision import Precision
from minimind_parallel.validation import dense_slice
from test_cli import assert_refused_before_launch

VOCAB, SEQ, ROWS = 320, 48, 8
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def corpus(stdlib_corpus, tmp_path_factory):
    """A tokenizer of VOCAB ids (carrying the chat template) and 32 conversations of the stdlib corpus."""
    root = tmp_path_factory.mktemp("sft_corpus")
    train_tokenizer(str(stdlib_corpus), str(root / "tokenizer"), vocab_size=VOCAB)
    write_conversations(str(root / "conv.jsonl"), max_rows=32)
    return root


def sft_batch(corpus) -> Batch:
    """ROWS conversation rows of SEQ tokens: the targets are the assistant's tokens only."""
    rows = SFTDataset.open(str(corpus / "conv.jsonl"), load_tokenizer(str(corpus / "tokenizer")), max_seq_len=SEQ)
    ids, labels = rows.batch(range(ROWS))
    return Batch(ids, shift_labels(labels))


class GradRecorder(torch.optim.Optimizer):
    """An optimizer whose step keeps a copy of every grad the step hands it (the grads after
    finalisation, DDP and clipping), and changes nothing."""

    def __init__(self, named):
        super().__init__([p for _, p in named], {})
        self.names = {id(p): n for n, p in named}
        self.grads = {}

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.grads[self.names[id(p)]] = p.grad.detach().clone()


def _masked_step(par, batch, microbatches):
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(MiniMindConfig(**TINY, tie_word_embeddings=par.pp > 1))
    dense_loss = dense(batch.input_ids, targets=batch.targets).loss
    dense_loss.backward()
    model = wrap_data_parallel(build_parallel_model(dense.config, par, groups, dense.state_dict()), groups)
    recorder = GradRecorder(list(unwrap(model).named_parameters()))
    mine = cp_tokens(dp_rows(batch, groups.dp_rank, par.dp), ContextLayout.of(par, SEQ), groups.cp_rank)
    stats = train_step(model, recorder, groups, *mine, num_microbatches=microbatches, token_weighted_dp=True,
                       grad_clip=0.0, precision=Precision.of("pure", torch.float32, "cpu"))
    loss, n = world_token_mean(None if stats.loss is None else stats.loss * stats.targets, stats.targets, groups)
    errors = {name: rel_l2(grad, dense_slice(name, dense.get_parameter(name).grad, par, groups.tp_rank))
              for name, grad in recorder.grads.items()}
    return loss, dense_loss.item(), n, errors, len(list(unwrap(model).parameters()))


def _masked_steps(layouts, batch):
    """Several layouts of one world size in one launch."""
    return [_masked_step(par, batch, microbatches) for par, microbatches in layouts]


LAYOUTS = {   # world size -> (layout, microbatches) run in one launch
    2: [(ParallelConfig(tp=2, sequence_parallel=True), 1),
        (ParallelConfig(tp=2, sequence_parallel=True, vocab_parallel=True), 1),
        (ParallelConfig(pp=2), 2)],                                  # 1F1B over two microbatches
    4: [(ParallelConfig(dp=2, cp=2), 2)],
}


@pytest.mark.parametrize("world", list(LAYOUTS), ids=["tp2_sp_vp_and_pp2", "dp2_cp2_microbatches"])
def test_the_masked_loss_and_grads_equal_the_dense_models_in_every_layout(corpus, world):
    batch = sft_batch(corpus)
    per_row = (batch.targets != IGNORE_INDEX).sum(dim=1)
    assert len(set(per_row.tolist())) > 2 and 0 < int(count_targets(batch.targets)) < ROWS * SEQ / 2
    for rank in run_ranks(_masked_steps, world, LAYOUTS[world], batch):
        for (par, _), (loss, dense_loss, n, errors, params) in zip(LAYOUTS[world], rank):
            assert n == int(count_targets(batch.targets)), par
            assert loss == pytest.approx(dense_loss, rel=1e-6), par
            assert len(errors) == params                      # every parameter of the rank's stage
            assert max(errors.values()) < 2e-5, (par, max(errors.items(), key=lambda kv: kv[1]))


# ---------------------------------------------------------------- the task: trains, saves, resumes

TASK_TINY = ["--hidden_size", "64", "--num_attention_heads", "4", "--num_key_value_heads", "2",
             "--num_hidden_layers", "2", "--vocab_size", str(VOCAB), "--max_seq_len", str(SEQ), "--batch_size", "4",
             "--learning_rate", "1e-2", "--log_interval", "1", "--dtype", "float32"]


def sft_args(corpus, **extra) -> list[str]:
    out = ["--data_path", str(corpus / "conv.jsonl"), "--tokenizer_path", str(corpus / "tokenizer"), *TASK_TINY]
    for key, value in extra.items():
        out += [f"--{key}"] + ([] if value is True else [str(value)])
    return out


def _sft_rank(argv):
    Run(cli.resolve(argv), torch.device("cpu")).train()


def sft_in_ranks(launcher_args, task_args):
    """The command line's path with the ranks forked by tests/distributed.py: parse, check, run."""
    argv = ["sft", *launcher_args, "--", *task_args]
    job = cli.resolve(argv)
    tasks.get("sft").check(job)
    run_ranks(_sft_rank, job.parallel.world_size, argv)


def losses(out_dir) -> dict[int, float]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return curves([json.loads(line) for line in f])["train"]


def test_sft_trains_saves_resumes_exactly_and_starts_from_a_checkpoint(corpus, tmp_path):
    job = cli.resolve(["sft", "--", *sft_args(corpus)])
    assert (job.task.learning_rate, job.task.epochs, job.task.num_microbatches) == (1e-2, 2, 1)
    assert cli.resolve(["sft", "--", "--data_path", "x", "--tokenizer_path", "y"]).task.learning_rate == 1e-5
    layout = ["--tp_size", "2"]
    sft_in_ranks(layout, sft_args(corpus, sequence_parallel=True, max_steps=6, save_dir=tmp_path / "whole"))
    whole = losses(tmp_path / "whole")
    assert sorted(whole) == list(range(1, 7)) and whole[6] < whole[1]          # the loss falls
    sft_in_ranks(layout, sft_args(corpus, sequence_parallel=True, max_steps=6, save_interval=3,
                                  save_dir=tmp_path / "ckpt", stop_at_step=3))
    assert sorted(losses(tmp_path / "ckpt")) == [1, 2, 3]
    sft_in_ranks(layout, sft_args(corpus, sequence_parallel=True, max_steps=6, save_interval=3,
                                  save_dir=tmp_path / "ckpt", resume=True))
    assert losses(tmp_path / "ckpt") == losses(tmp_path / "whole")           # every step, bit for bit
    # --from_weight: a checkpoint (save directory) of the same model, read whole; another model refused
    config = cli.resolve(["sft", "--", *sft_args(corpus)]).model
    _, saved = read_dense_state(str(tmp_path / "whole"))
    start = read_initial_weights(str(tmp_path / "whole"), config)
    assert all(torch.equal(start[k], saved[k].float()) for k in saved)
    other = cli.resolve(["sft", "--", *sft_args(corpus), "--hidden_size", "32"]).model
    assert "another model config" in one_line_error(ConfigError, read_initial_weights, str(tmp_path / "whole"), other)


def test_sft_refuses_a_row_without_an_answer_or_a_tokenizer_without_a_template_before_launch(
        corpus, tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.jsonl").write_text('{"conversations": [{"role": "user", "content": "Hello?"}]}\n')
    assert_refused_before_launch(["sft", "--tp_size", "2", "--", *sft_args(corpus), "--data_path",
                                  str(tmp_path / "bad.jsonl")], "bad.jsonl:1: the conversation has no assistant turn",
                                 monkeypatch, capsys)
    plain = tmp_path / "tokenizer"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((corpus / "tokenizer" / "tokenizer.json").read_bytes())
    assert_refused_before_launch(["sft", "--tp_size", "2", "--", *sft_args(corpus), "--tokenizer_path", str(plain)],
                                 "has no chat template", monkeypatch, capsys)
