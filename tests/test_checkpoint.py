"""Checkpoints: 2 steps + save + resume + 2 steps gives the uninterrupted run's losses bit for bit;
a checkpoint saved on tp2 x pp2 loads onto tp1, dp2, tp4 and pp4 with every parameter and AdamW
state equal to the saved dense one and the same continued losses at round-off; a save killed
before its rename or while writing leaves the previous checkpoint the loadable `latest`; a
checkpoint of another model config, a directory with no complete checkpoint and a save directory
that cannot be written are refused with one line."""
import errno
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.checkpoint import (CheckpointSaveError, check_checkpoint_config, check_save_dir,
                                          latest_checkpoint, load_checkpoint, read_checkpoint_config,
                                          resolve_checkpoint, save_checkpoint)
from minimind_parallel.checkpoint import directory
from minimind_parallel.config import ConfigError
from minimind_parallel.data.batches import dp_rows, random_batch
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.plan import plan_of, tp_split_dim
from minimind_parallel.sharding import gather_state_dict
from minimind_parallel.training import build_parallel_model, make_optimizer, train_step, unwrap, wrap_data_parallel

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=128)
SEQ, ROWS, MICROBATCHES, LR = 16, 4, 2, 1e-2
SAVE_AT, STEPS = 2, 4
EXTRA = {"data": {"epoch": 0, "position": SAVE_AT * ROWS}}


def _config(**kw):
    return MiniMindConfig(**{**TINY, "tie_word_embeddings": True, **kw})


def _setup(config, par, groups, seed):
    """Model and AdamW of this rank, from the dense model initialised with `seed`."""
    torch.manual_seed(seed)
    dense = MiniMindForCausalLM(config).state_dict()
    model = wrap_data_parallel(build_parallel_model(config, par, groups, dense), groups)
    return model, make_optimizer(model, LR)


def _train(model, optimizer, groups, steps) -> list:
    """The loss of each step of `steps` (None on stages other than the last); batch i is fixed."""
    par = groups.par
    losses = []
    for i in steps:
        batch = dp_rows(random_batch(100 + i, ROWS, SEQ, TINY["vocab_size"]), groups.dp_rank, par.dp)
        losses.append(train_step(model, optimizer, groups, *batch, num_microbatches=MICROBATCHES).loss)
    return losses


def _save(save_dir, step, model, optimizer, config, groups, keep_last=0):
    return save_checkpoint(save_dir, step, model=model, optimizer=optimizer, config=config, par=groups.par,
                           groups=groups, extra=EXTRA, keep_last=keep_last)


def _load(path, model, optimizer, config, groups):
    return load_checkpoint(path, model=model, optimizer=optimizer, config=config, par=groups.par, groups=groups)


def _shards(model, optimizer) -> dict:
    """This rank's parameters and AdamW states by name (copies)."""
    params = dict(unwrap(model).named_parameters())
    out = {"param": {n: p.detach().clone() for n, p in params.items()}}
    for state in ("exp_avg", "exp_avg_sq", "step"):
        out[state] = {n: optimizer.state[p][state].clone() for n, p in params.items()}
    return out


# --- exact resume ----------------------------------------------------------------------------------


def _resume_exactly(config, par, save_dir):
    """Uninterrupted run of STEPS steps saving at SAVE_AT; then a fresh model and optimizer (another
    initialisation, another RNG state) load the checkpoint and run the remaining steps."""
    groups = ProcessGroups.build(par)
    model, optimizer = _setup(config, par, groups, seed=0)
    losses = _train(model, optimizer, groups, range(SAVE_AT))
    path = _save(save_dir, SAVE_AT, model, optimizer, config, groups)
    rng_at_save = torch.get_rng_state()
    losses += _train(model, optimizer, groups, range(SAVE_AT, STEPS))

    model, optimizer = _setup(config, par, groups, seed=1)
    extra = _load(save_dir, model, optimizer, config, groups)
    rng_restored = torch.equal(torch.get_rng_state(), rng_at_save)
    resumed = _train(model, optimizer, groups, range(SAVE_AT, STEPS))
    return dict(path=path, losses=losses, resumed=resumed, extra=extra, rng_restored=rng_restored)


