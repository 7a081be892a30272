"""Saving and loading a training state with `torch.distributed.checkpoint` (DCP): collective over
the world, any layout in, any layout out.

What one checkpoint holds (DCP keys; dense parameter names, see `placement`):

    model.<name>                     every parameter, as the plan places it
    optim.<name>.<state>             every optimizer state: AdamW's exp_avg, exp_avg_sq (placed
                                     like the parameter) and step (a scalar every rank holds);
                                     under --zero each rank writes its slices as chunks of them
                                     and a load under --zero reads only its slices' chunks
                                     (slices.py: nothing gathered; any zero level, DP size or
                                     layout resumes it)
    rng.rank<r>.<device type>        rank r's random generator states (cpu, and the accelerator's)
    meta.json                        step, model config, layout, optimizer hyper-parameters, extra
"""
from __future__ import annotations

import dataclasses
import numbers
import shutil

import torch
import torch.distributed as dist
from torch import nn

from ..config import MiniMindConfig, ParallelConfig
from ..data_parallel import unwrap
from ..distributed.loaded_types import is_dtensor
from ..groups import ProcessGroups
from ..plan import plan_of
from ..zero import DistributedOptimizer
from .directory import (META, check_checkpoint_config, new_temp_dir, prune, publish, read_meta, resolve_checkpoint,
                        write_json)
from .placement import as_held, checkpoint_key, local_part, placed, tp_mesh
from .slices import assemble, sliced_states, sliced_targets

FORMAT_VERSION = 1


class CheckpointSaveError(RuntimeError):
    """A save that could not be written (a full disk, ...), on every rank; one line. The save
    directory keeps the previous complete checkpoint as `latest`."""


def save_checkpoint(save_dir: str, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: MiniMindConfig, par: ParallelConfig, groups: ProcessGroups, extra: dict,
                    keep_last: int = 0) -> str:
    """Save the training state after `step` steps as `save_dir/step_{step:08d}` and point
    `save_dir/latest` at it once it is complete; returns its path. Collective over the world.
    `extra` (JSON-able: data position, ...) comes back from `load_checkpoint`. `keep_last` > 0:
    then remove all but the newest that many checkpoints (`directory.prune`). A write that fails
    (OSError on any rank: a full disk, ...) removes the partial save and raises CheckpointSaveError
    on every rank."""
    import torch.distributed.checkpoint as dcp  # here: slow to import (DTensor), needed to save or load only
    from torch.distributed.checkpoint.api import CheckpointException
    if extra.get("step", step) != step:
        raise ValueError(f"extra['step']={extra['step']} differs from the saved step {step}")
    temp, error = _broadcast_from_rank0(_on_rank0(groups, lambda: new_temp_dir(save_dir, step)))
    if error is None:
        mesh = tp_mesh(groups, _device_type(model))
        state = {"model": _model_tensors(model, config, par, mesh),
                 "optim": _optimizer_tensors(model, optimizer, config, par, mesh, groups),
                 "rng": {f"rank{groups.rank}": _rng_states(model)}}
        try:
            dcp.save(state, checkpoint_id=temp)
        except CheckpointException as e:   # every rank raises it, with each failed rank's exception
            error = _first_failure(e)
        if error is None:
            final, error = _broadcast_from_rank0(_on_rank0(groups, lambda: _publish(
                temp, save_dir, step, _meta(step, optimizer, config, par, extra, bool(state["optim"])), keep_last)))
    if error is not None:
        if groups.rank == 0 and temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
        raise CheckpointSaveError(f"saving step {step} in {save_dir} failed: {error}")
    return final


def _publish(temp: str, save_dir: str, step: int, meta: dict, keep_last: int) -> str:
    write_json(f"{temp}/{META}", meta)
    final = publish(temp, save_dir, step)
    prune(save_dir, keep_last)
    return final


