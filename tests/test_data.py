"""The pretraining data pipeline: the stdlib corpus, MiniMind's tokenizer format, the token cache,
MiniMind's rows, the data-parallel sampler and its resumable position, the LR schedule, and the
one-line refusal of every bad input."""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from helpers import MAX_DOCS, one_line_error, write_stdlib_corpus
from minimind_parallel.config import ConfigError
from minimind_parallel.data import token_cache
from minimind_parallel.data.corpus import write_corpus
from minimind_parallel.data.jsonl import iter_texts
from minimind_parallel.data.pretrain import (IGNORE_INDEX, PretrainDataset, PretrainSampler, check_fits_model,
                                             iterate_batches, measure_loading)
from minimind_parallel.data.token_cache import build_token_cache
from minimind_parallel.data.tokenizer import load_tokenizer, train_tokenizer
from minimind_parallel.training.lr_schedule import cosine_lr

VOCAB = 512


@pytest.fixture(scope="session")
def tok(stdlib_corpus, tmp_path_factory):
    return train_tokenizer(str(stdlib_corpus), str(tmp_path_factory.mktemp("tokenizer")), vocab_size=VOCAB)


@pytest.fixture
def data(stdlib_corpus, tmp_path):
    """A private copy of the corpus: caches are written next to it."""
    return str(shutil.copy(stdlib_corpus, tmp_path / "stdlib.jsonl"))


def texts_of(path):
    return list(iter_texts(str(path)))


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return str(path)


# ---- corpus -------------------------------------------------------------------------------------

def test_corpus_is_minimind_jsonl_of_text_lines(stdlib_corpus):
    lines = stdlib_corpus.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == MAX_DOCS
    assert all(set(r) == {"text"} and isinstance(r["text"], str) and r["text"].strip() for r in records)
    assert len({r["text"] for r in records}) == MAX_DOCS  # each docstring once
    assert records[0]["text"].startswith("abc\n\n")  # modules in sorted order


def test_corpus_is_the_same_on_every_build(stdlib_corpus, tmp_path):
    assert write_stdlib_corpus(tmp_path / "again.jsonl").read_bytes() == stdlib_corpus.read_bytes()


def test_corpus_stops_at_the_byte_cap(tmp_path):
    count = write_corpus(str(tmp_path / "small.jsonl"), max_bytes=4000)
    texts = texts_of(tmp_path / "small.jsonl")
    assert count == len(texts) > 0
    assert sum(len(t.encode()) for t in texts) <= 4000
    assert [p.name for p in tmp_path.iterdir()] == ["small.jsonl"]  # no temporary file left


# ---- tokenizer ----------------------------------------------------------------------------------