@pytest.mark.parametrize("par", [
    pytest.param(ParallelConfig(tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True),
                 id="tp2_sp_async_vp"),
    pytest.param(ParallelConfig(dp=2, pp=2), id="dp2_pp2_tied"),
])
def test_resume_continues_bit_for_bit(par, tmp_path):
    results = run_ranks(_resume_exactly, par.world_size, _config(), par, str(tmp_path))
    assert results[0]["path"] == str(tmp_path / f"step_{SAVE_AT:08d}")
    assert latest_checkpoint(str(tmp_path)) == results[0]["path"]
    if par.dp > 1:   # DP replicas hold the same shards: each is written once
        assert all(len(c) == 1 for k, c in _chunks(results[0]["path"]).items() if not k.startswith("rng.")), par
    last_stage = [r for r in results if r["resumed"][0] is not None]
    assert len(last_stage) == par.world_size // par.pp
    for r in last_stage:
        for uninterrupted, resumed in zip(r["losses"][SAVE_AT:], r["resumed"], strict=True):
            assert torch.equal(uninterrupted, resumed), (r["losses"], r["resumed"])
    assert all(r["extra"] == {**EXTRA, "step": SAVE_AT} for r in results)
    assert all(r["rng_restored"] for r in results)


# --- resharding ------------------------------------------------------------------------------------

SAVED_LAYOUT = ParallelConfig(tp=2, pp=2, vocab_parallel=True)


def _save_for_resharding(config, par, save_dir):
    groups = ProcessGroups.build(par)
    model, optimizer = _setup(config, par, groups, seed=0)
    _train(model, optimizer, groups, range(SAVE_AT))
    _save(save_dir, SAVE_AT, model, optimizer, config, groups)
    shards = _shards(model, optimizer)
    losses = _train(model, optimizer, groups, range(SAVE_AT, STEPS))
    return dict(coords=groups.coords, shards=shards, losses=losses)


def _resume_on(config, par, save_dir):
    groups = ProcessGroups.build(par)
    model, optimizer = _setup(config, par, groups, seed=1)
    _load(save_dir, model, optimizer, config, groups)
    shards = _shards(model, optimizer)
    losses = _train(model, optimizer, groups, range(SAVE_AT, STEPS))
    return dict(coords=groups.coords, shards=shards, losses=losses)


def _dense(results, par, what) -> dict:
    """The dense tensors of `what` ("param", "exp_avg", ...) from the ranks of DP replica 0."""
    replica = [r for r in results if r["coords"]["dp"] == 0]
    return gather_state_dict([r["shards"][what] for r in replica], par)


def _global_losses(results, par) -> torch.Tensor:
    """[steps] the mean loss over the global batch: the mean over DP replicas (every row has as many
    targets) of the last stage's losses."""
    last = [r for r in results if r["coords"]["pp"] == par.pp - 1 and r["coords"]["tp"] == 0]
    return torch.stack([torch.stack(r["losses"]) for r in last]).mean(0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint saved on tp2 x pp2 (vocab-parallel, tied embeddings over two stages)."""
    save_dir = str(tmp_path_factory.mktemp("tp2_pp2"))
    results = run_ranks(_save_for_resharding, SAVED_LAYOUT.world_size, _config(), SAVED_LAYOUT, save_dir)
    return save_dir, results


def _chunks(path) -> dict:
    """{DCP key: the (offsets, sizes) of each chunk saved}, from the checkpoint's index."""
    index = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks) for k, v in index.items()}


