"""`RememberingFakeTensorMode`: PyTorch's FakeTensorMode that remembers, per aten op and the
metadata of its inputs, what it made, and makes it again without asking FakeTensorMode.

Why: a fake-tensor training step dispatches every aten op through FakeTensorMode, whose own
dispatch cache builds a full metadata key of every argument (sparsity, symbolic sizes, memory
format, ...) and checks it on every hit; that key is most of the cost of `--estimate`. The ops of
one step repeat the same shapes layer after layer, step after step and cell after cell, and
none of them has symbolic sizes, so a key of each tensor's dtype, sizes, strides, offset, device
and flags decides the outputs' metadata just as well, at a fraction of the cost.

What is remembered is FakeTensorMode's own answer, recorded the first time an op is seen with
those inputs: for each output, either "input j itself" (an in-place op), "a view of input j's
storage" (shape, strides, offset) or "a new storage" (shape, strides, dtype, device). The
replay builds the outputs as FakeTensorMode's cache does (an empty meta tensor, set onto the
input's storage for a view, wrapped in a FakeTensor), so each output owns exactly the storage
the first answer owned and the memory tracker above it counts the same bytes.

Only what is safe to replay is remembered, the rest always goes to FakeTensorMode:
- ops FakeTensorMode itself would not cache (data-dependent or dynamic output shapes, in-place
  views, lifts, non-builtin ops: its `_validate_cache_key`), and ops outside `aten`;
- inputs that are not this mode's plain FakeTensors (real tensors, constants FakeTensorMode
  propagates values of, other modes' tensors) or arguments of an unknown kind;
- mutating ops other than pointwise in-place ones (and copy_ / zero_ / fill_), and any op that
  changed the metadata or storage size of an input when it was recorded;
- outputs that are not plain FakeTensors, carry a constant, require grad, or whose new storage
  is not exactly what `empty_strided` makes (an offset, a larger buffer, two outputs sharing it).

More answers skip FakeTensorMode's general handling of ops it does not cache (or caches per
offset), each doing what that handling does for the op:
- a c10d collective runs its Meta kernel (torch.distributed's fake collectives: the inputs back,
  with a FakeWork);
- a view op first seen with its inputs (a slice at a new offset, as the flat buffer of
  `training._all_reduce_grads` makes one per gradient) runs its own Meta kernel (a Meta or
  CompositeExplicitAutograd one, never a CompositeImplicitAutograd one, which may copy) on the
  fake inputs, as FakeTensorMode does for an op without a Python decomposition, instead of its
  Python decomposition of the view; each output is remembered as a view of its input's storage;
- AdamW's step counts: torch.tensor(x) of one CPU element (`lift_fresh`) is made the fake
  constant FakeTensorMode's converter makes of it (and remembered by that converter), an in-place
  pointwise op on a constant with plain numbers (`step += 1`) runs on the value, and item() of a
  constant is the item() of its value.

`memo` may be shared by several modes (one per cell of a sweep): it holds only metadata.
`tests/test_fake_memo.py::test_the_remembered_fake_dispatch_measures_what_fake_tensor_mode_measures`
checks that every report is byte-identical with and without it.
"""
from __future__ import annotations

import enum

import torch
from torch._subclasses.fake_tensor import (CONSTANT_NUMEL_LIMIT, FakeTensor, FakeTensorConfig, FakeTensorMode,
                                          in_kernel_invocation_manager)
from torch.utils._mode_utils import no_dispatch

_MISSING = object()
_DEVICE = torch.ops.prim.device.default
_ITEM = torch.ops.aten._local_scalar_dense.default
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_META = torch.device("meta")
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
# Refused by FakeTensorMode's own cache only for unbacked symbolic sizes, which never occur here.
_REMEMBERED_THOUGH_FAKE_CACHE_REFUSES = frozenset({torch.ops.aten._unsafe_view.default})
_MUTATING_ALLOWED = frozenset({torch.ops.aten.copy_.default, torch.ops.aten.zero_.default,
                               torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor})


def _leaves(tree) -> list:
    """The leaves of nested tuples / lists (an op's arguments or outputs)."""
    if isinstance(tree, (tuple, list)):
        return [leaf for x in tree for leaf in _leaves(x)]
    return [tree]


class Made(enum.Enum):
    """What an op's output was, as remembered: none, one of its inputs, a view of an input's
    storage, or a new storage."""
    NONE = enum.auto()
    SAME = enum.auto()
    VIEW = enum.auto()
    NEW = enum.auto()


class _NotRemembered(Exception):
    """An argument or output this memo does not replay."""


