"""The interop command line on the small corpus: a model trained at tp2 + SP is exported to MiniMind's
.pth and to a Hugging Face folder holding exactly its trained weights; transformers loads the folder
with our logits; the .pth goes back into validate at another layout; `generate` prints text and gives
the same greedy tokens on one rank and under TP; every bad input is one line before launch."""
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers  # a test dependency (pyproject's `test` extra)

from distributed import run_ranks
from helpers import rel_l2
from interop_helpers import lively_model, save_as_checkpoint, write_word_tokenizer
from minimind_parallel import cli, tasks
from minimind_parallel.checkpoint import checkpoint_model_config
from minimind_parallel.config import ConfigError, ParallelConfig
from minimind_parallel.data_parallel import unwrap
from minimind_parallel.generation import generate
from minimind_parallel.groups import ProcessGroups
from minimind_parallel.interop import save_minimind_state_dict
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.parallel_generation import build_generation_model, generate_parallel, generation_layout
from minimind_parallel.sharding import gather_state_dict
from minimind_parallel.tasks.generate import generate_dense, generate_on_rank
from minimind_parallel.tasks.train import Run
from minimind_parallel.tasks.validate import initial_state
from test_cli import assert_refused_before_launch
from test_train import corpus, data_args  # noqa: F401  (corpus: the fixture)

MODEL = ["--hidden_size", "64", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--num_hidden_layers",
         "2", "--vocab_size", "320"]
STEPS = 6
PROMPT = "Return the"


def _train_and_keep(argv):
    """One rank of the train task; returns this rank's trained shards."""
    run = Run(cli.resolve(argv), torch.device("cpu"))
    run.train()
    return {n: p.detach().clone() for n, p in unwrap(run.model).named_parameters()}


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):  # noqa: F811
    """A run of the train task at tp2 + SP with a checkpoint at its last step, and the dense state its
    two ranks held at the end (their shards joined), to compare every export with."""
    save_dir = tmp_path_factory.mktemp("interop_run") / "run"
    argv = ["train", "--tp_size", "2", "--", *data_args(corpus, sequence_parallel=True, max_steps=STEPS,
                                                         save_interval=STEPS, save_dir=save_dir, dtype="float32")]
    job = cli.resolve(argv)
    args = job.task
    tasks.get("train").check(job)
    shards = run_ranks(_train_and_keep, 2, argv)
    weights = gather_state_dict(shards, ParallelConfig(tp=2, sequence_parallel=True))
    assert args.tie_word_embeddings and "lm_head.weight" not in weights      # train's default: one matrix
    return save_dir, weights | {"lm_head.weight": weights["model.embed_tokens.weight"]}


def dense_model(save_dir, state) -> MiniMindForCausalLM:
    """The dense model of the run's saved config holding `state`."""
    model = MiniMindForCausalLM(checkpoint_model_config(str(save_dir)))
    model.load_state_dict(state, strict=True)
    return model.eval()


def export(*task_args, launcher_args=()) -> int:
    return cli.main(["export", *launcher_args, "--", *map(str, task_args)])


# ---------------------------------------------------------------- export

def test_minimind_export_of_a_tp2_sp_checkpoint_is_its_trained_weights_in_half_precision(trained, tmp_path, capsys):
    save_dir, weights = trained
    assert checkpoint_model_config(str(save_dir)).tie_word_embeddings       # train's default: MiniMind's
    assert export("--checkpoint", save_dir, "--format", "minimind", "--out", tmp_path) == 0
    assert os.listdir(tmp_path) == ["pretrain_64.pth"]          # MiniMind's {weight}_{hidden}.pth
    saved = torch.load(tmp_path / "pretrain_64.pth", weights_only=True)
    assert list(saved) == list(dense_model(save_dir, weights).state_dict())
    for key, value in weights.items():
        assert saved[key].dtype == torch.float16 and torch.equal(saved[key], value.half()), key
    assert torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])  # tied: the matrix twice
    assert capsys.readouterr().out == (f"export: minimind {tmp_path / 'pretrain_64.pth'} from {save_dir} "
                                       f"(tied: lm_head.weight is model.embed_tokens.weight, MiniMind's default)\n")