def _on_rank0(groups: ProcessGroups, fn) -> tuple:
    """(fn()'s value, None) on rank 0, or (None, the one-line text of the OSError it raised); (None,
    None) on other ranks."""
    if groups.rank != 0:
        return None, None
    try:
        return fn(), None
    except OSError as e:
        return None, _os_error_text(e)


def _os_error_text(e: OSError) -> str:
    return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")


def _first_failure(e) -> str:
    """One line for DCP's failure (its CheckpointException `e`): the first failed rank's error (its traceback is DCP's, not ours)."""
    rank, (exc, _) = min(e.failures.items())
    text = _os_error_text(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
    return f"rank {rank}: {text.splitlines()[0] if text else type(exc).__name__}"


def load_checkpoint(path: str, *, model: nn.Module, optimizer: torch.optim.Optimizer, config: MiniMindConfig,
                    par: ParallelConfig, groups: ProcessGroups) -> dict:
    """Load the checkpoint `path` (a checkpoint, or a save directory's latest) into this rank's
    shard of the model and its optimizer, whatever layout saved it (DCP reshards). The RNG states
    are restored when the layout is the saved one. Returns the saved extra with its "step".
    Collective over the world; ConfigError if the checkpoint's model config differs."""
    import torch.distributed.checkpoint as dcp  # here: slow to import (DTensor), needed to save or load only
    path = resolve_checkpoint(path)
    check_checkpoint_config(path, config)
    meta = read_meta(path)
    mesh = tp_mesh(groups, _device_type(model))
    params = dict(unwrap(model).named_parameters())
    state = {"model": {checkpoint_key(n, config): placed(torch.empty_like(p), n, config, par, mesh)
                       for n, p in params.items()}}
    rects = None
    if meta["optimizer_state"] and isinstance(optimizer, DistributedOptimizer):   # this rank's slices only
        state["optim"], rects = sliced_targets(path, optimizer, config, par, groups)
    elif meta["optimizer_state"]:
        state["optim"] = _empty_optimizer_tensors(path, params, config, par, mesh)
    # a field the saving version did not have yet (zero, ...) held its default there
    same_layout = {**dataclasses.asdict(ParallelConfig()), **meta["layout"]} == dataclasses.asdict(par)
    if same_layout:
        state["rng"] = {f"rank{groups.rank}": {k: torch.empty_like(v) for k, v in _rng_states(model).items()}}
    dcp.load(state, checkpoint_id=path)
    with torch.no_grad():
        for name, p in params.items():
            local_part(p).copy_(local_part(as_held(state["model"][checkpoint_key(name, config)], p)))
    optimizer.state.clear()   # saved before the first step: no state, as then
    if meta["optimizer_state"]:
        _load_optimizer(optimizer, params, state["optim"], meta["param_groups"], config, rects)
    if same_layout:
        _set_rng_states(model, state["rng"][f"rank{groups.rank}"])
    return meta["extra"]


def _model_tensors(model, config, par, mesh) -> dict:
    return {checkpoint_key(n, config): placed(p.detach(), n, config, par, mesh)
            for n, p in unwrap(model).named_parameters()}


def _optimizer_tensors(model, optimizer, config, par, mesh, groups) -> dict:
    """{key: {state: tensor}} of every parameter with optimizer state ({} before the first step).
    Under --zero each rank writes the distributed optimizer's slices as chunks of the dense states
    (`slices.sliced_states`), so a checkpoint describes the same tensors whatever the zero level
    (and loads at any)."""
    if isinstance(optimizer, DistributedOptimizer):
        return sliced_states(optimizer, config, par, groups)
    out = {}
    for name, p in unwrap(model).named_parameters():
        states = optimizer.state.get(p, {})
        out_p = {}
        for state, value in states.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {state!r} of {name} is not a tensor ({type(value).__name__})")
            out_p[state] = placed(value, name, config, par, mesh) if value.shape == p.shape else value
        if out_p:
            out[checkpoint_key(name, config)] = out_p
    return out


def _empty_optimizer_tensors(path, params, config, par, mesh) -> dict:
    """Targets for the saved optimizer states of this rank's parameters, read from DCP's index
    (`optim.<key>.<state>`): placed like the parameter when the saved state has the dense
    parameter's shape, else a whole tensor (a scalar such as AdamW's step)."""
    import torch.distributed.checkpoint as dcp  # here: slow to import (DTensor), needed to save or load only
    index = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out = {}
    for name, p in params.items():
        key = checkpoint_key(name, config)
        prefix = f"optim.{key}."
        saved = {fqn[len(prefix):]: info for fqn, info in index.items()
                 if fqn.startswith(prefix) and "." not in fqn[len(prefix):]}
        if not saved:
            raise ValueError(f"checkpoint {path} has no optimizer state for {key}")
        out[key] = {state: placed(torch.empty_like(p, dtype=info.properties.dtype), name, config, par, mesh)
                    if tuple(info.size) == plan_of(name).shape(config)
                    else torch.empty(tuple(info.size), dtype=info.properties.dtype)
                    for state, info in saved.items()}
    return out


def _load_optimizer(optimizer, params, loaded, saved_groups, config, rects=None) -> None:
    """Hand the loaded states to the optimizer through its own `load_state_dict` (which creates the
    state of a fresh optimizer), with the saved hyper-parameters of each param group. Under --zero
    `rects` says where the chunks read go in this rank's slices (`slices.assemble`)."""
    target = optimizer.inner if isinstance(optimizer, DistributedOptimizer) else optimizer
    index_of = {id(p): i for i, p in enumerate(p for g in target.param_groups for p in g["params"])}
    if isinstance(optimizer, DistributedOptimizer):   # each rank keeps its slices
        state = assemble(optimizer, loaded, rects)
    else:
        # a parameter sharded by FSDP2 (--zero 3) keeps its states as DTensors placed like it (the
        # targets made by `empty_like` of it); every other parameter takes its local part
        whole = {n: {k: as_held(v, p) if is_dtensor(p) else local_part(v)
                     for k, v in loaded[checkpoint_key(n, config)].items()} for n, p in params.items()}
        state = {index_of[id(p)]: whole[n] for n, p in params.items()}
    groups = []
    for group, saved in zip(target.param_groups, saved_groups, strict=True):
        restored = {k: type(group[k])(v) if isinstance(group[k], tuple) else v for k, v in saved.items() if k in group}
        groups.append({**group, **restored, "params": [index_of[id(p)] for p in group["params"]]})
    target.load_state_dict({"state": state, "param_groups": groups})


def _meta(step, optimizer, config, par, extra, has_optimizer_state) -> dict:
    return {"format_version": FORMAT_VERSION, "step": step, "config": dataclasses.asdict(config),
            "layout": dataclasses.asdict(par), "optimizer_state": has_optimizer_state,
            "param_groups": [{k: v for k, v in g.items() if k != "params" and _json_scalar(v)}
                             for g in optimizer.param_groups],
            "extra": dict(extra, step=step)}


def _json_scalar(value) -> bool:
    """Whether a param-group hyper-parameter goes to meta.json (a tensor learning rate does not)."""
    if isinstance(value, (tuple, list)):
        return all(_json_scalar(v) for v in value)
    return value is None or isinstance(value, (bool, numbers.Real, str))


def _device_type(model: nn.Module) -> str:
    return next(unwrap(model).parameters()).device.type


def _rng_states(model) -> dict:
    """The generator states of this rank: the CPU's, and the accelerator's when the model is on one."""
    states = {"cpu": torch.get_rng_state()}
    device = _device_type(model)
    if device != "cpu":
        states[device] = torch.get_device_module(device).get_rng_state()
    return states


def _set_rng_states(model, states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    device = _device_type(model)
    if device != "cpu":
        torch.get_device_module(device).set_rng_state(states[device])


def _broadcast_from_rank0(value):
    """Rank 0's `value` on every rank (the world; no-op without a process group)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
