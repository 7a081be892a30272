"""MiniMind's `.pth` and a Hugging Face folder: written as their owners write them, read back strictly,
and loaded by transformers with the dense model's logits; every bad input refused with one line."""
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers  # a test dependency (pyproject's `test` extra)
from safetensors import safe_open

from helpers import one_line_error, rel_l2
from interop_helpers import TINY, lively_model, write_word_tokenizer
from minimind_parallel import ConfigError, MiniMindConfig, MiniMindForCausalLM
from minimind_parallel.data.tokenizer import load_tokenizer
from minimind_parallel.files import atomic_path
from minimind_parallel.interop import (export_hf, load_minimind_state_dict, minimind_weight_name, qwen3_config_dict,
                                       save_minimind_state_dict)

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def minimind_writes(model, path):
    """What jingyaogong/minimind's trainer writes (trainer_utils.lm_checkpoint), stated here independently."""
    torch.save({k: v.half().cpu() for k, v in model.state_dict().items()}, path)


def test_interop_and_generation_import_without_transformers():
    """transformers is a test dependency only: the export is plain JSON and safetensors."""
    code = ("import sys; sys.modules['transformers'] = None  # any import of it now fails\n"
            "import minimind_parallel.interop, minimind_parallel.generation")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


# ---- MiniMind .pth ------------------------------------------------------------------------------

def test_weight_name_is_minimind_s():
    assert minimind_weight_name("pretrain", 768) == "pretrain_768.pth"
    assert "weight name" in one_line_error(ConfigError, minimind_weight_name, "", 768)


@pytest.mark.parametrize("tied", [True, False])
def test_saved_pth_is_the_file_minimind_writes_and_loads_back_as_its_half_rounded_weights(tied, tmp_path):
    model = lively_model(tie_word_embeddings=tied)
    ours, theirs = str(tmp_path / minimind_weight_name("pretrain", 64)), str(tmp_path / "theirs.pth")
    save_minimind_state_dict(model.state_dict(), ours, config=model.config)
    minimind_writes(model, theirs)
    got, want = torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True)
    assert list(got) == list(want)  # both tied keys, the model's order
    for k in want:
        assert got[k].dtype == torch.float16 and torch.equal(got[k], want[k]), k

    loaded = load_minimind_state_dict(ours, model.config)
    for k, v in model.state_dict().items():
        assert loaded[k].dtype == torch.float32 and torch.equal(loaded[k], v.half().float()), k
    assert (loaded[HEAD] is loaded[EMBED]) == tied
    fresh = MiniMindForCausalLM(model.config)
    fresh.load_state_dict(loaded, strict=True)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight.half().float())
    assert load_minimind_state_dict(theirs, model.config, dtype=torch.float64)[EMBED].dtype == torch.float64


@pytest.mark.parametrize("kept", [EMBED, HEAD])
def test_a_tied_pth_with_only_one_of_the_shared_keys_loads_both(kept, tmp_path):
    model = lively_model()
    state = {k: v.half() for k, v in model.state_dict().items() if k not in {EMBED, HEAD} - {kept}}
    torch.save(state, tmp_path / "one.pth")
    loaded = load_minimind_state_dict(str(tmp_path / "one.pth"), model.config)
    assert loaded[HEAD] is loaded[EMBED] and torch.equal(loaded[EMBED], model.lm_head.weight.half().float())


def bad_pth(tmp_path, model, edit):
    state = {k: v.half() for k, v in model.state_dict().items()}
    edit(state)
    torch.save(state, tmp_path / "bad.pth")
    return str(tmp_path / "bad.pth")


def test_a_pth_of_another_size_is_refused_naming_the_key_and_both_shapes(tmp_path):
    path = str(tmp_path / "pretrain_32.pth")
    save_minimind_state_dict(lively_model(hidden_size=32).state_dict(), path)
    message = one_line_error(ConfigError, load_minimind_state_dict, path, MiniMindConfig(**TINY))
    assert message.startswith(f"{path}: model.embed_tokens.weight has shape [128, 32]")
    assert "expects [128, 64]" in message and "hidden_size=64" in message


@pytest.mark.parametrize("edit,tied,expected", [
    (lambda s: s.pop("model.norm.weight"), True, "missing model.norm.weight (shape [64])"),
    (lambda s: s.pop(HEAD), False, "missing lm_head.weight (shape [128, 64])"),
    (lambda s: s.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(256, 64)}), True,
     "unknown key model.layers.2.mlp.up_proj.weight (shape [256, 64])"),
    (lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}), True,
     "model.layers.0.self_attn.k_proj.weight has shape [64, 64] but the model"),
    (lambda s: s.update({HEAD: s[HEAD] + 1}), True, "model.embed_tokens.weight and lm_head.weight differ"),
    (lambda s: s.update({"model.norm.weight": [1.0] * 64}), True, "model.norm.weight is a list, not a tensor"),
], ids=["missing", "missing-untied-head", "unknown", "wrong-shape", "tied-differ", "not-a-tensor"])
def test_a_bad_pth_is_refused_with_one_line_naming_the_key(edit, tied, expected, tmp_path):
    model = lively_model(tie_word_embeddings=tied)
    path = bad_pth(tmp_path, model, edit)
    assert expected in one_line_error(ConfigError, load_minimind_state_dict, path, model.config)


