"""`Frozen`: a configuration dataclass as an argument of a memoised function; `cached_property`.

The planner asks the memory model about thousands of layouts of one model; what depends only on
the model and the layout's shape (a stage's parameters, its ZeRO buffer) is the same for most of
them. `functools.lru_cache` remembers such pure functions, but needs hashable arguments, and the
configurations (`MiniMindConfig`, whose `rope_scaling` is a dict) are mutable dataclasses. A
`Frozen` carries the object and a key of its fields' values taken when it is made: two configs
with equal fields (of the same types) are one key, and a config changed afterwards makes a new one.

`cached_property`: functools.cached_property without its lock, for the sizes the memory model
derives thousands of times a plan.
"""
from __future__ import annotations

import dataclasses


class Frozen:
    """`config` (a dataclass instance, no slots) with `changes` to its fields (dataclasses.replace's,
    made only when `config` is read: a remembered function's key is made for every call, the
    config for a miss only), keyed by its fields' values and their types (by the text of the values
    where one cannot be hashed: a dict), the key's hash taken once."""

    __slots__ = ("_config", "_base", "_changes", "key", "_hash")

    def __init__(self, config, **changes):
        fields = vars(config)
        changes = {k: v for k, v in changes.items() if type(fields[k]) is not type(v) or fields[k] != v}
        self._base, self._changes, self._config = config, changes, None if changes else config
        values = tuple({**fields, **changes}.values() if changes else fields.values())
        try:
            self._hash = hash((type(config), values))
            self.key = (type(config), values, tuple(map(type, values)))
        except TypeError:   # a dict or list field (MiniMindConfig's rope_scaling)
            self.key = (type(config), repr({**fields, **changes}))
            self._hash = hash(self.key)

    @property
    def config(self):
        if self._config is None:
            self._config = dataclasses.replace(self._base, **self._changes)
        return self._config

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, Frozen) and self.key == other.key


class cached_property:  # noqa: N801 -- functools.cached_property's name and use
    """functools.cached_property without its lock (Python 3.11 takes one on every first read):
    the value is computed on the first read and kept in the instance's __dict__, which later reads
    find first. For the memory model's frozen sizes, read by one thread, thousands a plan."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value
