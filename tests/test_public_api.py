"""The public surface of ``actorrpc``: exports must not drift, torch names must exist."""

from __future__ import annotations

import inspect

import pytest
import torch

import actorrpc
import actorrpc as rpc
import actorrpc.autograd
import actorrpc.functions
import actorrpc.nn
import actorrpc.optim
from actorrpc import errors
from actorrpc.optim import DistributedOptimizer

pytestmark = pytest.mark.timeout(60)

# Frozen on purpose: adding or removing an export must be a deliberate change here too.
EXPECTED_ALL = [
    "ActorRpcError",
    "AlreadyInitializedError",
    "BackendType",
    "DeserializationError",
    "DistAutogradError",
    "Future",
    "InvalidArgumentError",
    "InvalidNameError",
    "LocalWorkers",
    "NotInitializedError",
    "PeerUnreachableError",
    "ProtocolError",
    "RRef",
    "RRefError",
    "RemoteError",
    "RendezvousError",
    "RpcBackendOptions",
    "RpcTimeoutError",
    "SerializationError",
    "ShutdownError",
    "TensorPipeRpcBackendOptions",
    "UnknownWorkerError",
    "WorkerInfo",
    "WorkerLeftError",
    "ZmqRpcBackendOptions",
    "autograd",
    "compiled_modules",
    "functions",
    "get_rpc_timeout",
    "get_rref_debug_info",
    "get_worker_info",
    "get_worker_infos",
    "get_worker_stats",
    "init_rpc",
    "is_available",
    "is_initialized",
    "local_workers",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "start_tracing",
    "stop_tracing",
]

TORCH_NAMES = [
    "init_rpc",
    "rpc_sync",
    "rpc_async",
    "remote",
    "shutdown",
    "get_worker_info",
    "RRef",
    "WorkerInfo",
    "TensorPipeRpcBackendOptions",
    "BackendType",
    "functions",
    "is_available",
    "get_rpc_timeout",
]

ERROR_NAMES = [
    "ActorRpcError",
    "AlreadyInitializedError",
    "DeserializationError",
    "DistAutogradError",
    "InvalidArgumentError",
    "InvalidNameError",
    "NotInitializedError",
    "PeerUnreachableError",
    "ProtocolError",
    "RRefError",
    "RemoteError",
    "RendezvousError",
    "RpcTimeoutError",
    "SerializationError",
    "ShutdownError",
    "UnknownWorkerError",
    "WorkerLeftError",
]


def test_all_is_frozen():
    assert sorted(actorrpc.__all__) == sorted(EXPECTED_ALL)
    assert len(actorrpc.__all__) == len(set(actorrpc.__all__)), "duplicates in __all__"


def test_every_exported_name_exists():
    for name in actorrpc.__all__:
        assert hasattr(actorrpc, name), name


def test_star_import_gives_exactly_all():
    namespace: dict = {}
    exec("from actorrpc import *", namespace)
    exported = {k for k in namespace if k != "__builtins__"}
    assert exported == set(EXPECTED_ALL)


def test_torch_program_names_exist():
    for name in TORCH_NAMES:
        assert hasattr(rpc, name), name
        assert hasattr(torch.distributed.rpc, name), f"{name} is not even a torch name"
    assert rpc.BackendType.TENSORPIPE is not None
    assert callable(rpc.functions.async_execution)
    assert rpc.is_available() is True
    assert rpc.TensorPipeRpcBackendOptions is rpc.ZmqRpcBackendOptions


def test_signatures_match_torch():
    for name in ("rpc_sync", "rpc_async", "remote"):
        params = inspect.signature(getattr(rpc, name)).parameters
        assert list(params)[:5] == ["to", "func", "args", "kwargs", "timeout"], name
        assert params["timeout"].default == -1.0
    params = inspect.signature(rpc.init_rpc).parameters
    assert list(params) == ["name", "backend", "rank", "world_size", "rpc_backend_options"]
    assert params["rank"].default == -1 and params["world_size"].default is None
    params = inspect.signature(rpc.shutdown).parameters
    assert list(params)[0] == "graceful" and params["graceful"].default is True
    assert "worker_name" in inspect.signature(rpc.get_worker_info).parameters