def test_tokenizer_has_minimind_special_ids(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert [tok.tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.vocab_size == VOCAB
    # in text, the special tokens are single ids (MiniMind's chat format relies on it)
    assert tok.tokenizer.encode("<|im_start|>hi<|im_end|>").ids == [1] + tok.tokenizer.encode("hi").ids + [2]


def test_tokenizer_round_trips_text(tok, stdlib_corpus):
    for text in texts_of(stdlib_corpus)[:50] + ["naïve café — 東京 🙂\n\ttabs  and  spaces"]:
        assert tok.tokenizer.decode(tok.tokenizer.encode(text).ids) == text


def test_tokenizer_config_is_minimind_format(tok):
    directory = os.path.dirname(tok.path)
    config = json.load(open(os.path.join(directory, "tokenizer_config.json")))
    assert (config["pad_token"], config["bos_token"], config["eos_token"]) == ("<|endoftext|>", "<|im_start|>",
                                                                            "<|im_end|>")
    assert config["add_bos_token"] is False and config["tokenizer_class"] == "PreTrainedTokenizerFast"
    if importlib.util.find_spec("transformers") is not None:  # the optional consumer of this file
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(directory)
        assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, len(hf)) == (0, 1, 2, VOCAB)
        assert hf("def f(x): pass").input_ids == tok.tokenizer.encode("def f(x): pass").ids


def test_a_tokenizer_without_minimind_special_tokens_is_refused(tmp_path):
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    assert "lacks the special token '<|endoftext|>'" in one_line_error(ConfigError, load_tokenizer, str(tmp_path))


# ---- token cache --------------------------------------------------------------------------------

def test_cache_holds_every_document_tokenised(data, tok):
    cache = build_token_cache(data, tok)
    texts = texts_of(data)
    assert cache.built and len(cache) == len(texts) == MAX_DOCS
    assert cache.tokens.dtype == np.uint16 and isinstance(cache.tokens, np.memmap)
    for i, text in enumerate(texts):
        assert cache.document(i).tolist() == tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert os.path.dirname(cache.tokens_path) == os.path.dirname(data)  # next to the data


def test_cache_is_reused_not_rebuilt(data, tok):
    first = build_token_cache(data, tok)
    stamps = [os.stat(p).st_mtime_ns for p in (first.tokens_path, first.index_path)]
    again = build_token_cache(data, tok)
    assert not again.built
    assert (again.tokens_path, again.index_path) == (first.tokens_path, first.index_path)
    assert [os.stat(p).st_mtime_ns for p in (again.tokens_path, again.index_path)] == stamps
    assert np.array_equal(again.tokens, first.tokens) and np.array_equal(again.offsets, first.offsets)


def test_cache_is_rebuilt_when_the_data_changes(data, tok):
    first = build_token_cache(data, tok)
    with open(data, "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    changed = build_token_cache(data, tok)
    assert changed.built and changed.tokens_path != first.tokens_path
    assert len(changed) == len(first) + 1
    assert changed.document(len(first)).tolist() == tok.tokenizer.encode("one more document").ids


def test_cache_is_rebuilt_when_the_tokenizer_changes(data, tok, tmp_path):
    first = build_token_cache(data, tok)
    other = train_tokenizer(data, str(tmp_path / "other"), vocab_size=300)
    changed = build_token_cache(data, other)
    assert changed.built and changed.tokens_path != first.tokens_path
    assert changed.document(0).tolist() == other.tokenizer.encode(texts_of(data)[0]).ids


def test_a_tokenisation_that_fails_midway_leaves_no_cache(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(token_cache, "ENCODE_CHUNK_DOCS", 4)  # some chunks are written before the bad line
    path = write_jsonl(tmp_path / "bad.jsonl", ["a good line"] * 10)
    with open(path, "a") as f:
        f.write("{not json\n")
    assert "bad.jsonl:11: malformed jsonl line" in one_line_error(ConfigError, build_token_cache, path, tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no cache, no temporary file


def test_a_vocab_beyond_uint16_is_refused(tmp_path, stdlib_corpus):
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])}
    vocab.update({f"w{i}": i for i in range(3, 70000)})
    Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")).save(str(tmp_path / "tokenizer.json"))
    message = one_line_error(ConfigError, build_token_cache, str(stdlib_corpus), load_tokenizer(str(tmp_path)))
    assert "vocab_size must be <= 65536" in message and "vocab_size=70000" in message


# ---- bad input, one line each -------------------------------------------------------------------

@pytest.mark.parametrize("content, expected", [
    (None, "data file not found"),
    ("directory", "data file is not readable"),
    ('{"text": "ok"}\n{"text": "ok"\n', "bad.jsonl:2: malformed jsonl line"),
    ('{"text": "ok"}\n\n{"txt": "no text"}\n', 'bad.jsonl:3: jsonl line has no "text" field'),
    ('{"text": 7}\n', 'bad.jsonl:1: "text" must be a string; got int'),
    ('\n  \n', "empty dataset"),
])
def test_bad_data_is_refused_with_one_line(tmp_path, tok, content, expected):
    path = tmp_path / "bad.jsonl"
    if content == "directory":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    assert expected in one_line_error(ConfigError, build_token_cache, str(path), tok)


def test_a_missing_tokenizer_is_refused_with_one_line(tmp_path):
    assert "cannot load tokenizer" in one_line_error(ConfigError, load_tokenizer, str(tmp_path / "none"))


def test_data_that_does_not_fit_the_model_is_refused():
    message = one_line_error(ConfigError, check_fits_model, tokenizer_vocab=6400, model_vocab=512, max_seq_len=32,
                             max_positions=64)
    assert "tokenizer vocab=6400, vocab_size=512" in message
    message = one_line_error(ConfigError, check_fits_model, tokenizer_vocab=512, model_vocab=512, max_seq_len=128,
                             max_positions=64)
    assert "max_seq_len=128, max_position_embeddings=64" in message
    check_fits_model(tokenizer_vocab=512, model_vocab=512, max_seq_len=64, max_positions=64)


def test_a_dataset_smaller_than_one_global_batch_is_refused():
    assert "got 7 rows, dp_size=2, batch_size=4" in one_line_error(ConfigError, PretrainSampler, 7, batch_size=4,
                                                                   dp_size=2)


# ---- rows ---------------------------------------------------------------------------------------

def test_rows_follow_minimind_layout(tmp_path, tok):
    long = "word " * 100
    path = write_jsonl(tmp_path / "rows.jsonl", ["short text", long, ""])
    dataset = PretrainDataset.from_tokenizer(build_token_cache(path, tok), tok, max_seq_len=16)
    input_ids, labels = dataset.batch([0, 1, 2])
    assert input_ids.shape == labels.shape == (3, 16) and input_ids.dtype == labels.dtype == torch.int64

    short_ids = tok.tokenizer.encode("short text").ids
    expected = [1] + short_ids + [2] + [0] * (16 - 2 - len(short_ids))
    assert input_ids[0].tolist() == expected
    assert labels[0].tolist() == [IGNORE_INDEX if i >= len(short_ids) + 2 else t for i, t in enumerate(expected)]

    truncated = tok.tokenizer.encode(long).ids[:14]  # max_seq_len - 2 text tokens, as MiniMind truncates
    assert input_ids[1].tolist() == [1] + truncated + [2] and labels[1].tolist() == input_ids[1].tolist()
    assert input_ids[2].tolist() == [1, 2] + [0] * 14 and labels[2].tolist() == [1, 2] + [IGNORE_INDEX] * 14


# ---- sampler ------------------------------------------------------------------------------------

def epoch_batches(num_rows, *, batch_size, dp_size, seed=0, epochs=1):
    """Per DP rank, the batches it gets over `epochs` epochs."""
    samplers = [PretrainSampler(num_rows, batch_size=batch_size, dp_rank=d, dp_size=dp_size, seed=seed)
                for d in range(dp_size)]
    return [[next(s) for _ in range(epochs * s.steps_per_epoch)] for s in samplers]


def test_an_epoch_gives_every_row_once_split_over_dp_ranks():
    per_rank = epoch_batches(48, batch_size=3, dp_size=4)
    rows = [np.concatenate(batches) for batches in per_rank]
    assert all(len(r) == 12 for r in rows)
    assert sorted(np.concatenate(rows).tolist()) == list(range(48))  # every row, once: the ranks are disjoint


def test_rows_beyond_the_last_full_global_batch_wait_for_another_epoch():
    per_rank = epoch_batches(50, batch_size=3, dp_size=4, epochs=3)  # 4 steps of 12 rows per epoch, 2 left over
    left_out = []
    for e in range(3):
        rows = np.concatenate([np.concatenate(batches[4 * e:4 * e + 4]) for batches in per_rank])
        assert len(set(rows.tolist())) == len(rows) == 48
        left_out.append(set(range(50)) - set(rows.tolist()))
    assert len({frozenset(s) for s in left_out}) > 1


def test_order_is_deterministic_per_seed_and_differs_per_epoch_and_seed():
    a = epoch_batches(40, batch_size=4, dp_size=2, seed=7, epochs=2)
    assert all(np.array_equal(x, y) for x, y in zip(a[0], epoch_batches(40, batch_size=4, dp_size=2, seed=7,
                                                                         epochs=2)[0]))
    b = epoch_batches(40, batch_size=4, dp_size=2, seed=8)
    assert not np.array_equal(np.concatenate(a[0][:5]), np.concatenate(b[0]))
    assert not np.array_equal(np.concatenate(a[0][:5]), np.concatenate(a[0][5:]))  # epoch 0 vs epoch 1


def test_the_global_batch_does_not_depend_on_the_dp_split():
    dense = epoch_batches(60, batch_size=12, dp_size=1, seed=3)[0]
    split = epoch_batches(60, batch_size=3, dp_size=4, seed=3)
    for step, batch in enumerate(dense):
        assert np.array_equal(np.concatenate([rank[step] for rank in split]), batch)


def test_resume_from_a_saved_position_gives_the_next_batches(data, tok):
    dataset = PretrainDataset.from_tokenizer(build_token_cache(data, tok), tok, max_seq_len=24)

    def sampler():
        return PretrainSampler(len(dataset), batch_size=8, dp_rank=1, dp_size=2, seed=5)  # 12 steps per epoch

    uninterrupted = iterate_batches(dataset, sampler())
    expected = [next(uninterrupted) for _ in range(20)]
    first_run = sampler()
    for _ in range(9):
        next(first_run)
    saved = json.loads(json.dumps(first_run.state_dict()))  # as a checkpoint stores it
    assert (saved["epoch"], saved["step"]) == (0, 9)
    resumed = sampler()
    resumed.load_state_dict(saved)
    for want, (input_ids, labels) in zip(expected[9:], iterate_batches(dataset, resumed)):
        assert torch.equal(input_ids, want[0]) and torch.equal(labels, want[1])
    assert (resumed.epoch, resumed.step) == (1, 8)  # crossed into the next epoch


def test_a_position_saved_for_other_data_is_refused():
    saved = PretrainSampler(100, batch_size=4, seed=1).state_dict()
    message = one_line_error(ConfigError, PretrainSampler(101, batch_size=4, seed=1).load_state_dict, saved)
    assert "num_rows=100" in message and "num_rows=101" in message


def test_loading_speed_counts_the_tokens_of_the_batches_it_builds(data, tok):
    dataset = PretrainDataset.from_tokenizer(build_token_cache(data, tok), tok, max_seq_len=32)
    speed = measure_loading(dataset, batch_size=4, batches=10)
    assert math.isclose(speed.tokens_per_s * speed.seconds_per_batch, 4 * 32)


# ---- learning-rate schedule ---------------------------------------------------------------------

def minimind_get_lr(current_step, total_steps, lr):
    """MiniMind's trainer/trainer_utils.py get_lr, as published."""
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * current_step / total_steps)))