def test_a_missing_unreadable_or_non_state_dict_file_is_refused(tmp_path):
    config = MiniMindConfig(**TINY)
    assert "not found" in one_line_error(ConfigError, load_minimind_state_dict, str(tmp_path / "no.pth"), config)
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    assert "cannot read MiniMind weights" in one_line_error(
        ConfigError, load_minimind_state_dict, str(tmp_path / "junk.pth"), config)
    torch.save([torch.zeros(1)], tmp_path / "list.pth")
    assert "holds a list, not a MiniMind state dict" in one_line_error(
        ConfigError, load_minimind_state_dict, str(tmp_path / "list.pth"), config)
    torch.save({"model": {}, "optimizer": {}, "epoch": 0}, tmp_path / "resume.pth")
    assert "resume checkpoint" in one_line_error(
        ConfigError, load_minimind_state_dict, str(tmp_path / "resume.pth"), config)


def test_an_existing_pth_is_kept_unless_overwrite(tmp_path):
    path = str(tmp_path / "pretrain_64.pth")
    first, second = lively_model(seed=0), lively_model(seed=1)
    save_minimind_state_dict(first.state_dict(), path)
    before = open(path, "rb").read()
    assert "already exists; pass --overwrite" in one_line_error(
        ConfigError, save_minimind_state_dict, second.state_dict(), path)
    assert open(path, "rb").read() == before
    save_minimind_state_dict(second.state_dict(), path, overwrite=True)
    assert torch.equal(torch.load(path)[EMBED], second.state_dict()[EMBED].half())
    assert os.listdir(tmp_path) == ["pretrain_64.pth"]  # no temporary file left behind


