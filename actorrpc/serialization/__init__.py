"""Serialization: pickle protocol 5, out-of-band tensor buffers, dill for code by value."""

from ._pickling import (
    PickleTarget,
    UnpickleSource,
    current_pickle_target,
    current_unpickle_source,
    dumps,
    dumps_for,
    loads,
    loads_from,
    register_reducer,
)

__all__ = [
    "PickleTarget",
    "UnpickleSource",
    "current_pickle_target",
    "current_unpickle_source",
    "dumps",
    "dumps_for",
    "loads",
    "loads_from",
    "register_reducer",
]