def test_tensorpipe_options_keywords_accepted():
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=8, rpc_timeout=20, init_method="tcp://127.0.0.1:1234"
    )
    assert (options.num_worker_threads, options.rpc_timeout) == (8, 20)
    options.set_device_map("worker1", {"cpu": "cpu"})
    options.set_devices(["cpu"])
    with pytest.raises(ValueError):
        rpc.ZmqRpcBackendOptions(rpc_timeout=-1)
    with pytest.raises(ValueError):
        rpc.ZmqRpcBackendOptions(num_worker_threads=0)


def test_errors_module_exports_every_error():
    assert sorted(errors.__all__) == sorted(ERROR_NAMES)
    for name in ERROR_NAMES:
        assert getattr(rpc, name) is getattr(errors, name)


def test_every_error_class_is_actorrpc_and_runtime_error():
    classes = [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ]
    assert {c.__name__ for c in classes} == set(ERROR_NAMES)
    for cls in classes:
        assert issubclass(cls, errors.ActorRpcError), cls
        assert issubclass(cls, RuntimeError), cls


def test_error_categories():
    assert issubclass(errors.RpcTimeoutError, TimeoutError)
    for cls in (errors.InvalidArgumentError, errors.InvalidNameError, errors.UnknownWorkerError):
        assert issubclass(cls, ValueError), cls
    assert issubclass(errors.InvalidNameError, errors.InvalidArgumentError)
    assert issubclass(errors.UnknownWorkerError, errors.InvalidArgumentError)
    assert issubclass(errors.ProtocolError, ValueError)
    assert issubclass(errors.SerializationError, TypeError)
    assert issubclass(errors.PeerUnreachableError, ConnectionError)
    remote = errors.RemoteError("msg", worker="w1", remote_type="X", remote_traceback="tb")
    assert (remote.worker, remote.remote_type, remote.remote_traceback) == ("w1", "X", "tb")
    assert str(remote) == "msg"


def test_functions_async_execution_marks_function():
    @rpc.functions.async_execution
    def f(x):
        fut = torch.futures.Future()
        fut.set_result(x)
        return fut

    assert f(3).wait() == 3
    assert f.__name__ == "f"


# "Public functions get torch-style docstrings with a two-worker example."
EXAMPLE_MODULES = [actorrpc, actorrpc.autograd, actorrpc.optim, actorrpc.nn, actorrpc.functions]
# Classes whose own public methods (those defined on the class itself) need an example too.
# (RemoteModule is left out: most of its methods are torch.nn.Module's.)
EXAMPLE_METHOD_CLASSES = {
    "actorrpc.RRef": rpc.RRef,
    # also RpcBackendOptions and TensorPipeRpcBackendOptions (aliases)
    "actorrpc.ZmqRpcBackendOptions": rpc.ZmqRpcBackendOptions,
    "actorrpc.Future": rpc.Future,
    "actorrpc.LocalWorkers": rpc.LocalWorkers,
    "actorrpc.optim.DistributedOptimizer": DistributedOptimizer,
}


def test_every_public_function_has_an_example():
    missing = []
    for module in EXAMPLE_MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue
            if "Example::" not in (obj.__doc__ or ""):
                missing.append(f"{module.__name__}.{name}")
    for qualname, cls in EXAMPLE_METHOD_CLASSES.items():
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            function = getattr(member, "__func__", member)  # classmethod, staticmethod
            if inspect.isfunction(function) and "Example::" not in (function.__doc__ or ""):
                missing.append(f"{qualname}.{name}")
    assert not missing, "public names without an 'Example::' in their docstring: " + ", ".join(
        missing
    )
