"""`Frozen`: a configuration dataclass as an argument of a memoised function; `cached_property`.

The planner asks the memory model about thousands of layouts of one model; what depends only on
the model and the layout's shape (a stage's parameters, its ZeRO buffer) is the same for most of
them. `functools.lru_cache` remembers such pure functions, but needs hashable arguments, and the
configurations (`MiniMindConfig`, whose `rope_scaling` is a dict) are mutable dataclasses. A
`Frozen` carries the object and a key of its fields' values taken when it is made: two configs
with equal fields are one key, and a config changed afterwards makes a new one.

`cached_property`: functools.cached_property without its lock, for the sizes the memory model
derives thousands of times a plan.
"""
from __future__ import annotations


class Frozen:
    """`config` (a dataclass instance, no slots) keyed by the repr of its fields' values."""

    __slots__ = ("config", "key")

    def __init__(self, config):
        self.config = config
        self.key = (type(config), repr(vars(config)))

    def __hash__(self) -> int:
        return hash(self.key)

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