def test_checkpoint_holds_each_shard_once_as_the_plan_places_it(saved):
    save_dir, _ = saved
    chunks = _chunks(latest_checkpoint(save_dir))
    config = _config()
    names = [n for n in MiniMindForCausalLM(config).state_dict() if n != "lm_head.weight"]  # tied: saved once
    assert sorted(k for k in chunks if k.startswith("model.")) == sorted(f"model.{n}" for n in names)
    for name in names:
        shape = plan_of(name).shape(config)
        dim = tp_split_dim(name, SAVED_LAYOUT)
        if dim is None:   # replicated over TP: one chunk, though two TP ranks (and two stages if tied) hold it
            expected = [((0,) * len(shape), shape)]
        else:             # split over TP: one chunk per TP rank
            half = tuple(n // 2 if d == dim else n for d, n in enumerate(shape))
            expected = [(tuple(half[d] * t if d == dim else 0 for d in range(len(shape))), half) for t in (0, 1)]
        for key in (f"model.{name}", f"optim.{name}.exp_avg", f"optim.{name}.exp_avg_sq"):
            assert chunks[key] == expected, key
        assert chunks[f"optim.{name}.step"] == [((), ())]
    assert sorted(k for k in chunks if k.startswith("rng.")) == [f"rng.rank{r}.cpu" for r in range(4)]


@pytest.mark.parametrize("par", [
    pytest.param(ParallelConfig(), id="tp1"),
    pytest.param(ParallelConfig(dp=2), id="dp2"),
    pytest.param(ParallelConfig(tp=4, vocab_parallel=True, sequence_parallel=True), id="tp4_sp_vp"),
    pytest.param(ParallelConfig(pp=4), id="pp4"),
])
def test_checkpoint_reshards_onto_another_layout(saved, par):
    save_dir, saved_results = saved
    results = run_ranks(_resume_on, par.world_size, _config(), par, save_dir)
    for what in ("param", "exp_avg", "exp_avg_sq"):
        before, after = _dense(saved_results, SAVED_LAYOUT, what), _dense(results, par, what)
        # a tied pair is one Parameter on one stage: compare the names the target layout holds
        assert set(after) <= set(before) and set(before) - set(after) <= {"lm_head.weight"}
        for name in after:
            assert torch.equal(after[name], before[name]), f"{what} {name}"
    steps = [step for r in results for step in r["shards"]["step"].values()]
    assert all(torch.equal(step, torch.tensor(float(SAVE_AT))) for step in steps)
    torch.testing.assert_close(_global_losses(results, par), _global_losses(saved_results, SAVED_LAYOUT),
                               rtol=2e-5, atol=0)


# --- atomicity -------------------------------------------------------------------------------------


def _die_during_second_save(config, par, save_dir, shards_dir, where):
    """Save after step 1, keep this rank's shards, train a step, then die saving step 2: rank 1
    right after writing its data files, before DCP's index exists ("while_writing"); rank 0 at
    the rename of the complete temporary directory ("at_rename"); rank 0 after the rename, at
    the marker ("at_marker")."""
    groups = ProcessGroups.build(par)
    model, optimizer = _setup(config, par, groups, seed=0)
    _train(model, optimizer, groups, range(1))
    _save(save_dir, 1, model, optimizer, config, groups)
    torch.save(_shards(model, optimizer), os.path.join(shards_dir, f"{groups.rank}.pt"))
    _train(model, optimizer, groups, range(1, 2))
    if where == "while_writing" and groups.rank == 1:
        write = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write(self, plan, planner).wait()
            os._exit(1)
        dcp.FileSystemWriter.write_data = write_then_die
    if where == "at_rename" and groups.rank == 0:
        rename = os.rename   # DCP renames its own index into place: only the checkpoint's rename dies

        def die_at_checkpoint_rename(src, dst):
            if os.path.basename(src).startswith(".tmp-step"):
                os._exit(1)
            rename(src, dst)
        os.rename = die_at_checkpoint_rename
    if where == "at_marker" and groups.rank == 0:
        directory.write_marker = lambda *args: os._exit(1)
    _save(save_dir, 2, model, optimizer, config, groups)


@pytest.mark.parametrize("where", ["while_writing", "at_rename", "at_marker"])
def test_killed_save_leaves_the_previous_checkpoint_latest(where, tmp_path):
    par, config = ParallelConfig(pp=2), _config()
    save_dir, shards_dir = tmp_path / "save", tmp_path / "shards"
    shards_dir.mkdir()
    with pytest.raises(AssertionError):   # a rank died (the other may report its lost peer first)
        run_ranks(_die_during_second_save, par.world_size, config, par, str(save_dir), str(shards_dir), where)
    second = [p for p in save_dir.iterdir() if "step_00000002" in p.name]   # what the killed save wrote
    assert len(second) == 1 and any(f.suffix == ".distcp" for f in second[0].iterdir())
    assert second[0].name.startswith(".tmp-") == (where != "at_marker")
    assert (second[0] / ".metadata").exists() == (where != "while_writing")
    assert latest_checkpoint(str(save_dir)) == str(save_dir / "step_00000001")
    # the previous checkpoint loads (here in one process, onto tp1) and holds step 1's state
    groups = ProcessGroups.single()
    model, optimizer = _setup(config, groups.par, groups, seed=1)
    assert _load(str(save_dir), model, optimizer, config, groups) == {**EXTRA, "step": 1}
    saved = [torch.load(shards_dir / f"{r}.pt") for r in range(par.world_size)]
    loaded = _shards(model, optimizer)
    for what in ("param", "exp_avg", "exp_avg_sq"):
        dense = gather_state_dict([s[what] for s in saved], par)
        for name, value in loaded[what].items():
            assert torch.equal(value, dense[name]), f"{what} {name}"
    # the next save of step 2 clears or replaces what the killed one left behind
    _save(str(save_dir), 2, model, optimizer, config, groups)
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert latest_checkpoint(str(save_dir)) == str(save_dir / "step_00000002")


def test_saving_a_step_again_replaces_it_and_latest_stays_complete(tmp_path):
    config, groups = _config(), ProcessGroups.single()
    model, optimizer = _setup(config, groups.par, groups, seed=0)
    _train(model, optimizer, groups, range(1))
    _save(str(tmp_path), 1, model, optimizer, config, groups)
    _train(model, optimizer, groups, range(1, 2))
    expected = _shards(model, optimizer)
    _save(str(tmp_path), 1, model, optimizer, config, groups)   # the same step, newer weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    model, optimizer = _setup(config, groups.par, groups, seed=1)
    _load(str(tmp_path), model, optimizer, config, groups)
    for name, value in _shards(model, optimizer)["param"].items():
        assert torch.equal(value, expected["param"][name]), name


def test_a_checkpoint_saved_before_the_first_step_leaves_no_optimizer_state(tmp_path):
    config, groups = _config(), ProcessGroups.single()
    model, optimizer = _setup(config, groups.par, groups, seed=0)
    _save(str(tmp_path), 0, model, optimizer, config, groups)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, optimizer = _setup(config, groups.par, groups, seed=1)
    _train(model, optimizer, groups, range(1))
    assert _load(str(tmp_path), model, optimizer, config, groups) == {**EXTRA, "step": 0}
    assert not optimizer.state
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), name


