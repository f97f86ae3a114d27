"""Serialization: pickle protocol 5, out-of-band tensor buffers, dill for code by value."""

from ._pickling import (
    PickleTarget,
    UnpickleSource,
    current_pickle_target,
    current_unpickle_source,
    dumps,
    loads,
    pickling_for,
    register_reducer,
    unpickling_from,
)

__all__ = [
    "PickleTarget",
    "UnpickleSource",
    "current_pickle_target",
    "current_unpickle_source",
    "dumps",
    "loads",
    "pickling_for",
    "register_reducer",
    "unpickling_from",
]
