"""The train task end to end on the stdlib corpus with a small tokenizer: the loss falls well below
ln(vocab) in tp2 + SP and in pp2, resuming is exact (and works onto another layout, and past a
save that was killed), what a person sees is written, a run that diverges or cannot save stops
with one line keeping its last good checkpoint, and every bad input -- a resume that would not
continue the same run among them -- is one line before anything launches."""
import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.flop_counter import FlopCounterMode

from distributed import run_ranks
from minimind_parallel import cli, launcher, tasks
from minimind_parallel.checkpoint import latest_checkpoint, read_dense_state
from minimind_parallel.config import MiniMindConfig
from minimind_parallel.data.tokenizer import train_tokenizer
from minimind_parallel.training.metrics import curves, format_line, model_flops_per_token
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.tasks.train import Run, RunStopped
from test_cli import assert_refused_before_launch

VOCAB, TRAIN_DOCS = 320, 32
LN_VOCAB = math.log(VOCAB)
TINY = ["--hidden_size", "64", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--num_hidden_layers", "2",
        "--vocab_size", str(VOCAB), "--max_seq_len", "32", "--batch_size", "4", "--accumulation_steps", "2",
        "--epochs", "1000", "--learning_rate", "1e-2", "--log_interval", "1"]


@pytest.fixture(scope="module")
def corpus(stdlib_corpus, tmp_path_factory):
    """The stdlib documents (conftest.py), a tokenizer of VOCAB ids trained on them, a training file
    of the first TRAIN_DOCS documents (small enough that a tiny model learns it by heart) and a
    held-out file of the next TRAIN_DOCS."""
    root = tmp_path_factory.mktemp("train_corpus")
    train_tokenizer(str(stdlib_corpus), str(root / "tokenizer"), vocab_size=VOCAB)
    lines = stdlib_corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    (root / "train.jsonl").write_text("".join(lines[:TRAIN_DOCS]), encoding="utf-8")
    (root / "heldout.jsonl").write_text("".join(lines[TRAIN_DOCS:2 * TRAIN_DOCS]), encoding="utf-8")
    return root


def data_args(corpus, **extra) -> list[str]:
    out = ["--data_path", str(corpus / "train.jsonl"), "--tokenizer_path", str(corpus / "tokenizer"), *TINY]
    for key, value in extra.items():
        out += [f"--{key}"] + ([] if value is True else [str(value)])
    return out


def _train_rank(argv):
    Run(cli.resolve(argv), torch.device("cpu")).train()


def train_in_ranks(launcher_args: list[str], task_args: list[str]) -> None:
    """What the command line does, with the ranks forked by tests/distributed.py (no torchrun):
    parse, check (which builds the token caches), then every rank runs the task."""
    argv = ["train", *launcher_args, "--", *task_args]
    job = cli.resolve(argv)
    tasks.get("train").check(job)
    launch = job.launch
    world = launch.tp_size * launch.pp_size * launch.dp_size * launch.cp_size
    run_ranks(_train_rank, world, argv)