def test_hf_export_of_a_tp2_sp_checkpoint_loads_in_transformers_with_our_logits(trained, corpus, tmp_path):  # noqa: F811
    """The trained weights bit for bit; float32 logits within 10x our own float32 round-off (float32
    against float64 on the same ids), as tests/test_interop.py holds the library export to."""
    save_dir, weights = trained
    out = tmp_path / "hf"
    assert export("--checkpoint", save_dir, "--format", "hf", "--out", out,
                  "--tokenizer_path", corpus / "tokenizer") == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.dtype == torch.float32
    for key, value in hf.state_dict().items():
        assert torch.equal(value, weights[key]), key
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = dense_model(save_dir, weights)
    with torch.no_grad():
        got, want, theirs = ours(ids).logits, ours.double()(ids).logits, hf(ids).logits
    baseline = rel_l2(got, want)
    assert 0 < baseline < 1e-5
    assert rel_l2(theirs, got) <= 10 * baseline
    assert json.load(open(out / "config.json"))["tie_word_embeddings"] is True
    assert {oct(os.stat(out / name).st_mode & 0o777) for name in os.listdir(out)} == {oct(0o644)}

    # What a transformers user runs: the tokenizer puts bos first, as the training rows start, and greedy
    # generate continues with our tokens.
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    inputs = hf_tok(PROMPT, return_tensors="pt")
    assert inputs.input_ids[0, 0].item() == hf_tok.bos_token_id == 1
    job = cli.resolve(generate_argv(["--checkpoint", str(save_dir)], corpus))
    new = hf.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs.input_ids.shape[1]:].tolist()
    assert new == generate_dense(job, torch.device("cpu")) and len(new) >= 1


def _validate_rank(argv):
    return tasks.get("validate").run_rank(cli.resolve(argv), torch.device("cpu"))


@pytest.mark.parametrize("layout,flags", [(["--pp_size", "2"], ["--num_microbatches", "2"]),
                                          (["--tp_size", "2"], ["--sequence_parallel", "--vocab_parallel"])],
                         ids=["pp2", "tp2_sp_vp"])
def test_the_pth_reimported_into_validate_at_another_layout_equals_the_dense_model(trained, tmp_path, layout, flags):
    save_dir, weights = trained
    assert export("--checkpoint", save_dir, "--format", "minimind", "--out", tmp_path / "w.pth") == 0
    argv = ["validate", *layout, "--", *MODEL, "--seq_len", "32", "--optimizer_steps", "2", *flags,
            "--tie_word_embeddings", "--from_weight", str(tmp_path / "w.pth")]   # validate defaults to untied
    job = cli.resolve(argv)
    tasks.get("validate").check(job)
    for key, value in initial_state(job).items():            # both models start from the .pth
        assert torch.equal(value, weights[key].half().float()), key
    assert run_ranks(_validate_rank, 2, argv) == [0, 0]       # 0: every item within tolerance


# ---------------------------------------------------------------- generate

def _generate_rank(argv):
    return generate_on_rank(cli.resolve(argv), torch.device("cpu"))


def generate_argv(source, corpus, *extra, launcher_args=()):  # noqa: F811
    return ["generate", *launcher_args, "--", *source, "--tokenizer_path", str(corpus / "tokenizer"),
            "--prompt", PROMPT, "--max_new_tokens", "12", *extra]


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top_p", "0.9", "--seed", "3"]],
                         ids=["greedy", "top_p"])
def test_generate_from_the_checkpoint_gives_the_same_tokens_on_one_rank_and_under_tp2(trained, corpus, sampling):  # noqa: F811
    save_dir, _ = trained
    source = ["--checkpoint", str(save_dir)]
    job = cli.resolve(generate_argv(source, corpus, *sampling))
    tasks.get("generate").check(job)
    dense = generate_dense(job, torch.device("cpu"))
    assert len(dense) >= 1
    assert run_ranks(_generate_rank, 2, generate_argv(source, corpus, *sampling, launcher_args=["--tp_size", "2"])) \
        == [dense, dense]


def _lively_rank(state, ids, sampling):
    model = build_generation_model(lively_model().config, ProcessGroups.build(generation_layout(2)), state)
    return generate_parallel(model, ids, max_new_tokens=16, **sampling)