# --- bad input -------------------------------------------------------------------------------------


def test_checkpoint_of_another_model_config_is_refused_naming_the_field(saved):
    save_dir, _ = saved
    assert read_checkpoint_config(save_dir) == read_checkpoint_config(latest_checkpoint(save_dir))
    assert read_checkpoint_config(save_dir)["num_key_value_heads"] == TINY["num_key_value_heads"]
    check_checkpoint_config(save_dir, _config())
    check_checkpoint_config(save_dir, _config(flash_attn=False))   # a kernel choice, not the model
    for field, value in [("num_key_value_heads", 2), ("tie_word_embeddings", False), ("rope_theta", 1e4)]:
        with pytest.raises(ConfigError) as err:
            check_checkpoint_config(save_dir, _config(**{field: value}))
        message = str(err.value)
        assert "\n" not in message
        assert f"{field}={getattr(_config(), field)!r} in the checkpoint" in message
        assert f"{field}={value!r} now" in message
    # load_checkpoint refuses too, before reading any tensor
    other = _config(num_key_value_heads=2)
    groups = ProcessGroups.single()
    model, optimizer = _setup(other, groups.par, groups, seed=1)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        _load(save_dir, model, optimizer, other, groups)


def test_a_directory_without_a_complete_checkpoint_has_none(tmp_path, saved):
    assert latest_checkpoint(str(tmp_path)) is None
    assert latest_checkpoint(str(tmp_path / "absent")) is None
    with pytest.raises(ConfigError, match="no complete checkpoint") as err:
        resolve_checkpoint(str(tmp_path))
    assert "\n" not in str(err.value)
    # a marker naming a missing directory, or one without DCP's index, names nothing
    (tmp_path / "latest").write_text("step_00000003\n")
    assert latest_checkpoint(str(tmp_path)) is None
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / "step_00000003" / "meta.json").write_text("{}")
    assert latest_checkpoint(str(tmp_path)) is None
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        check_checkpoint_config(str(tmp_path), _config())
    # a complete checkpoint may be named directly
    save_dir, _ = saved
    assert resolve_checkpoint(latest_checkpoint(save_dir)) == latest_checkpoint(save_dir)