def losses(out_dir) -> dict[int, float]:
    """The run's training loss per step as the metrics file stands (resumes applied)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return curves([json.loads(line) for line in f])["train"]


def records(out_dir, kind: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


# ---------------------------------------------------------------- the loss falls

def test_the_loss_falls_well_below_ln_vocab_in_tp2_with_sequence_parallelism(corpus, tmp_path):
    r = subprocess.run([sys.executable, "-m", "evaluation.parallel", "train", "--tp_size", "2", "--",
                        *data_args(corpus, sequence_parallel=True, max_steps=40, epochs=1, dtype="float32",
                                   eval_data_path=corpus / "heldout.jsonl", eval_interval=20,
                                   out_dir=tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    # --max_steps is the run's length, past --epochs when it takes more: said before the ranks start
    assert r.stdout.startswith("train: --max_steps 40 runs past --epochs 1 (4 steps per epoch): 10 epochs\n")
    loss = losses(tmp_path)
    assert sorted(loss) == list(range(1, 41))
    assert loss[1] > 0.9 * LN_VOCAB          # a fresh model knows nothing
    assert loss[40] < 0.5 * LN_VOCAB         # ... and has learnt the training rows
    assert "step 40/40" in r.stdout and "held-out loss" in r.stdout and "MFU" in r.stdout
    evals = records(tmp_path, "eval")
    assert [e["step"] for e in evals] == [20, 40]
    assert all(e["eval_ppl"] == pytest.approx(math.exp(e["eval_loss"])) for e in evals)
    with open(tmp_path / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_loss_falls_well_below_ln_vocab_in_pp2_with_tied_embeddings(corpus, tmp_path):
    train_in_ranks(["--pp_size", "2"], data_args(corpus, tie_word_embeddings=True, max_steps=40, dtype="float32",
                                                 out_dir=tmp_path))
    loss = losses(tmp_path)
    assert loss[1] > 0.9 * LN_VOCAB and loss[40] < 0.5 * LN_VOCAB


def test_every_log_line_carries_the_numbers_a_person_watches(corpus, tmp_path):
    train_in_ranks(["--tp_size", "2"], data_args(corpus, max_steps=4, log_interval=2, out_dir=tmp_path,
                                                 peak_tflops=0.5))
    (run,), lines = records(tmp_path, "run"), records(tmp_path, "train")
    assert run["peak_tflops"] == 0.5 and run["peak_tflops_source"] == "--peak_tflops"
    assert [r["step"] for r in lines] == [2, 4]
    for r in lines:
        assert r["tokens_per_s"] > 0 and r["peak_mem_mib"] > 0 and r["grad_norm"] > 0 and 0 < r["data_share"] < 1
        flops = model_flops_per_token(MiniMindConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                                     num_hidden_layers=2, vocab_size=VOCAB), 32)
        assert r["mfu"] == pytest.approx(flops * r["tokens_per_s"] / (2 * 0.5e12))
    # MiniMind's cosine over the 4 steps of the run: 0.1 + 0.45 (1 + cos(pi t / T)) of the rate
    assert lines[-1]["lr"] == pytest.approx(1e-2 * 0.1)


# ---------------------------------------------------------------- resuming

def halted_run(corpus, save_dir, launcher_args, **extra):
    """A run of 8 steps that saves every 4 and ends after step 4 (as a job killed before step 5 would)."""
    train_in_ranks(launcher_args, data_args(corpus, max_steps=8, save_interval=4, save_dir=save_dir,
                                            stop_at_step=4, **extra))


def test_resume_continues_exactly_where_the_uninterrupted_run_goes(corpus, tmp_path, monkeypatch, capsys):
    # MiniMind's default precision: float32 parameters, bfloat16 compute under autocast
    layout, flags = ["--tp_size", "2"], dict(sequence_parallel=True, dtype="bfloat16")
    train_in_ranks(layout, data_args(corpus, max_steps=8, out_dir=tmp_path / "whole", **flags))
    halted_run(corpus, tmp_path / "ckpt", layout, **flags)
    assert sorted(losses(tmp_path / "ckpt")) == [1, 2, 3, 4]
    train_in_ranks(layout, data_args(corpus, max_steps=8, save_interval=4, save_dir=tmp_path / "ckpt", resume=True,
                                     **flags))
    assert losses(tmp_path / "ckpt") == losses(tmp_path / "whole")   # every step, bit for bit
    # resuming the finished run says so, and starts nothing
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: pytest.fail("launched"))
    argv = ["train", *layout, "--", *data_args(corpus, max_steps=8, save_dir=tmp_path / "ckpt", resume=True, **flags)]
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == (f"train: the run in --save_dir {tmp_path / 'ckpt'} is finished: step 8 of 8 "
                                       f"(step_00000008); nothing to resume\n")


@pytest.fixture(scope="module")
def tp2_float32(corpus, tmp_path_factory):
    """The tp2 float32 run of 8 steps uninterrupted (whole/) and halted after step 4 (halted/), run
    once for the tests that resume it: each resumes a copy of halted/."""
    root = tmp_path_factory.mktemp("tp2_float32")
    train_in_ranks(["--tp_size", "2"], data_args(corpus, max_steps=8, out_dir=root / "whole", dtype="float32"))
    halted_run(corpus, root / "halted", ["--tp_size", "2"], dtype="float32")
    return root


@pytest.mark.parametrize("layout,extra", [(["--pp_size", "2"], {}),
                                          (["--cp", "--cp_size", "2"], {"cp_comm_type": "ring"}),
                                          (["--dp_size", "2"], {"batch_size": 2})],   # the same global batch
                         ids=["tp2_to_pp2", "tp2_to_cp2_ring", "tp2_to_dp2_same_global_batch"])
def test_resume_onto_another_layout_continues_the_same_run(corpus, tp2_float32, tmp_path, layout, extra):
    flags = dict(dtype="float32")
    shutil.copytree(tp2_float32 / "halted", tmp_path / "ckpt")
    train_in_ranks(layout, data_args(corpus, max_steps=8, save_interval=4, save_dir=tmp_path / "ckpt",
                                     resume=True, **flags, **extra))
    whole, resumed = losses(tp2_float32 / "whole"), losses(tmp_path / "ckpt")
    assert sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-5), step


def test_a_killed_save_leaves_the_previous_checkpoint_to_resume_from(corpus, tp2_float32, tmp_path):
    flags = dict(dtype="float32")
    shutil.copytree(tp2_float32 / "halted", tmp_path / "ckpt")
    # what a job killed while saving step 8 leaves: a half-written temporary directory
    partial = tmp_path / "ckpt" / ".tmp-step_00000008-killed"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 100)
    train_in_ranks(["--tp_size", "2"], data_args(corpus, max_steps=8, save_interval=4, save_dir=tmp_path / "ckpt",
                                                 resume=True, **flags))
    assert losses(tmp_path / "ckpt") == losses(tp2_float32 / "whole")


def test_metrics_curve_drops_what_a_killed_run_logged_past_its_checkpoint():
    logged = [{"kind": "run", "resumed_from": 0}, *({"kind": "train", "step": s, "loss": 10.0 - s} for s in (1, 2, 3)),
              {"kind": "run", "resumed_from": 2}, {"kind": "train", "step": 3, "loss": 5.0}]
    assert curves(logged)["train"] == {1: 9.0, 2: 8.0, 3: 5.0}
    assert curves(logged[:4] + [{"kind": "run", "resumed_from": 1}])["train"] == {1: 9.0}


def test_model_flops_per_token_count_every_matmul_of_forward_and_backward():
    for tied in (False, True):
        config = MiniMindConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                vocab_size=256, tie_word_embeddings=tied, flash_attn=False)  # math attention: counted
        model, ids = MiniMindForCausalLM(config), torch.randint(0, 256, (2, 32))
        with FlopCounterMode(display=False) as counter:
            model(ids, labels=ids).loss.backward()
        assert counter.get_total_flops() == model_flops_per_token(config, 32) * ids.numel()


def test_model_flops_per_token_count_the_routed_experts_and_the_router_of_moe():
    """Each token passes its router ([E, H]) and k experts of moe_intermediate_size, not the dense
    MLP's width nor all E experts: the FLOPs counted on the dense MoE model (its experts' GEMMs
    over the N k routed rows), and a hand count."""
    h, e, k, i_e, layers, vocab, s = 64, 4, 2, 48, 2, 256, 32
    config = MiniMindConfig(hidden_size=h, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                            vocab_size=vocab, flash_attn=False, use_moe=True, num_experts=e, num_experts_per_tok=k,
                            moe_intermediate_size=i_e)
    model, ids = MiniMindForCausalLM(config), torch.randint(0, vocab, (2, s))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
    assert counter.get_total_flops() == model_flops_per_token(config, s) * ids.numel()
    q, kv = 4 * 16, 2 * 16                               # heads x head_dim
    by_hand = 6 * (layers * (h * (2 * q + 2 * kv) + h * e + k * 3 * h * i_e) + vocab * h) + 12 * layers * s * q
    assert model_flops_per_token(config, s) == by_hand
    assert model_flops_per_token(config, s) != model_flops_per_token(replace(config, use_moe=False), s)


def _resumed(argv):
    """What a rank's run holds once it has loaded the checkpoint (--resume)."""
    run = Run(cli.resolve(argv), torch.device("cpu"))
    return {"step": run.step, "total": run.total, "scaler": run.scaler.state_dict()}


