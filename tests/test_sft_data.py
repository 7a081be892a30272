"""Conversation rows: MiniMind's chat template rendered, tokenised, truncated, padded and masked
exactly as MiniMind's `SFTDataset` does (a faithful reimplementation of its dataset/lm_dataset.py
below, on transformers' tokenizer and its `apply_chat_template`), the conversation corpus, and
the one-line refusals."""
import json
import random
import shutil

import numpy as np
import pytest
import torch

from helpers import one_line_error
from minimind_parallel.config import ConfigError
from minimind_parallel.data.batches import IGNORE_INDEX
from minimind_parallel.data.chat import ChatTemplate, iter_conversations
from minimind_parallel.data.conversations import write_conversations
from minimind_parallel.data.sft import SFTDataset
from minimind_parallel.data.tokenizer import train_tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Zeit in einer Stadt", "parameters": CITY}}]
CALLS = [{"name": "get_time", "arguments": {"city": "Paris"}}]
ROWS = [
    [{"role": "user", "content": "What does os.path.join do?"},
     {"role": "assistant", "content": "Join two or more pathname components, inserting '/' as needed."}],
    [{"role": "system", "content": "You answer questions."}, {"role": "user", "content": "Explain abc."},
     {"role": "assistant", "content": "Abstract Base Classes."}, {"role": "user", "content": "And json?"},
     {"role": "assistant", "content": "JSON encoder and decoder."}],
    [{"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Because.", "reasoning_content": "The user asks why; answer briefly."}],
    [{"role": "user", "content": "Think first."}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nDone."}],
    [{"role": "system", "content": "You may call tools.", "tools": json.dumps(TOOLS, ensure_ascii=False)},
     {"role": "user", "content": "Wie spät ist es in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": json.dumps(CALLS)},
     {"role": "tool", "content": "{\"time\": \"12:00\"}"},
     {"role": "assistant", "content": "Es ist 12:00 in Paris."}],
    [{"role": "user", "content": "Tell me everything. " * 30},
     {"role": "assistant", "content": "Everything, at length: " + "the docstring goes on " * 40}],
]


# ---------------------------------------------------------------- MiniMind's SFTDataset, reimplemented

def minimind_post_processing_chat(prompt_content, empty_think_ratio):
    if '<think>\n\n</think>\n\n' in prompt_content and random.random() > empty_think_ratio:
        prompt_content = prompt_content.replace('<think>\n\n</think>\n\n', '')
    return prompt_content


class MiniMindSFTDataset:
    """dataset/lm_dataset.py's SFTDataset on rows given as lists (its load_dataset with string
    Features fills absent fields with None); `post_processing_chat` with empty_think_ratio 0: the
    empty think block always removed (MiniMind keeps it in 5% of rows at random)."""

    def __init__(self, samples, tokenizer, max_length):
        self.tokenizer, self.max_length = tokenizer, max_length
        keys = ("role", "content", "reasoning_content", "tools", "tool_calls")
        self.samples = [[{k: m.get(k) for k in keys} for m in cs] for cs in samples]
        self.bos_id = tokenizer(f'{tokenizer.bos_token}assistant\n', add_special_tokens=False).input_ids
        self.eos_id = tokenizer(f'{tokenizer.eos_token}\n', add_special_tokens=False).input_ids

    def create_chat_prompt(self, conversations):
        messages = []
        tools = None
        for message in conversations:
            message = dict(message)
            if message.get("role") == "system" and message.get("tools"):
                tools = json.loads(message["tools"]) if isinstance(message["tools"], str) else message["tools"]
            if message.get("tool_calls") and isinstance(message["tool_calls"], str):
                message["tool_calls"] = json.loads(message["tool_calls"])
            messages.append(message)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, tools=tools)

    def generate_labels(self, input_ids):
        labels = [-100] * len(input_ids)
        i = 0
        while i < len(input_ids):
            if input_ids[i:i + len(self.bos_id)] == self.bos_id:
                start = i + len(self.bos_id)
                end = start
                while end < len(input_ids):
                    if input_ids[end:end + len(self.eos_id)] == self.eos_id:
                        break
                    end += 1
                for j in range(start, min(end + len(self.eos_id), self.max_length)):
                    labels[j] = input_ids[j]
                i = end + len(self.eos_id) if end < len(input_ids) else len(input_ids)
            else:
                i += 1
        return labels

    def __getitem__(self, index):
        prompt = minimind_post_processing_chat(self.create_chat_prompt(self.samples[index]), empty_think_ratio=0.0)
        input_ids = self.tokenizer(prompt).input_ids[:self.max_length]
        input_ids += [self.tokenizer.pad_token_id] * (self.max_length - len(input_ids))
        labels = self.generate_labels(input_ids)
        return torch.tensor(input_ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tokenizer_dir(stdlib_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("chat_tokenizer")
    train_tokenizer(str(stdlib_corpus), str(out), vocab_size=512)
    return out


def write_rows(path, rows):
    path.write_text("".join(json.dumps({"conversations": r}, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("max_seq_len", [64, 512])   # 64 cuts most rows, inside an assistant span too
def test_rows_equal_miniminds_sft_dataset_ids_and_labels(tokenizer_dir, tmp_path, max_seq_len):
    from transformers import AutoTokenizer
    from minimind_parallel.data.tokenizer import load_tokenizer
    path = write_rows(tmp_path / "conv.jsonl", ROWS)
    mine = SFTDataset.open(path, load_tokenizer(str(tokenizer_dir)), max_seq_len=max_seq_len)
    theirs = MiniMindSFTDataset(ROWS, AutoTokenizer.from_pretrained(str(tokenizer_dir)), max_seq_len)
    ids, labels = mine.batch(range(len(ROWS)))
    assert ids.shape == labels.shape == (len(ROWS), max_seq_len)
    for i in range(len(ROWS)):
        want_ids, want_labels = theirs[i]
        assert torch.equal(ids[i], want_ids), i
        assert torch.equal(labels[i], want_labels), i
    learns = (labels != IGNORE_INDEX).any(dim=1)
    assert learns.all() if max_seq_len == 512 else not learns[-2:].any()   # cut before their answers: nothing


def test_the_loss_covers_the_answer_and_its_end_only(tokenizer_dir, tmp_path):
    from minimind_parallel.data.tokenizer import load_tokenizer
    tok = load_tokenizer(str(tokenizer_dir))
    rows = SFTDataset.open(write_rows(tmp_path / "conv.jsonl", ROWS[:3]), tok, max_seq_len=256)
    decode = lambda ids: tok.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)  # noqa: E731
    ids, labels = rows.batch([0, 1, 2])
    assert decode(ids[0][ids[0] != tok.pad_id]) == (
        "<|im_start|>user\nWhat does os.path.join do?<|im_end|>\n<|im_start|>assistant\n"
        "Join two or more pathname components, inserting '/' as needed.<|im_end|>\n")
    assert decode(labels[0][labels[0] != IGNORE_INDEX]) == ("Join two or more pathname components, inserting '/' "
                                                           "as needed.<|im_end|>\n")
    assert decode(labels[1][labels[1] != IGNORE_INDEX]) == ("Abstract Base Classes.<|im_end|>\n"
                                                           "JSON encoder and decoder.<|im_end|>\n")
    assert decode(labels[2][labels[2] != IGNORE_INDEX]) == (
        "<think>\nThe user asks why; answer briefly.\n</think>\n\nBecause.<|im_end|>\n")


def test_a_row_without_an_assistant_turn_or_a_tokenizer_without_a_template_is_refused_in_one_line(
        tokenizer_dir, tmp_path):
    from minimind_parallel.data.tokenizer import load_tokenizer
    tok = load_tokenizer(str(tokenizer_dir))
    path = write_rows(tmp_path / "conv.jsonl", ROWS[:1] + [[{"role": "user", "content": "Hello?"}]])
    message = one_line_error(ConfigError, SFTDataset.open, path, tok, max_seq_len=64)
    assert "conv.jsonl:2" in message and "no assistant turn" in message
    bad_role = write_rows(tmp_path / "role.jsonl", [[{"role": "bot", "content": "x"}]])
    assert "role must be one of" in one_line_error(ConfigError, lambda: list(iter_conversations(bad_role)))
    plain = tmp_path / "plain_tokenizer"
    shutil.copytree(tokenizer_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    message = one_line_error(ConfigError, ChatTemplate.of_tokenizer, str(plain))
    assert "no chat template" in message and str(plain) in message
    good = write_rows(tmp_path / "good.jsonl", ROWS[:1])
    assert "no chat template" in one_line_error(ConfigError, SFTDataset.open, good, load_tokenizer(str(plain)),
                                                max_seq_len=64)


def test_the_conversation_corpus_asks_about_the_stdlib_and_answers_with_its_docstrings(tmp_path):
    path = tmp_path / "conv.jsonl"
    assert write_conversations(str(path), max_rows=40) == 40
    rows = [json.loads(line)["conversations"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows[0][0] == {"role": "user", "content": "What is the abc module for?"}
    assert any(len(r) == 4 for r in rows) and any(r[0]["role"] == "system" for r in rows)  # follow-ups, system turns
    assert all(r[-1]["role"] == "assistant" and r[-1]["content"] for r in rows)
    assert write_conversations(str(tmp_path / "again.jsonl"), max_rows=40) == 40
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()     # the same file every run