@pytest.mark.parametrize("sampling", [{}, dict(temperature=1.0, top_p=0.9, seed=5)], ids=["greedy", "top_p"])
def test_tp2_generation_with_its_kv_cache_gives_the_dense_model_s_tokens(sampling):
    """A model whose greedy path wanders over the vocabulary, so a wrong head, cache slot or RoPE
    position under TP changes the tokens."""
    model = lively_model().eval()
    ids = torch.tensor([[1, 3, 4, 5], [1, 7, 8, 9]])
    want = generate(model, ids, max_new_tokens=16, **sampling)
    assert len(set(want[0, 4:].tolist())) > 3
    got = run_ranks(_lively_rank, 2, model.state_dict(), ids, sampling)
    assert torch.equal(got[0], want) and torch.equal(got[1], want)


def cli_generate(argv):
    return subprocess.run([sys.executable, "-m", "evaluation.parallel", *argv], capture_output=True, text=True,
                          timeout=300)


def test_generate_prints_text_from_the_trained_model_on_one_rank_and_tp2(trained, corpus):  # noqa: F811
    save_dir, _ = trained
    source = ["--checkpoint", str(save_dir)]
    one = cli_generate(generate_argv(source, corpus))
    two = cli_generate(generate_argv(source, corpus, launcher_args=["--tp_size", "2"]))
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert one.stdout.startswith(PROMPT) and len(one.stdout.strip()) > len(PROMPT)
    assert one.stdout.endswith("\n")                               # the shell's prompt starts on a line of its own
    assert two.stdout == one.stdout                                 # rank 0 prints, the same text


def test_generate_from_the_pth_prints_text(trained, corpus, tmp_path, capsys):  # noqa: F811
    save_dir, _ = trained
    assert export("--checkpoint", save_dir, "--format", "minimind", "--out", tmp_path) == 0
    capsys.readouterr()
    assert cli.main(generate_argv(["--from_weight", str(tmp_path / "pretrain_64.pth"), *MODEL], corpus)) == 0
    text = capsys.readouterr().out.strip()
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)


# ---------------------------------------------------------------- bad input