def test_resume_restores_the_float16_loss_scaler(corpus, tmp_path):
    halted_run(corpus, tmp_path, [], dtype="float16")
    with open(tmp_path / "step_00000004" / "meta.json") as f:
        saved = json.load(f)["extra"]
    assert saved["loss_scaler"]["good_steps"] == 4   # not a fresh scaler's state
    argv = ["train", "--", *data_args(corpus, max_steps=8, save_dir=tmp_path, resume=True, dtype="float16")]
    resumed = run_ranks(_resumed, 1, argv)[0]
    assert resumed == {"step": 4, "total": 8, "scaler": saved["loss_scaler"]}


# ---------------------------------------------------------------- runs that stop early: one line

def test_a_diverging_run_stops_with_one_line_keeping_its_last_finite_checkpoint(corpus, tmp_path):
    r = subprocess.run([sys.executable, "-m", "evaluation.parallel", "train", "--",
                        *data_args(corpus, learning_rate="1e6", max_steps=20, save_interval=1, keep_last=1,
                                   dtype="float32", save_dir=tmp_path)],
                       capture_output=True, text=True, timeout=600)
    last = r.stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    stop = records(tmp_path, "stop")[0]
    step = stop["step"]
    assert 1 < step < 20 and last == f"error: train: {stop['reason']}"
    assert re.fullmatch(rf"step {step}: the (loss|grad norm) is (nan|inf)( and the grad norm is (nan|inf))?, not "
                        rf"finite: the step was not taken and nothing saved; the last checkpoint is "
                        rf"{re.escape(str(tmp_path / f'step_{step - 1:08d}'))} \(step {step - 1}\); --resume continues "
                        rf"from it", stop["reason"]), stop["reason"]
    # the last finite state is the latest checkpoint, and the only one (--keep_last 1)
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / f"step_{step - 1:08d}")
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [f"step_{step - 1:08d}"]
    _, state = read_dense_state(str(tmp_path))
    assert all(torch.isfinite(t).all() for t in state.values())


