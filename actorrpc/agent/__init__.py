"""Agent layer: the worker actor, its rendezvous, futures, options and identities."""

from ._agent import (
    Agent,
    CallHook,
    CallRecord,
    IncomingRequest,
    current_agent,
    register_agent_plugin,
    set_current_agent,
)
from ._batch_scheduling import undo_inherited_batch
from ._call_result import CallResult, complete
from ._calls import EncodedReply, encode_reply, run_user_function
from ._futures import Future
from ._held import ignore_while_holding
from ._options import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT,
    BackendType,
    ZmqRpcBackendOptions,
    coerce_options,
)
from ._remote_exception import format_traceback
from ._shutdown import wait_until
from ._worker_info import MAX_NAME_LENGTH, WorkerInfo, validate_worker_name

__all__ = [
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_RPC_TIMEOUT",
    "MAX_NAME_LENGTH",
    "Agent",
    "BackendType",
    "CallHook",
    "CallRecord",
    "CallResult",
    "EncodedReply",
    "Future",
    "IncomingRequest",
    "WorkerInfo",
    "ZmqRpcBackendOptions",
    "coerce_options",
    "complete",
    "current_agent",
    "encode_reply",
    "format_traceback",
    "ignore_while_holding",
    "register_agent_plugin",
    "run_user_function",
    "set_current_agent",
    "undo_inherited_batch",
    "validate_worker_name",
    "wait_until",
]
