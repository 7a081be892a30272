"""Norm-output recompute: the column-parallel linears' saved input re-made from the norm's input.

The q/k/v and gate/up linears save their input X for the weight gradient dW = dY^T X. Where
that input is the RMSNorm's output itself -- under SP + async communication the local shard
[S/T, B, H] (`LinearWithAsyncCommunication`), under plain TP the replicated [S, B, H] -- the
block would keep a second copy of the normalised stream next to the norm's own saved input.
Under `--recompute selective` the attention and the MLP run inside saved-tensor hooks
(`torch.autograd.graph.saved_tensors_hooks`): a tensor saved there that is the norm output
or a view of it is packed as a recipe (the norm's input, weight and eps, and the view's
geometry); unpacking it in backward re-runs the norm's forward ops under no_grad
(`rms_norm_forward`: bit for bit the same output) and takes the same view. The norm saves its
input anyway, so the recipe holds no new bytes; the re-made output is a temporary of the
linear's backward. Every other saved tensor (basic SP's gathered copy among them) goes to the
saved-tensor hooks around ours, if any, as if ours were not there.

This is selective activation recompute in the sense of Korthikanti et al. 2022 (section 5):
recompute what is cheap to re-make (one elementwise norm per block input) and expensive to keep.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .rms_norm import rms_norm_forward


@dataclass(frozen=True, kw_only=True)
class _NormRecipe:
    """How to re-make a saved view of a norm's output."""
    x: torch.Tensor            # the norm's input (saved by the norm itself)
    weight: torch.Tensor
    eps: float
    size: tuple[int, ...]      # the saved tensor's geometry inside the output's storage
    stride: tuple[int, ...]
    offset: int


def _is_or_views(t: torch.Tensor, out: torch.Tensor) -> bool:
    """t is `out` or a view of it (`out` is a fresh tensor, never itself a view)."""
    return t is out or t._base is out


def _outer_hooks() -> tuple:
    """The saved-tensor hooks in force around ours (the memory tracker's, say), or identity:
    hooks do not nest, the innermost pair alone sees a saved tensor, so ours hand every tensor
    they keep to the outer pack and unpack (PyTorch exposes the pair only privately)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks if hooks is not None else (lambda t: t, lambda t: t)


@dataclass(frozen=True)
class _Kept:
    packed: object             # what the outer pack hook made of a tensor we do not re-make


@contextmanager
def recompute_norm_output(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """Inside: tensors saved for backward that are `out` (= the norm of x) or views of it are
    re-made in backward from x instead of being kept."""
    watched = [out]     # emptied on exit: autograd may keep the pack hook, which must not keep `out`
    outer_pack, outer_unpack = _outer_hooks()

    def pack(t: torch.Tensor):
        if not watched or not _is_or_views(t, watched[0]):
            return _Kept(outer_pack(t))
        return _NormRecipe(x=x, weight=weight, eps=eps, size=tuple(t.shape), stride=tuple(t.stride()),
                           offset=t.storage_offset())

    def unpack(saved):
        if isinstance(saved, _Kept):
            return outer_unpack(saved.packed)
        with torch.no_grad():
            remade, _ = rms_norm_forward(saved.x, saved.weight, saved.eps)   # [..., D], contiguous
        return remade.as_strided(saved.size, saved.stride, saved.offset)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        watched.clear()


def norm_with_recompute(norm, h: torch.Tensor):
    """(norm(h), the context in which its output's saved copies are re-made in backward)."""
    out = norm(h)
    return out, recompute_norm_output(out, h, norm.weight, norm.eps)