def _train_onto_a_full_disk(argv):
    """The run, with every checkpoint write after the first failing as on a full disk (ENOSPC)."""
    write, calls = dcp.FileSystemWriter.write_data, []

    def fills_up(self, plan, planner):
        calls.append(plan)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, plan, planner)
    dcp.FileSystemWriter.write_data = fills_up
    try:
        _train_rank(argv)
    except RunStopped as e:
        return str(e)
    return None


def test_a_full_disk_stops_the_run_with_one_line(corpus, tmp_path):
    argv = ["train", "--", *data_args(corpus, max_steps=4, save_interval=2, save_dir=tmp_path, dtype="float32")]
    tasks.get("train").check(cli.resolve(argv))
    (stopped,) = run_ranks(_train_onto_a_full_disk, 1, argv)
    assert stopped == (f"saving step 4 in {tmp_path} failed: rank 0: No space left on device; the last checkpoint is "
                       f"{tmp_path / 'step_00000002'} (step 2); --resume continues from it")
    assert sorted(p.name for p in tmp_path.glob("*step_*")) == ["step_00000002"]


# ---------------------------------------------------------------- bad input: one line, nothing launched

@pytest.fixture(scope="module")
def checkpointed(corpus, tmp_path_factory):
    """A save directory holding one complete checkpoint of the TINY model (step 4)."""
    save_dir = tmp_path_factory.mktemp("checkpointed")
    halted_run(corpus, save_dir, [], dtype="float32")
    return save_dir