def _meta(t: torch.Tensor) -> tuple:
    """What decides an op's output metadata about one fake input (no symbolic sizes here)."""
    return (t.dtype, t.shape, t.stride(), t.storage_offset(), t._fake_device, t.layout,
            t.requires_grad, t.is_conj(), t.is_neg())


class _ConstantUpdates:
    """`op in updates`: whether an op is an in-place pointwise one (FakeTensorMode runs it on a
    constant's value; see `RememberingFakeTensorMode._update_constant`), known per op."""

    def __init__(self):
        self._known: dict = {}

    def __contains__(self, func) -> bool:
        known = self._known.get(func)
        if known is None:
            tags = func.tags
            known = self._known[func] = torch.Tag.pointwise in tags and torch.Tag.inplace in tags and \
                torch.Tag.nondeterministic_seeded not in tags and func._schema.is_mutable
        return known


class RememberingFakeTensorMode(FakeTensorMode):
    """`with RememberingFakeTensorMode(memo): ...` as FakeTensorMode (see the module's doc)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """TorchDispatchMode's switch: nothing under this mode is compiled, so its
        __torch_dispatch__ is not wrapped in torch._disable_dynamo (a frame-callback swap per op)."""
        return False

    def __init__(self, memo: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        self.memo = {} if memo is None else memo   # key -> outputs' recipe, or None: always dispatch
        self.replayed = 0                          # ops answered from the memo (for tests)
        self._templates: dict = {}                 # device -> a plain FakeTensor's attributes (`_wrap`)
        self._meta_kernels: dict = {}              # op -> whether it has a Meta kernel (a computed one for views)
        self._constant_updates = _ConstantUpdates()  # in-place pointwise ops (AdamW's `step += 1`)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE and not self.in_kernel_invocation:   # the autograd engine's most frequent question
            return args[0].fake_device
        if func is _LIFT_FRESH and not kwargs and self._liftable_constant(args[0]):
            return self._lift_constant(args[0])
        tensors: list = []
        try:
            key = self._key(func, args, kwargs, tensors)
        except _NotRemembered:
            updated = self._update_constant(func, args, kwargs) if func in self._constant_updates else None
            if updated is not None:
                return updated[0]
            return super().__torch_dispatch__(func, types, args, kwargs)
        recipe = self.memo.get(key, _MISSING)
        if recipe is _MISSING and func.is_view:
            recipe = self._view_recipe(func, args, kwargs, tensors, key)
        if recipe is _MISSING:
            before = [t.untyped_storage().nbytes() for t in tensors]
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.memo[key] = self._recipe(func, args, kwargs, tensors, before, key, out)
            return out
        if recipe is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        return self._replay(recipe, tensors)[0]

    def answer(self, func, args, kwargs):
        """For a dispatch mode above this one (the memory tracker's `answer`): (the op's outputs,
        its input tensors, its output tensors) from the memo, without dispatching the op down to
        this mode; None when the memo has no answer (the op is then dispatched, and remembered).
        Also the value of a constant's item() and its in-place updates (AdamW's step count, each
        parameter each step)."""
        if func is _ITEM and type(args[0]) is FakeTensor and args[0].constant is not None and not kwargs:
            return self._constant_item(args[0]), [args[0]], []
        if func.namespace == "c10d":
            return self._collective(func, args, kwargs or {})
        tensors: list = []
        try:
            key = self._key(func, args, kwargs or {}, tensors)
        except _NotRemembered:   # e.g. an op on a constant
            return self._update_constant(func, args, kwargs or {}) if func in self._constant_updates else None
        recipe = self.memo.get(key)
        if recipe is None and func.is_view and key not in self.memo:
            recipe = self._view_recipe(func, args, kwargs or {}, tensors, key)
        if recipe is None or recipe is _MISSING:
            return None
        out, made = self._replay(recipe, tensors)
        return out, tensors, made

    def _collective(self, func, args, kwargs):
        """A c10d collective on this mode's fake tensors: its Meta kernel, the one FakeTensorMode
        runs for it (torch.distributed's `_meta_registrations`: the output is the input tensors, with
        a FakeWork; no backend is called), run directly, without FakeTensorMode's general handling
        of an op it does not cache."""
        if not self._has_meta_kernel(func):
            return None
        tensors = [t for t in _leaves(args) + _leaves(list(kwargs.values())) if isinstance(t, torch.Tensor)]
        if any(type(t) is not FakeTensor or t.fake_mode is not self or t.constant is not None for t in tensors):
            return None
        with in_kernel_invocation_manager(self):
            out = func(*args, **kwargs)
        return out, tensors, [t for t in _leaves(out) if isinstance(t, torch.Tensor)]

    def _has_meta_kernel(self, func, explicit: bool = False) -> bool:
        """Whether `func` has a Meta kernel of its own (explicit: or its CompositeExplicitAutograd
        one, which views such as aten.slice have; never a CompositeImplicitAutograd one such as
        aten.to's, which may copy rather than view)."""
        known = self._meta_kernels.get((func, explicit))
        if known is None:
            has = torch._C._dispatch_has_kernel_for_dispatch_key
            known = self._meta_kernels[func, explicit] = has(func.name(), "Meta") or \
                (explicit and has(func.name(), "CompositeExplicitAutograd"))
        return known

    def _view_recipe(self, func, args, kwargs, tensors, key):
        """The recipe of a view op not yet seen with these inputs (a slice at a new offset: the
        flat buffer of `training._all_reduce_grads`), made from the op's own Meta kernel on the
        fake inputs' meta tensors, the kernel FakeTensorMode runs when it has no Python
        decomposition: each output is a view of an input's storage (shape, strides, offset), on
        that input's device. _MISSING when the op's outputs are not such views (FakeTensorMode
        then answers, and is remembered as any op)."""
        if not self._has_meta_kernel(func, explicit=True) or \
                any(t.layout is not torch.strided or t.fake_device != tensors[0].fake_device for t in tensors):
            return _MISSING
        with in_kernel_invocation_manager(self):
            out = func(*args, **kwargs)
        many = isinstance(out, (tuple, list))
        specs = []
        for o in (list(out) if many else [out]):
            j = next((j for j, t in enumerate(tensors) if isinstance(o, torch.Tensor) and type(o) is not FakeTensor
                      and o.layout is torch.strided and t.untyped_storage()._cdata == o.untyped_storage()._cdata), None)
            if j is None:
                return _MISSING
            specs.append((Made.VIEW, j, tuple(o.shape), o.stride(), o.storage_offset(), o.dtype,
                          tensors[j].fake_device, o.is_conj(), o.is_neg()))
        recipe = self.memo[key] = (type(out) if many else None, tuple(specs))
        return recipe

    # -- constants (AdamW's step counts) --------------------------------------------------------
    def _liftable_constant(self, t) -> bool:
        """torch.tensor(x) of one element on the CPU: FakeTensorMode makes it a constant
        (its `may_turn_const`, `CONSTANT_NUMEL_LIMIT`)."""
        return type(t) is torch.Tensor and t.layout is torch.strided and t.device.type == "cpu" and \
            t.numel() <= CONSTANT_NUMEL_LIMIT and not t.requires_grad and not t.is_quantized

    def _lift_constant(self, t: torch.Tensor) -> FakeTensor:
        """What FakeTensorMode makes of torch.tensor(x) (a `lift_fresh` of a real one-element
        tensor): a fake tensor carrying a copy of the value as its constant, remembered by its
        converter (for the constant's later in-place updates and aliases), made directly instead of
        through its meta converter's general description of a tensor."""
        with no_dispatch():
            value = t.clone()
            empty = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            fake = FakeTensor(self, empty, value.device, constant=value)
        converter = self.fake_tensor_converter
        converter.set_tensor_memo(value, fake)
        converter.add_constant_storage_mapping(fake)
        return fake

    def _update_constant(self, func, args, kwargs):
        """An in-place pointwise op on a constant with plain numbers (AdamW's `step += 1`), as
        FakeTensorMode's constant propagation runs it: the op on the value itself, and the fake
        tensor that carries it is the output. None when the op is another one."""
        if kwargs or not args or type(args[0]) is not FakeTensor or args[0].fake_mode is not self or \
                args[0].constant is None or not all(isinstance(a, (int, float, bool)) for a in args[1:]):
            return None
        fake, value = args[0], args[0].constant
        if self.fake_tensor_converter._get_memo(value) is not fake:
            return None
        with no_dispatch():
            func(value, *args[1:])
        return fake, [fake], [fake]

    def _constant_item(self, t: FakeTensor):
        """item() of a fake tensor that carries its value (a constant, e.g. made by torch.tensor):
        what FakeTensorMode's constant propagation computes, the op on the value itself."""
        with no_dispatch():
            return _ITEM(t.constant)

    # -- the key -------------------------------------------------------------------------------
    def _key(self, func, args, kwargs, tensors: list) -> tuple:
        if func.namespace != "aten":
            raise _NotRemembered
        parts = [func, torch.get_default_dtype(), torch.is_inference_mode_enabled(), len(args)]
        for x in args:   # the arguments' own level inline (most are this mode's tensors): as _flatten
            if type(x) is FakeTensor and x.fake_mode is self and x.constant is None:
                parts.append(_meta(x))
                tensors.append(x)
            else:
                self._flatten(x, parts, tensors)
        for name, value in kwargs.items():
            parts.append(name)
            self._flatten(value, parts, tensors)
        return tuple(parts)

    def _flatten(self, x, parts: list, tensors: list) -> None:
        if type(x) is FakeTensor:
            if x.fake_mode is not self or x.constant is not None:
                raise _NotRemembered
            parts.append(_meta(x))
            tensors.append(x)
        elif isinstance(x, (tuple, list)):
            parts.append((type(x), len(x)))
            for y in x:
                self._flatten(y, parts, tensors)
        elif isinstance(x, _SCALARS):
            parts.append((type(x), x))
        else:
            raise _NotRemembered

    # -- recording -----------------------------------------------------------------------------
    def _recipe(self, func, args, kwargs, tensors, before, key, out):
        try:
            if func not in _REMEMBERED_THOUGH_FAKE_CACHE_REFUSES:
                self._validate_cache_key(func, args, kwargs)   # FakeTensorMode's own refusals
        except Exception:   # its _BypassDispatchCache (private), or anything it cannot judge
            return None
        if func._schema.is_mutable and torch.Tag.pointwise not in func.tags and func not in _MUTATING_ALLOWED:
            return None
        after: list = []
        try:
            if self._key(func, args, kwargs, after) != key or \
                    [t.untyped_storage().nbytes() for t in after] != before:
                return None   # the op changed an input's metadata or storage: replay would not
            many = isinstance(out, (tuple, list))
            outs = list(out) if many else [out]
            specs, fresh = [], set()
            for o in outs:
                specs.append(self._output_spec(o, tensors, fresh))
        except _NotRemembered:
            return None
        return (type(out) if many else None, tuple(specs))

    @staticmethod
    def _output_spec(o, tensors, fresh: set) -> tuple:
        if o is None:
            return (Made.NONE,)
        for j, t in enumerate(tensors):
            if o is t:
                return (Made.SAME, j)
        if type(o) is not FakeTensor or o.constant is not None or o.requires_grad or o.layout is not torch.strided:
            raise _NotRemembered
        st = o.untyped_storage()
        shape, stride, offset = tuple(o.shape), o.stride(), o.storage_offset()
        flags = (o.dtype, o.fake_device, o.is_conj(), o.is_neg())
        for j, t in enumerate(tensors):
            if t.untyped_storage()._cdata == st._cdata:
                return (Made.VIEW, j, shape, stride, offset, *flags)
        span = 0 if o.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        if offset != 0 or st.nbytes() != span * o.element_size() or st._cdata in fresh:
            raise _NotRemembered
        fresh.add(st._cdata)
        return (Made.NEW, shape, stride, offset, *flags)

    # -- replay --------------------------------------------------------------------------------
    def _replay(self, recipe, tensors) -> tuple:
        """(the outputs as the op returns them, the output tensors in order)."""
        self.replayed += 1
        container, specs = recipe
        outs = []
        with torch._C._DisableTorchDispatch():   # plain meta tensors: no mode, no FakeTensor, sees these
            for spec in specs:
                kind = spec[0]
                if kind is Made.NEW:
                    _, shape, stride, offset, dtype, device, conj, neg = spec
                    empty = torch.empty_strided(shape, stride, dtype=dtype, device=_META)
                elif kind is Made.VIEW:
                    _, j, shape, stride, offset, dtype, device, conj, neg = spec
                    empty = torch.empty_strided(shape, stride, dtype=dtype, device=_META)
                    empty.set_(tensors[j].untyped_storage(), offset, shape, stride)
                else:
                    outs.append(None if kind is Made.NONE else tensors[spec[1]])
                    continue
                if conj:
                    torch._C._set_conj(empty, True)
                if neg:
                    torch._C._set_neg(empty, True)
                outs.append(self._wrap(empty, device))
        made = [o for o in outs if o is not None]
        if container is None:
            return outs[0], made
        return (container(*outs) if hasattr(container, "_fields") else container(outs)), made

    def _wrap(self, empty: torch.Tensor, device: torch.device) -> FakeTensor:
        """FakeTensor(self, empty, device), made faster: what its constructor sets on a plain fake
        tensor (no constant, real tensor or subclass type) on a device is the same for every one of
        this mode's, so it is taken from one made by the constructor (`_templates`, per device, the
        device normalised as the constructor does it; checked equal by tests/test_fake_memo.py)."""
        attributes = self._templates.get(device)
        if attributes is None:
            made = FakeTensor(self, empty, device)
            if not FakeTensorConfig.debug:   # in debug each keeps its own trace: no template
                self._templates[device] = dict(vars(made))
            return made
        t = torch.Tensor._make_subclass(FakeTensor, empty, False, dispatch_device=True,
                                        device_for_backend_keys=device)
        if self._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
        else:
            torch._C._set_throw_on_mutable_data_ptr(t)
        t.__dict__.update(attributes)
        return t
