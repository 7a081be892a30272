"""A save directory on disk: complete checkpoints, the `latest` marker, and the checks the launcher
runs before any rank starts.

    save_dir/
      latest                    one line: the name of the newest complete checkpoint
      step_00000010/            a complete checkpoint
        .metadata               DCP's index of every tensor and chunk (written last by DCP)
        __0_0.distcp ...        the tensor data, one file per writing rank
        meta.json               step, model config, layout, optimizer hyper-parameters, extra
      .tmp-step_00000020-<id>/  a save in progress (or killed): never named by `latest`

A checkpoint is complete when it holds both `.metadata` and `meta.json`. A save writes into a
fresh temporary directory, renames it to `step_{step:08d}` and only then rewrites `latest`
(unique temporary file, fsync, `os.replace`), so a run killed at any moment leaves `latest`
naming the previous complete checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import tempfile

from ..config import ConfigError, MiniMindConfig
from ..files import atomic_path, check_directory, fsync

MARKER = "latest"
META = "meta.json"
DCP_INDEX = ".metadata"
TMP_PREFIX = ".tmp-"
PREVIOUS_SUFFIX = ".previous"   # a checkpoint being replaced by a new save of the same step
# Not part of the model: an attention kernel choice (the weights and the function are the same).
CONFIG_FIELDS_NOT_COMPARED = ("flash_attn", "rope_scaling")   # how to run the weights, not what they are


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DCP_INDEX)) and os.path.isfile(os.path.join(path, META))


def latest_checkpoint(save_dir: str) -> str | None:
    """The complete checkpoint the `latest` marker of `save_dir` names, or None when there is none."""
    try:
        with open(os.path.join(save_dir, MARKER)) as f:
            name = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not name or os.sep in name or name.startswith(TMP_PREFIX):
        return None
    path = os.path.join(os.path.abspath(save_dir), name)
    return path if is_complete(path) else None


def resolve_checkpoint(path: str) -> str:
    """A complete checkpoint from `path`: the one a save directory's marker names, or `path`
    itself when it is a complete checkpoint. ConfigError (one line) when there is none."""
    if not os.path.exists(path):
        raise ConfigError(f"checkpoint directory {path} does not exist")
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint directory {path} is not a directory")
    found = latest_checkpoint(path)
    if found is None and is_complete(path):
        found = os.path.abspath(path)
    if found is None:
        raise ConfigError(f"no complete checkpoint in {path} (neither a '{MARKER}' marker naming one "
                          f"nor a directory holding {DCP_INDEX} and {META})")
    return found


def write_json(path: str, obj) -> None:
    """Write `obj` as JSON to `path` atomically and durably (unique temporary file, fsync, replace)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


META_KEYS = ("format_version", "step", "config", "layout", "optimizer_state", "param_groups", "extra")


def read_meta(path: str) -> dict:
    """meta.json of the complete checkpoint `path` resolves to; ConfigError (one line) when it is not
    the JSON object a save writes."""
    file = os.path.join(resolve_checkpoint(path), META)
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"checkpoint {file} cannot be read: {e}") from None
    missing = [k for k in META_KEYS if k not in meta] if isinstance(meta, dict) else list(META_KEYS)
    if missing or not isinstance(meta["config"], dict) or not isinstance(meta["extra"], dict):
        raise ConfigError(f"checkpoint {file} is not a checkpoint's meta.json: it lacks or mangles "
                          f"{', '.join(missing) or 'config / extra'}")
    return meta


def read_checkpoint_config(path: str) -> dict:
    """The model config (field -> value) a checkpoint was saved with; no ranks needed."""
    return read_meta(path)["config"]


def check_checkpoint_config(path: str, config: MiniMindConfig) -> None:
    """ConfigError naming the first model-config field whose value differs from the checkpoint's."""
    saved = read_checkpoint_config(path)
    for field in dataclasses.fields(config):
        if field.name in CONFIG_FIELDS_NOT_COMPARED:
            continue
        now, then = getattr(config, field.name), saved.get(field.name, "<absent>")
        if now != then:
            raise ConfigError(f"checkpoint {resolve_checkpoint(path)} has another model config: "
                              f"{field.name}={then!r} in the checkpoint, {field.name}={now!r} now")