def bad_inputs(corpus, tmp, checkpointed):
    (tmp / "malformed.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n{"text": oops}\n')
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "a_file").write_text("")
    (tmp / "no_checkpoint").mkdir()
    shutil.copytree(checkpointed, tmp / "corrupt")
    (tmp / "corrupt" / "step_00000004" / "meta.json").write_text('{"step": 4, "con')
    train = ["--data_path", str(corpus / "train.jsonl")]
    resume = [*train, "--save_dir", str(checkpointed), "--resume", "--max_steps", "8"]   # the checkpoint's run
    return [
        (["--data_path", str(tmp / "missing.jsonl")], "data file not found"),
        (["--data_path", str(tmp)], "data file is not readable"),
        (["--data_path", str(tmp / "malformed.jsonl")], "malformed.jsonl:3: malformed jsonl line"),
        (["--data_path", str(tmp / "empty.jsonl")], "empty dataset"),
        ([*train, "--vocab_size", "256"], f"tokenizer vocab must be <= the model's vocab_size; got tokenizer "
                                          f"vocab={VOCAB}, vocab_size=256"),
        ([*train, "--max_seq_len", "40000"], "max_seq_len must be <= max_position_embeddings"),
        ([*train, "--save_dir", str(tmp / "a_file" / "ckpt")],
         f"cannot create the directory of --save_dir: {tmp / 'a_file'} is a file"),
        ([*train, "--save_dir", str(tmp / "no_checkpoint"), "--resume"], "no complete checkpoint"),
        ([*train, "--save_dir", str(tmp / "never"), "--resume"], f"--resume: --save_dir {tmp / 'never'} does not exist"),
        ([*train, "--save_dir", str(tmp / "never"), "--from_weight", str(tmp / "pretrain_64.pth")],
         "pretrain_64.pth not found"),
        ([*train, "--save_dir", str(tmp / "corrupt"), "--resume"], f"checkpoint {tmp / 'corrupt' / 'step_00000004'}"
                                                                   f"/meta.json cannot be read: "),
        ([*train, "--grad_clip", "nan"], "grad_clip must be a finite number; got grad_clip=nan"),
        ([*train, "--grad_clip", "-1"], "grad_clip must be >= 0; got grad_clip=-1"),
        ([*train, "--peak_tflops", "0"], "peak_tflops must be > 0; got peak_tflops=0"),
        ([*train, "--peak_tflops", "-1"], "peak_tflops must be > 0; got peak_tflops=-1"),
        ([*train, "--keep_last", "-1"], "keep_last must be >= 0; got keep_last=-1"),
        # a resume must continue the same run
        ([*resume, "--data_path", str(corpus / "heldout.jsonl")],   # as many rows, other text
         f"--resume: --data_path {corpus / 'heldout.jsonl'} is not the file the checkpoint was trained on: size "),
        ([*resume, "--batch_size", "2"], "--resume: the checkpoint's run has global_batch_size=8, this command "
                                         "global_batch_size=4: rows per step (dp_size 1 x batch_size 2 x "
                                         "accumulation_steps 2; another dp_size continues at the same sample when "
                                         "the product stays 8)"),
        ([*resume, "--eval_fraction", "0.25"], "the checkpoint's run has num_rows=32, this command num_rows=24"),
        ([*resume, "--seed", "7"], "the checkpoint's run has seed=1234, this command seed=7"),
        ([*resume, "--max_steps", "300"], "--resume: the checkpoint's run is 8 steps, this command makes 300 "
                                          "(--epochs 1000, --max_steps 300): its learning-rate schedule was fixed"),
        ([*resume, "--stop_at_step", "4"], "--stop_at_step must be past the checkpoint's step; got --stop_at_step 4"),
        ([*train, "--save_dir", str(checkpointed), "--resume", "--hidden_size", "128"],
         "has another model config: hidden_size=64 in the checkpoint, hidden_size=128 now"),
        ([*train, "--resume"], "--resume continues the latest checkpoint of --save_dir"),
        ([*train, "--save_dir", str(checkpointed)],
         f"--save_dir {checkpointed} holds an earlier run's checkpoint (step_00000004): pass --resume"),
        ([*train, "--tokenizer_path", str(tmp / "no_tokenizer")], "cannot load tokenizer"),
        ([*train, "--batch_size", "64"], "dataset must hold one global batch"),
        ([*train, "--eval_interval", "5"], "needs held-out data"),
        ([*train, "--max_steps", "4", "--warmup_steps", "4"], "warmup_steps < total_steps"),
        ([*train, "--precision", "pure", "--dtype", "float16"], "float16 parameters cannot take AdamW steps"),
        ([*train, "--from_weight", str(tmp / "pretrain_64.pth")], "pretrain_64.pth not found"),
        ([*train, "--from_weight", str(tmp / "a_file"), "--save_dir", str(checkpointed), "--resume"],
         "--resume continues a checkpoint, --from_weight starts from weights"),
    ]


