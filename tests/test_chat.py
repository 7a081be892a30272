"""generate --chat: the prompt asked as a user turn of MiniMind's chat template (with --system),
answered until <|im_end|>, only the answer printed; under TP the same tokens as on one rank; the
interactive mode keeps the conversation and ends cleanly on Ctrl-D and Ctrl-C."""
import os
import signal
import subprocess
import sys

import pytest
import torch

from distributed import run_ranks
from helpers import one_line_error
from interop_helpers import lively_model, save_as_checkpoint, write_word_tokenizer
from minimind_parallel import cli, tasks
from minimind_parallel.config import ConfigError
from minimind_parallel.data.tokenizer import load_tokenizer
from minimind_parallel.tasks.generate import _prompt, generate_dense, generate_on_rank, interactive, launch_generate


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    save_as_checkpoint(root / "ckpt", lively_model())
    write_word_tokenizer(str(root / "tokenizer"))
    return root


def chat_argv(root, *extra, launcher_args=()):
    return ["generate", *launcher_args, "--", "--checkpoint", str(root / "ckpt"), "--tokenizer_path",
            str(root / "tokenizer"), "--max_new_tokens", "10", *extra]


SAMPLINGS = ([], ["--temperature", "0.9", "--top_p", "0.9", "--seed", "4"])   # greedy, top-p


def chat_of(root, sampling, launcher_args=()):
    return chat_argv(root, "--chat", "--system", "a dog", "--prompt", "the cat sat", *sampling,
                     launcher_args=launcher_args)


def _chat_rank(root):
    return [generate_on_rank(cli.resolve(chat_of(root, s, ["--tp_size", "2"])), torch.device("cpu"))
            for s in SAMPLINGS]


def test_chat_under_tp2_gives_the_single_ranks_tokens_from_the_templates_prompt(source):
    job = cli.resolve(chat_of(source, []))
    tasks.get("generate").check(job)
    tok, ids = _prompt(job.task, job.model or lively_model().config)
    rendered = ("<|im_start|>system\na dog<|im_end|>\n<|im_start|>user\nthe cat sat<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert ids == tok.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == tok.bos_id and ids.count(tok.eos_id) == 2
    one = [generate_dense(cli.resolve(chat_of(source, s)), torch.device("cpu")) for s in SAMPLINGS]
    assert all(len(new) >= 1 for new in one) and one[0] != one[1]
    assert run_ranks(_chat_rank, 2, source) == [one, one]


def test_chat_prints_only_the_answer_up_to_im_end(source, capsys):
    job = cli.resolve(chat_argv(source, "--chat", "--prompt", "the cat"))
    new = generate_dense(job, torch.device("cpu"))
    tok = load_tokenizer(str(source / "tokenizer"))
    answer = tok.tokenizer.decode(new[:new.index(tok.eos_id)] if tok.eos_id in new else new, skip_special_tokens=True)
    capsys.readouterr()
    assert launch_generate(job) == 0
    assert capsys.readouterr().out == answer + "\n"


@pytest.mark.parametrize("ending", [EOFError, KeyboardInterrupt], ids=["ctrl_d", "ctrl_c"])
def test_the_interactive_chat_keeps_the_conversation_and_ends_cleanly(source, capsys, ending):
    job = cli.resolve(chat_argv(source, "--interactive", "--system", "a dog"))
    lines = iter(["the cat", "on a mat"])

    def read(prompt):
        assert prompt == "> "
        line = next(lines, None)
        if line is None:
            raise ending()
        return line

    capsys.readouterr()
    assert interactive(job, torch.device("cpu"), read=read) == 0
    printed = capsys.readouterr().out.split("\n")
    tok = load_tokenizer(str(source / "tokenizer"))

    def answer(messages):
        new = generate_dense(job, torch.device("cpu"), messages=messages)
        return tok.tokenizer.decode(new[:new.index(tok.eos_id)] if tok.eos_id in new else new, skip_special_tokens=True)
    system = [{"role": "system", "content": "a dog"}]
    first = answer(system + [{"role": "user", "content": "the cat"}])
    second = answer(system + [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": first},
                              {"role": "user", "content": "on a mat"}])
    assert printed == [first, second, "", ""]          # the second turn saw the first exchange; a last newline


def test_ctrl_c_at_the_interactive_prompt_ends_the_process_with_no_traceback(source):
    p = subprocess.Popen([sys.executable, "-m", "evaluation.parallel", *chat_argv(source, "--interactive")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        p.stdin.write(b"the cat\n")
        p.stdin.flush()
        seen = b""
        while seen.count(b"> ") < 2:                      # answered the first turn, waiting for the second
            byte = p.stdout.read(1)
            assert byte, p.stderr.read().decode()
            seen += byte
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0 and b"Traceback" not in err, err.decode()


def test_bad_chat_input_is_one_line_before_anything_starts(source):
    for argv, message in [
        (chat_argv(source, "--interactive", launcher_args=["--tp_size", "2"]), "--interactive reads the conversation"),
        (chat_argv(source, "--chat"), "give --prompt TEXT"),
        (chat_argv(source, "--prompt", "the", "--system", "a dog"), "--system is the system turn of a chat"),
    ]:
        job = cli.resolve(argv)
        assert message in one_line_error(ConfigError, tasks.get("generate").check, job)
