"""Serialization: pickle protocol 5, out-of-band tensor buffers, dill for code by value."""

from ._extension_codes import check_extension_codes
from ._function_refs import function_reference, resolve_function_reference
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
    "check_extension_codes",
    "current_pickle_target",
    "current_unpickle_source",
    "dumps",
    "dumps_for",
    "function_reference",
    "loads",
    "loads_from",
    "register_reducer",
    "resolve_function_reference",
]