def test_a_save_directory_that_cannot_be_written_is_refused_and_none_is_created(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--save_dir") as err:
        check_save_dir(str(tmp_path / "file" / "checkpoints"))
    assert "\n" not in str(err.value) and str(tmp_path / "file" / "checkpoints") in str(err.value)
    with pytest.raises(ConfigError, match="it is a file"):
        check_save_dir(str(tmp_path / "file"))
    check_save_dir(str(tmp_path / "new" / "checkpoints"))
    assert not (tmp_path / "new").exists()   # the ranks make it at the first save


def test_a_missing_checkpoint_directory_is_said_not_to_exist(tmp_path):
    with pytest.raises(ConfigError) as err:
        resolve_checkpoint(str(tmp_path / "absent"))
    assert str(err.value) == f"checkpoint directory {tmp_path / 'absent'} does not exist"
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        resolve_checkpoint(str(tmp_path / "a_file"))


@pytest.mark.parametrize("meta", ["{\"step\": 4, \"config\": {", "[1, 2]", "{\"step\": 4}", "\udcff"],
                         ids=["truncated", "not_an_object", "missing_keys", "not_utf8"])
def test_a_corrupt_meta_json_is_one_line(tmp_path, saved, meta):
    save_dir, _ = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(latest_checkpoint(save_dir), copy)
    (copy / "meta.json").write_bytes(meta.encode("utf-8", "surrogateescape"))
    for read in (read_checkpoint_config, lambda p: check_checkpoint_config(p, _config())):
        with pytest.raises(ConfigError) as err:
            read(str(copy))
        assert "\n" not in str(err.value) and str(copy / "meta.json") in str(err.value), err.value


# --- keeping the last N, a full disk --------------------------------------------------------------


def _saved_steps(save_dir) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir())