def test_bad_input_is_one_line_before_anything_starts(trained, corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    save_dir, weights = trained
    other = {k: v[..., :32] if k.endswith("embed_tokens.weight") else v for k, v in weights.items()}
    save_minimind_state_dict(other, str(tmp_path / "pretrain_32.pth"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    (tmp_path / "taken.pth").write_bytes(b"mine")
    (tmp_path / "empty").mkdir()
    (tmp_path / "killed" / ".tmp-step_00000004-x").mkdir(parents=True)
    ckpt = ["--checkpoint", str(save_dir)]
    small = ["--from_weight", str(tmp_path / "pretrain_32.pth"), *MODEL]
    cases = [
        (generate_argv(small, corpus), "model.embed_tokens.weight has shape [320, 32] but the model"),
        (["validate", "--", *MODEL, "--seq_len", "32", *small[:2]],
         "model.embed_tokens.weight has shape [320, 32] but the model"),
        (["export", "--", *ckpt, "--format", "hf", "--out", str(tmp_path / "hf"), "--tokenizer_path",
          str(corpus / "tokenizer")], "exists and is not empty; pass --overwrite"),
        (["export", "--", *ckpt, "--format", "minimind", "--out", str(tmp_path / "taken.pth")],
         "already exists; pass --overwrite"),
        (["export", "--", "--checkpoint", str(tmp_path / "empty"), "--format", "minimind", "--out",
          str(tmp_path / "x.pth")], "no complete checkpoint in"),
        (generate_argv(["--checkpoint", str(tmp_path / "killed")], corpus), "no complete checkpoint in"),
        (["export", "--tp_size", "2", "--", *ckpt, "--format", "minimind", "--out", str(tmp_path / "x.pth")],
         "export runs in one process and reads a checkpoint of any layout; got --tp_size 2"),
        (["export", "--", *ckpt, "--format", "hf", "--out", str(tmp_path / "h2")], "give --tokenizer_path"),
        (generate_argv(ckpt, corpus, launcher_args=["--pp_size", "2"]), "generate runs under tensor parallelism"),
        (generate_argv(ckpt + small[:2], corpus), "give exactly one of --checkpoint"),
        (generate_argv(ckpt, corpus, launcher_args=["--tp_size", "3"]), "divisible"),
        (generate_argv(ckpt, corpus, "--temperature", "nan"), "temperature must be >= 0 and finite (0 is greedy); "
                                                               "got temperature=nan"),
        (generate_argv(ckpt, corpus, "--temperature", "-0.5"), "got temperature=-0.5"),
        (["export", "--", *ckpt, "--format", "minimind", "--out", str(tmp_path / "taken.pth" / "w.pth")],
         f"cannot create the directory of --out {tmp_path / 'taken.pth' / 'w.pth'}: {tmp_path / 'taken.pth'} is a file"),
        (["export", "--", *ckpt, "--format", "hf", "--out", str(tmp_path / "taken.pth" / "a" / "hf"),
          "--tokenizer_path", str(corpus / "tokenizer")], f"{tmp_path / 'taken.pth'} is a file; got"),
    ]
    for argv, message in cases:
        assert_refused_before_launch(argv, message, monkeypatch, capsys)
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine" and (tmp_path / "taken.pth").read_bytes() == b"mine"
    assert not (tmp_path / "x.pth").exists()


def test_overwrite_replaces_an_existing_export(trained, corpus, tmp_path):  # noqa: F811
    save_dir, _ = trained
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.txt").write_text("old")
    assert export("--checkpoint", save_dir, "--format", "hf", "--out", tmp_path / "hf", "--tokenizer_path",
                  corpus / "tokenizer", "--overwrite") == 0
    assert "old.txt" not in os.listdir(tmp_path / "hf") and "model.safetensors" in os.listdir(tmp_path / "hf")
    with pytest.raises(ConfigError):
        tasks.get("export").check(cli.resolve(["export", "--", "--checkpoint", str(save_dir), "--format", "hf",
                                              "--out", str(tmp_path / "hf"), "--tokenizer_path",
                                              str(corpus / "tokenizer")]))


# ---------------------------------------------------------------- tied or not, finite weights, lengths

def test_train_export_and_generate_tie_by_default_as_minimind_does_and_validate_benchmark_do_not(corpus):  # noqa: F811
    tied = {task: cli.parse([task, "--", *tail])[1].tie_word_embeddings for task, tail in [
        ("train", data_args(corpus)), ("generate", ["--tokenizer_path", "t", "--prompt", "p"]),
        ("validate", []), ("benchmark", [])]}
    assert tied == {"train": True, "generate": True, "validate": False, "benchmark": False}
    assert cli.parse(["train", "--", *data_args(corpus), "--no-tie_word_embeddings"])[1].tie_word_embeddings is False
    assert cli.parse(["validate", "--", "--tie_word_embeddings"])[1].tie_word_embeddings is True


def test_a_pth_whose_tying_differs_from_the_flag_is_one_line_in_train_validate_and_generate(
        trained, corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The trained run is tied (train's default): its .pth holds the matrix twice. Each task refuses it
    for an untied model, before launch, naming the flag."""
    save_dir, _ = trained
    assert export("--checkpoint", save_dir, "--format", "minimind", "--out", tmp_path / "w.pth") == 0
    pth = ["--from_weight", str(tmp_path / "w.pth")]
    message = "holds a tied model (model.embed_tokens.weight and lm_head.weight are equal) but the model has " \
              "tie_word_embeddings=False; pass --tie_word_embeddings"
    for argv in (["validate", "--", *MODEL, "--seq_len", "32", *pth],
                 generate_argv([*pth, *MODEL, "--no-tie_word_embeddings"], corpus),
                 ["train", "--", *data_args(corpus, save_dir=tmp_path / "run"), "--no-tie_word_embeddings", *pth]):
        assert_refused_before_launch(argv, message, monkeypatch, capsys)


def _nan_at(state, key):
    state = {k: v.clone() for k, v in state.items()}
    state[key].view(-1)[3] = float("nan")
    return state


def test_weights_that_are_not_finite_are_one_line_naming_the_tensor_in_every_task(
        trained, corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    """A bit-flipped .pth (train, validate, generate) and a checkpoint holding nan (export, generate); a
    finite checkpoint whose values float16 cannot hold (export to MiniMind's half precision)."""
    save_dir, weights = trained
    key = "model.layers.1.mlp.up_proj.weight"
    save_minimind_state_dict(_nan_at(weights, key), str(tmp_path / "nan.pth"))
    pth = ["--from_weight", str(tmp_path / "nan.pth")]
    message = f"{tmp_path / 'nan.pth'}: {key} is not finite (1 nan and 0 inf of its "
    for argv in (["validate", "--", *MODEL, "--seq_len", "32", "--tie_word_embeddings", *pth],
                 generate_argv([*pth, *MODEL], corpus),
                 ["train", "--", *data_args(corpus, save_dir=tmp_path / "run"), *pth]):
        assert_refused_before_launch(argv, message, monkeypatch, capsys)

    model = dense_model(save_dir, weights)
    nan_ckpt = save_as_checkpoint(tmp_path / "nan_run", model, _nan_at(weights, key))
    message = f"{nan_ckpt}: {key} is not finite (1 nan and 0 inf of its "
    for argv in (["export", "--", "--checkpoint", nan_ckpt, "--format", "minimind", "--out", str(tmp_path / "x.pth")],
                 ["export", "--", "--checkpoint", nan_ckpt, "--format", "hf", "--out", str(tmp_path / "hf"),
                  "--tokenizer_path", str(corpus / "tokenizer")],
                 generate_argv(["--checkpoint", nan_ckpt], corpus)):
        assert_refused_before_launch(argv, message, monkeypatch, capsys)

    big = {k: v.clone() for k, v in weights.items()}
    big[key].view(-1)[0] = 1e5
    big_ckpt = save_as_checkpoint(tmp_path / "big_run", model, big)
    assert_refused_before_launch(["export", "--", "--checkpoint", big_ckpt, "--format", "minimind", "--out",
                                  str(tmp_path / "x.pth")], f"{key} overflows float16 (max abs 1e+05", monkeypatch,
                                 capsys)
    assert export("--checkpoint", big_ckpt, "--format", "hf", "--out", tmp_path / "hf32", "--tokenizer_path",
                  corpus / "tokenizer") == 0                          # float32 holds it
    assert not (tmp_path / "x.pth").exists() and not (tmp_path / "hf").exists()    # nothing written when refused


def test_an_untied_checkpoint_exports_saying_so_in_its_line_and_hf_config(corpus, tmp_path, capsys):  # noqa: F811
    model = lively_model(tie_word_embeddings=False, vocab_size=320)
    ckpt = save_as_checkpoint(tmp_path / "run", model)
    assert export("--checkpoint", ckpt, "--format", "hf", "--out", tmp_path / "hf", "--tokenizer_path",
                  corpus / "tokenizer") == 0
    assert capsys.readouterr().out.endswith("(untied: lm_head.weight is its own matrix; MiniMind loads it with "
                                            "MiniMindConfig(tie_word_embeddings=False))\n")
    assert json.load(open(tmp_path / "hf" / "config.json"))["tie_word_embeddings"] is False


def test_a_prompt_beyond_the_model_s_positions_is_refused_and_beyond_the_trained_length_noted(
        trained, corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    tok = write_word_tokenizer(str(tmp_path / "tok"))
    short = save_as_checkpoint(tmp_path / "run", lively_model(vocab_size=15))   # max_position_embeddings=64
    argv = ["generate", "--", "--checkpoint", short, "--tokenizer_path", tok, "--prompt", " ".join(["the"] * 70),
            "--max_new_tokens", "4"]
    assert_refused_before_launch(argv, "the prompt is 71 tokens, more than the model's 64 positions "
                                       "(max_position_embeddings)", monkeypatch, capsys)

    save_dir, _ = trained                                              # trained at --max_seq_len 32
    tasks.get("generate").check(cli.resolve(generate_argv(["--checkpoint", str(save_dir)], corpus,
                                                          "--max_new_tokens", "40")))
    err = capsys.readouterr().err
    assert err.startswith("generate: note: bos + prompt (") and err.count("\n") == 1
    assert "beyond the 32 the model was trained on (train --max_seq_len 32)" in err
    tasks.get("generate").check(cli.resolve(generate_argv(["--checkpoint", str(save_dir)], corpus)))  # 12: within
    assert capsys.readouterr().err == ""