def test_lr_is_minimind_cosine_without_warmup():
    assert [cosine_lr(s, 37, 5e-4) for s in range(38)] == [minimind_get_lr(s, 37, 5e-4) for s in range(38)]
    assert cosine_lr(0, 37, 5e-4) == 5e-4 and math.isclose(cosine_lr(37, 37, 5e-4), 5e-5)


def test_lr_warms_up_linearly_then_follows_the_cosine():
    lrs = [cosine_lr(s, 110, 1.0, warmup_steps=10) for s in range(121)]
    assert lrs[:11] == pytest.approx([s / 10 for s in range(11)])
    assert lrs[10:111] == pytest.approx([minimind_get_lr(s, 100, 1.0) for s in range(101)])
    assert lrs[111:] == pytest.approx([0.1] * 10)  # past the end: the floor
    assert "warmup_steps=10, total_steps=10" in one_line_error(ConfigError, cosine_lr, 0, 10, 1.0, warmup_steps=10)


def test_the_commands_refuse_bad_input_with_one_line(tmp_path):
    missing = tmp_path / "none.jsonl"
    r = subprocess.run([sys.executable, "-m", "minimind_parallel.data.tokenizer", "--data", str(missing),
                        "--out", str(tmp_path / "tok")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == f"error: data file not found: {missing}\n"