def test_keep_last_keeps_the_newest_checkpoints_and_never_the_one_latest_does_not_name(tmp_path):
    config, groups = _config(), ProcessGroups.single()
    model, optimizer = _setup(config, groups.par, groups, seed=0)
    for step in (1, 2, 3):
        _save(str(tmp_path), step, model, optimizer, config, groups, keep_last=2)
    assert _saved_steps(tmp_path) == ["latest", "step_00000002", "step_00000003"]
    # what a save killed after its rename left (a complete step_5 that latest does not name), a save
    # killed before it (.tmp-*), and an earlier run's later step: none of them is pruned as "old"
    (tmp_path / "step_00000009").mkdir()
    (tmp_path / ".tmp-step_00000004-killed").mkdir()
    _save(str(tmp_path), 4, model, optimizer, config, groups, keep_last=1)
    assert _saved_steps(tmp_path) == ["latest", "step_00000004", "step_00000009"]
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_00000004")
    _save(str(tmp_path), 4, model, optimizer, config, groups, keep_last=1)   # the same step again
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_00000004")
    _save(str(tmp_path), 5, model, optimizer, config, groups)   # keep_last 0: keep all
    assert _saved_steps(tmp_path) == ["latest", "step_00000004", "step_00000005", "step_00000009"]


def _save_onto_a_full_disk(config, par, save_dir):
    """Save step 1, then step 2 with rank 1's data writes failing as on a full disk (ENOSPC)."""
    groups = ProcessGroups.build(par)
    model, optimizer = _setup(config, par, groups, seed=0)
    _train(model, optimizer, groups, range(1))
    _save(save_dir, 1, model, optimizer, config, groups)
    if groups.rank == 1:
        def full(self, plan, planner):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        dcp.FileSystemWriter.write_data = full
    try:
        _save(save_dir, 2, model, optimizer, config, groups)
    except CheckpointSaveError as e:
        return str(e)
    return None


def test_a_full_disk_fails_the_save_on_every_rank_with_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    par = ParallelConfig(tp=2)
    errors = run_ranks(_save_onto_a_full_disk, par.world_size, _config(), par, str(tmp_path))
    for error in errors:
        assert error == f"saving step 2 in {tmp_path} failed: rank 1: No space left on device", error
    assert _saved_steps(tmp_path) == ["latest", "step_00000001"]   # the partial save removed
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_00000001")


def test_a_full_disk_at_the_marker_fails_the_save_with_one_line(tmp_path, monkeypatch):
    config, groups = _config(), ProcessGroups.single()
    model, optimizer = _setup(config, groups.par, groups, seed=0)
    _save(str(tmp_path), 1, model, optimizer, config, groups)

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "latest"))
    monkeypatch.setattr(directory, "write_marker", full)
    with pytest.raises(CheckpointSaveError) as err:
        _save(str(tmp_path), 2, model, optimizer, config, groups)
    assert str(err.value) == f"saving step 2 in {tmp_path} failed: No space left on device: {tmp_path / 'latest'}"


# --- the mixture-of-experts model ------------------------------------------------------------------

MOE_SAVED = ParallelConfig(tp=2, pp=2, sequence_parallel=True)


def test_an_moe_checkpoint_reshards_from_tp2_pp2_sp_onto_one_rank(tmp_path):
    """MiniMind's MoE model (router and experts whole on every TP rank, each stage's aux loss in its
    own backward): saved on tp2 x pp2 with SP, loaded on one rank, every expert weight and AdamW
    state is where the plan puts it and the remaining steps give the same losses."""
    config = _config(use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    saved = run_ranks(_save_for_resharding, MOE_SAVED.world_size, config, MOE_SAVED, str(tmp_path))
    single = ParallelConfig()
    results = run_ranks(_resume_on, 1, config, single, str(tmp_path))
    for what in ("param", "exp_avg", "exp_avg_sq"):
        before, after = _dense(saved, MOE_SAVED, what), _dense(results, single, what)
        assert "model.layers.3.mlp.experts.3.up_proj.weight" in after
        assert set(after) <= set(before) and set(before) - set(after) <= {"lm_head.weight"}
        for name in after:
            assert torch.equal(after[name], before[name]), f"{what} {name}"
    torch.testing.assert_close(_global_losses(results, single), _global_losses(saved, MOE_SAVED), rtol=2e-5, atol=0)
