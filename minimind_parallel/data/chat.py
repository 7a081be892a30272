"""Conversations as MiniMind renders them: jsonl rows `{"conversations": [{"role", "content", ...}]}`,
checked, normalised and rendered with the tokenizer's chat template (jingyaogong/minimind:
dataset/lm_dataset.py, `SFTDataset.create_chat_prompt`).

A message has a `role` (system, user, assistant, tool) and a string `content`; an assistant message
may carry `reasoning_content` (rendered in its think block) and `tool_calls` (a list, or its JSON
text, as MiniMind's files store it); a system message may carry `tools` (the function signatures,
a list or its JSON text), which the template writes into the system turn. A row needs an assistant
turn (it has nothing to learn otherwise).

The template is rendered with jinja2 as transformers' `apply_chat_template` renders it (a sandboxed
environment with `trim_blocks` and `lstrip_blocks`, `tojson` keeping non-ASCII text), so the text
is the one MiniMind's `tokenizer.apply_chat_template(..., tokenize=False)` gives. The empty think
block MiniMind-3's template puts in every assistant turn without reasoning is removed from the
text, as MiniMind's `post_processing_chat` does (it keeps it in 5% of rows at random; here never,
so that a row is the same on every run and every resume).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ..config import ConfigError
from .jsonl import open_data_file

ROLES = ("system", "user", "assistant", "tool")
EMPTY_THINK = "<think>\n\n</think>\n\n"


def tokenizer_chat_template(tokenizer_path: str) -> str:
    """The `chat_template` of the tokenizer_config.json beside the tokenizer; ConfigError when it has none."""
    folder = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
    config_file = os.path.join(folder, "tokenizer_config.json")
    template = None
    if os.path.exists(config_file):
        with open(config_file, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    if not isinstance(template, str) or not template.strip():
        raise ConfigError(f"tokenizer {tokenizer_path} has no chat template (the \"chat_template\" of "
                          f"{config_file}); conversations need one: make the tokenizer with "
                          f"python -m minimind_parallel.data.tokenizer, or add MiniMind's")
    return template


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template: messages -> the text the model reads."""

    source: str

    def __post_init__(self):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        object.__setattr__(self, "_compiled", env.from_string(self.source))

    @classmethod
    def of_tokenizer(cls, tokenizer_path: str) -> "ChatTemplate":
        return cls(tokenizer_chat_template(tokenizer_path))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        """The conversation's text (MiniMind's rendering and its `post_processing_chat`, empty think
        blocks removed)."""
        tools = next((m["tools"] for m in messages if m.get("role") == "system" and m.get("tools")), None)
        text = self._compiled.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        return text.replace(EMPTY_THINK, "")


def _json_field(message: dict, key: str, where: str):
    """A list field that MiniMind's files may store as its JSON text."""
    value = message.get(key)
    if isinstance(value, str) and value.strip():
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"{where}: \"{key}\" is not JSON ({e})") from None
    if value in (None, "", []):
        return None
    if not isinstance(value, list):
        raise ConfigError(f"{where}: \"{key}\" must be a list; got {type(value).__name__}")
    return value


def conversation(record, where: str) -> list[dict]:
    """The messages of one row, checked and normalised (tools / tool_calls parsed); ConfigError naming
    `where` (file:line) and what is wrong."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        raise ConfigError(f"{where}: a conversation row is {{\"conversations\": [...]}}; got "
                          f"{str(record)[:60]!r}")
    messages = []
    for k, raw in enumerate(record["conversations"]):
        at = f"{where}: message {k}"
        if not isinstance(raw, dict) or raw.get("role") not in ROLES:
            role = raw.get("role") if isinstance(raw, dict) else raw
            raise ConfigError(f"{at}: role must be one of {', '.join(ROLES)}; got {role!r}")
        if not isinstance(raw.get("content", ""), str):
            raise ConfigError(f"{at}: content must be a string; got {type(raw['content']).__name__}")
        message = {key: value for key, value in raw.items() if value is not None}
        for key in ("tools", "tool_calls"):
            value = _json_field(raw, key, at)
            message.pop(key, None)
            if value is not None:
                message[key] = value
        if not isinstance(message.get("reasoning_content", ""), str):
            raise ConfigError(f"{at}: reasoning_content must be a string")
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: the conversation has no assistant turn (nothing to learn); roles "
                          f"{[m['role'] for m in messages]}")
    return messages


def iter_conversations(path: str) -> Iterator[list[dict]]:
    """The messages of every row, in file order; ConfigError on bad input or an empty file."""
    count = 0
    with open_data_file(path) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError as e:
                raise ConfigError(f"{path}:{lineno}: malformed jsonl line ({e})") from None
            count += 1
            yield conversation(record, f"{path}:{lineno}")
    if count == 0:
        raise ConfigError(f"empty dataset: {path} has no conversations")


def iter_conversation_texts(path: str, template: ChatTemplate) -> Iterator[str]:
    """The rendered text of every row (what the token cache stores)."""
    for messages in iter_conversations(path):
        yield template.render(messages)