# ---- Hugging Face folder ------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_hf_export_loads_in_transformers_with_our_weights_and_logits(tied, tmp_path):
    """Tolerance: the weights must be bit-equal; the float32 logits within 10x the dense model's own
    float32 round-off (its float32 run against its float64 run on the same weights and ids). Two exact
    float32 implementations differ by about twice that; a wrong head_dim, rope_theta, eps or tying is O(1)."""
    model = lively_model(tie_word_embeddings=tied)
    out = export_hf(model.state_dict(), model.config, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.dtype == torch.float32
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == tied
    ours = model.state_dict()
    theirs = hf.state_dict()
    assert set(theirs) == set(ours)
    for k in ours:
        assert torch.equal(theirs[k], ours[k]), k
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert (HEAD in f.keys()) == (not tied)  # a tied matrix is stored once, as save_pretrained does

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    exact = lively_model(tie_word_embeddings=tied).double()
    with torch.no_grad():
        want, got, ref = exact(ids).logits, model(ids).logits, hf(ids).logits
    baseline = rel_l2(got, want)
    assert 0 < baseline < 1e-5
    assert rel_l2(ref, got) <= 10 * baseline, f"rel-L2 {rel_l2(ref, got):.2e} vs float32 round-off {baseline:.2e}"


def test_hf_export_carries_the_tokenizer_and_its_ids(tmp_path):
    model = lively_model()
    tok_dir = write_word_tokenizer(str(tmp_path / "tok"))
    out = export_hf(model.state_dict(), model.config, str(tmp_path / "hf"), tokenizer_dir=tok_dir)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"]
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("the cat sat").input_ids == [1, 3, 4, 5]              # bos first, as the training rows start
    assert hf_tok("the cat sat", add_special_tokens=False).input_ids == [3, 4, 5]
    assert hf_tok.decode(hf_tok("the cat sat").input_ids, skip_special_tokens=True) == "the cat sat"
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.bos_token == "<|im_start|>"
    assert load_tokenizer(tok_dir).tokenizer.encode("the cat").ids == [3, 4]  # the training tokenizer unchanged


def test_every_file_of_the_hf_export_is_mode_0644(tmp_path):
    """safetensors' save_file writes a new file of mode 0600; the export's files are ordinary data files."""
    model = lively_model()
    out = export_hf(model.state_dict(), model.config, str(tmp_path / "hf"),
                    tokenizer_dir=write_word_tokenizer(str(tmp_path / "tok")))
    modes = {name: oct(os.stat(os.path.join(out, name)).st_mode & 0o777) for name in os.listdir(out)}
    assert modes["model.safetensors"] == oct(0o644)
    assert set(modes.values()) == {oct(0o644)}, modes


def test_qwen3_config_maps_every_size(tmp_path):
    c = MiniMindConfig(**(TINY | dict(intermediate_size=96, head_dim=16, max_position_embeddings=48)))
    hf = transformers.Qwen3Config(**qwen3_config_dict(c, dtype=torch.bfloat16))
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(hf, name) == getattr(c, name), name
    theta = hf.rope_parameters["rope_theta"] if hasattr(hf, "rope_parameters") else hf.rope_theta
    assert theta == c.rope_theta and hf.hidden_act == "silu" and not hf.use_sliding_window
    assert "bos_token_id" not in qwen3_config_dict(c)


def test_bfloat16_export_holds_our_weights_rounded_to_bfloat16(tmp_path):
    model = lively_model()
    out = export_hf(model.state_dict(), model.config, str(tmp_path / "hf"), dtype=torch.bfloat16)
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        for k, v in model.state_dict().items():
            if k != HEAD:
                assert torch.equal(f.get_tensor(k), v.bfloat16()), k
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16


def test_an_existing_non_empty_export_folder_is_kept_unless_overwrite(tmp_path):
    model = lively_model()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert "exists and is not empty; pass --overwrite" in one_line_error(
        ConfigError, export_hf, model.state_dict(), model.config, str(out))
    assert os.listdir(out) == ["notes.txt"]
    export_hf(model.state_dict(), model.config, str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["hf"]  # no temporary folder left beside it
    (tmp_path / "empty").mkdir()
    export_hf(model.state_dict(), model.config, str(tmp_path / "empty"))  # an empty folder is not a conflict
    assert sorted(os.listdir(tmp_path / "empty")) == ["config.json", "model.safetensors"]


def test_hf_export_refuses_bad_input_before_writing(tmp_path):
    model = lively_model()
    state = dict(model.state_dict())
    state["model.norm.weight"] = torch.ones(32)
    out = str(tmp_path / "hf")
    assert "model.norm.weight has shape [32] but the model" in one_line_error(
        ConfigError, export_hf, state, model.config, out)
    big = lively_model(vocab_size=8)
    assert "has 15 tokens, more than the model's vocab_size=8" in one_line_error(
        ConfigError, export_hf, big.state_dict(), big.config, out, tokenizer_dir=write_word_tokenizer(
            str(tmp_path / "tok")))
    assert "export dtype must be one of" in one_line_error(
        ConfigError, export_hf, model.state_dict(), model.config, out, dtype=torch.int8)
    (tmp_path / "file").write_text("x")
    assert "exists and is not a folder" in one_line_error(
        ConfigError, export_hf, model.state_dict(), model.config, str(tmp_path / "file"))
    assert sorted(os.listdir(tmp_path)) == ["file", "tok"]


def test_an_atomic_write_ends_mode_0644_also_when_the_writer_put_its_own_file_in_place(tmp_path):
    """A writer (safetensors' save_file, for one) that replaces the temporary file with a private one."""
    target = tmp_path / "out.bin"
    with atomic_path(str(target)) as tmp:
        os.remove(tmp)
        os.close(os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600))
    assert os.stat(target).st_mode & 0o777 == 0o644


@pytest.mark.parametrize("file_tied", [True, False])
def test_whether_a_pth_is_tied_is_read_from_it_and_a_mismatch_with_the_model_is_one_line(file_tied, tmp_path):
    """A tied file holds the one matrix twice (equal tensors); an untied one two different matrices.
    Loaded into a model of the other kind, each is refused naming the flag that would fit it."""
    model = lively_model(tie_word_embeddings=file_tied)
    path = str(tmp_path / "pretrain_64.pth")
    minimind_writes(model, path)
    saved = torch.load(path, weights_only=True)
    assert torch.equal(saved[EMBED], saved[HEAD]) == file_tied
    other = MiniMindConfig(**TINY, tie_word_embeddings=not file_tied)
    message = one_line_error(ConfigError, load_minimind_state_dict, path, other)
    if file_tied:
        assert message == (f"{path} holds a tied model (model.embed_tokens.weight and lm_head.weight are equal) but "
                           f"the model has tie_word_embeddings=False; pass --tie_word_embeddings")
    else:
        assert message.startswith(f"{path}: model.embed_tokens.weight and lm_head.weight differ (max abs ")
        assert message.endswith("an untied model, but tie_word_embeddings=True shares them; "
                                "pass --no-tie_word_embeddings")
    state = load_minimind_state_dict(path, model.config)        # the matching model loads it
    assert torch.equal(state[HEAD], model.state_dict()[HEAD].half().float())