def test_every_bad_input_is_one_line_before_launch(corpus, tmp_path, checkpointed, monkeypatch, capsys):
    for override, message in bad_inputs(corpus, tmp_path, checkpointed):
        argv = ["train", "--", *data_args(corpus), *override]   # argparse: the last value of an option wins
        assert_refused_before_launch(argv, message, monkeypatch, capsys)
    assert not (tmp_path / "never").exists()   # a refused run creates no directory


def test_a_good_command_launches_once(corpus, tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda launch, world, argv, **k: launched.append(world) or 0)
    assert cli.main(["train", "--tp_size", "2", "--", *data_args(corpus, out_dir=tmp_path)]) == 0
    assert launched == [2]


def test_a_new_run_over_an_earlier_runs_checkpoints_launches_only_with_overwrite(corpus, tmp_path, checkpointed,
                                                                               monkeypatch, capsys):
    argv = ["train", "--", *data_args(corpus, out_dir=tmp_path), "--save_dir", str(checkpointed)]
    assert_refused_before_launch(argv, "holds an earlier run's checkpoint", monkeypatch, capsys)
    launched = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda launch, world, argv, **k: launched.append(world) or 0)
    assert cli.main([*argv, "--overwrite"]) == 0 and launched == [1]


def test_the_moe_model_trains_under_tp2_with_sequence_parallelism_logging_its_aux_loss(corpus, tmp_path):
    train_in_ranks(["--tp_size", "2"], data_args(corpus, use_moe=True, num_experts=4, num_experts_per_tok=2,
                                                 sequence_parallel=True, max_steps=4, log_interval=2,
                                                 out_dir=tmp_path, save_dir=tmp_path / "ckpt", save_interval=4))
    lines = records(tmp_path, "train")
    assert [r["step"] for r in lines] == [2, 4]
    # MiniMind's aux loss at its default coefficient: coef x (E sum_e load_e mean_score_e), about coef x k
    assert all(0 < r["aux_loss"] < 5e-4 * 2 * 4 for r in lines)
    assert "| aux loss " in format_line(lines[0])
    config, state = read_dense_state(latest_checkpoint(str(tmp_path / "ckpt")))
    assert config.use_moe and config.num_experts_per_tok == 2
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in state and "model.layers.1.mlp.gate.weight" in state