def check_save_dir(save_dir: str) -> None:
    """ConfigError (one line) if `save_dir` cannot be created or written; creates nothing (the
    ranks make it at the first save)."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ConfigError(f"--save_dir {save_dir} cannot be written: it is a file")
    check_directory("--save_dir", save_dir)
    if os.path.isdir(save_dir):
        try:
            fd, probe = tempfile.mkstemp(prefix=TMP_PREFIX, dir=save_dir)
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"--save_dir {save_dir} cannot be written: {e.strerror or e}") from None


def new_temp_dir(save_dir: str, step: int) -> str:
    """A fresh, unique temporary directory for the save of `step`, after removing what killed saves
    left behind."""
    os.makedirs(save_dir, exist_ok=True)
    for name in os.listdir(save_dir):
        if name.startswith(TMP_PREFIX) and os.path.isdir(os.path.join(save_dir, name)):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    temp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{step_dir_name(step)}-", dir=save_dir)
    os.chmod(temp, 0o755)   # mkdtemp makes it private; a checkpoint is an ordinary data directory
    return temp


def publish(temp: str, save_dir: str, step: int) -> str:
    """Rename the complete checkpoint `temp` to `step_{step:08d}` and point `latest` at it.

    A directory of that name that `latest` does not name is a leftover (a run killed between the
    rename and the marker) and is replaced. If `latest` names it (the same step saved again), the
    old one is first renamed `step_{step:08d}.previous` and the marker names that, so the marker
    names a complete checkpoint at every moment."""
    name = step_dir_name(step)
    final, previous = os.path.join(save_dir, name), os.path.join(save_dir, name + PREVIOUS_SUFFIX)
    fsync(temp)
    if os.path.exists(final):
        if latest_checkpoint(save_dir) == os.path.abspath(final):
            shutil.rmtree(previous, ignore_errors=True)
            os.rename(final, previous)
            write_marker(save_dir, os.path.basename(previous))
        else:
            shutil.rmtree(final)
    os.rename(temp, final)
    fsync(save_dir)
    write_marker(save_dir, name)
    shutil.rmtree(previous, ignore_errors=True)
    return os.path.abspath(final)


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory's name `step_{step:08d}`, else None."""
    head, _, digits = name.partition("_")
    return int(digits) if head == "step" and len(digits) == 8 and digits.isdigit() else None


def prune(save_dir: str, keep_last: int) -> list[str]:
    """Keep the `keep_last` newest checkpoints up to the one `latest` names (torchtitan's
    `keep_latest_k`); remove the older `step_*` directories, each first renamed to a temporary name
    (a prune killed midway leaves a `.tmp-*` that the next save clears, never a half-deleted
    `step_*`). Never touches what `latest` names, a save in progress, or a later step than the
    latest (left by an earlier run replaced with --overwrite). A directory that cannot be removed
    now is left for the next prune. -> the names removed."""
    latest = latest_checkpoint(save_dir)
    if keep_last < 1 or latest is None:
        return []
    newest = step_of(os.path.basename(latest))
    steps = sorted((s, n) for n in os.listdir(save_dir) if (s := step_of(n)) is not None and s <= newest)
    removed = []
    for _, name in steps[:-keep_last]:
        path = os.path.join(save_dir, name)
        if os.path.abspath(path) == latest or not os.path.isdir(path):
            continue
        doomed = os.path.join(save_dir, f"{TMP_PREFIX}pruned-{name}-{secrets.token_hex(4)}")
        try:
            os.rename(path, doomed)   # atomic: from here on it is no checkpoint
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(name)
    return removed


def read_extra(path: str) -> dict:
    """The `extra` a checkpoint was saved with (the train run's state: step, data position, ...)."""
    return read_meta(path)["extra"]


def write_marker(save_dir: str, name: str) -> None:
    """Point `latest` at the checkpoint directory `name` (atomic and durable)."""
    with atomic_path(os.path.join(save_dir, MARKER)) as tmp:   # flushed, renamed, directory synced
        with open(tmp, "w") as f:
            f.write(name + "\n")
