"""``DistributedOptimizer``: one local optimizer per parameter owner, stepped by context.

Invariants:

* The parameters of one optimizer all live on its owner; the caller holds only
  RRefs to them.
* ``step(context_id)`` sets, on each owner, ``param.grad`` to the gradient the
  distributed autograd context holds for that parameter (``None`` when it holds
  none, so the optimizer leaves the parameter alone) and steps, under a lock
  shared by every local optimizer of that worker: concurrent steps from
  several trainers are serialized per worker, as the original design promises.
* The caller checks that the context exists on its side; an owner that never
  took part in the context (no forward or backward reached it) holds no
  gradients for it, so its parameters are left alone instead of failing.
* ``param.grad`` is reset to ``None`` after every step, even a failed one.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from ..agent import current_agent
from ..agent._remote_exception import pack_exception, rebuild_exception
from ..autograd import _current_context, _retrieve_context
from ..errors import DistAutogradError, InvalidArgumentError
from ..rref import RRef, remote

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """Lives on a parameter owner; wraps one ``torch.optim`` optimizer."""

    step_lock = threading.Lock()  # one per worker process: steps are serialized per worker

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        local_params_rref: list[RRef[torch.Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self._params = [rref.local_value() for rref in local_params_rref]
        self.optimizer = optimizer_class(self._params, *args, **kwargs)

    def step(self, autograd_context_id: int) -> None:
        """Step with the gradients of the context (none if this worker never saw it)."""
        try:
            gradients = _retrieve_context(autograd_context_id).gradients()
        except DistAutogradError:
            gradients = {}  # checked by the caller: this worker took no part in the context
        with _LocalOptimizer.step_lock:
            try:
                for param in self._params:
                    param.grad = gradients.get(param)
                self.optimizer.step()
            finally:
                for param in self._params:
                    param.grad = None


def _local_step(optimizer_rref: RRef[_LocalOptimizer], autograd_context_id: int) -> None:
    optimizer_rref.local_value().step(autograd_context_id)


def _wait_all(
    futures: Iterable[tuple[int, Any]], errors: dict[int, BaseException] | None = None
) -> None:
    """Wait for every ``(index, future)``; re-raise the error of the lowest index among
    theirs and ``errors`` (each names its worker)."""
    errors = {} if errors is None else errors
    for index, future in futures:
        try:
            future.wait()
        except Exception as exc:  # noqa: BLE001 - collected, the first is raised
            errors[index] = exc
    if errors:
        raise errors[min(errors)]


class DistributedOptimizer:
    """Optimizes parameters that live on several workers, from gradients of one context.

    Args:
        optimizer_class: any ``torch.optim.Optimizer`` subclass.
        params_rref: RRefs to the parameters (e.g. from ``RemoteModule.remote_parameters()``).
        *args, **kwargs: passed to ``optimizer_class`` on every owner.

    Example::

        >>> # on worker0, with worker1 owning a module
        >>> import actorrpc.autograd as dist_autograd
        >>> from actorrpc.optim import DistributedOptimizer
        >>> with dist_autograd.context() as context_id:
        ...     loss = remote_module.forward(x).sum()
        ...     dist_autograd.backward(context_id, [loss])
        ...     params = remote_module.remote_parameters()
        ...     opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
        ...     opt.step(context_id)
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: list[RRef[torch.Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        by_owner: dict[Any, list[RRef[torch.Tensor]]] = defaultdict(list)
        for param in params_rref:
            if not isinstance(param, RRef):
                raise InvalidArgumentError(
                    f"params_rref must hold RRefs to parameters, got {type(param).__name__}"
                )
            by_owner[param.owner()].append(param)
        self.remote_optimizers: list[RRef[_LocalOptimizer]] = [
            remote(owner, _LocalOptimizer, (optimizer_class, params, *args), kwargs)
            for owner, params in by_owner.items()
        ]
        _wait_all(enumerate(rref._get_future() for rref in self.remote_optimizers))

    def step(self, context_id: int | None = None) -> None:
        """Apply the gradients of ``context_id`` (default: the current context) everywhere.

        Owners step concurrently (this worker's own parameters on the calling
        thread); returns when all are done; the first error in the order of the
        parameters' owners, naming its worker, is raised.

        Example::

            >>> # on worker0
            >>> remote_module = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
            >>> params = remote_module.remote_parameters()
            >>> opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
            >>> with dist_autograd.context() as context_id:
            ...     dist_autograd.backward(context_id, [remote_module(torch.randn(3, 4)).sum()])
            ...     opt.step(context_id)  # SGD steps on worker1, where the parameters live
        """
        if context_id is None:
            context_id = _current_context().context_id
        else:
            _retrieve_context(context_id)  # "Could not find autograd context with id: N"
        agent = current_agent()
        futures = {
            index: agent.call(rref.owner(), _local_step, (rref, context_id), {})
            for index, rref in enumerate(self.remote_optimizers) if not rref.is_owner()
        }
        # this worker's own optimizer steps here while the others step (an RPC to
        # itself would cost two trips through its own inbox and a pool thread's turn);
        # its error reads as one that came back from a worker. (Unlike a step served
        # by a pool thread, a Ctrl-C may stop it partway.)
        errors: dict[int, BaseException] = {}
        for index, rref in enumerate(self.remote_optimizers):
            if rref.is_owner():
                try:
                    _local_step(rref, context_id)
                except Exception as exc:  # noqa: BLE001 - raised after the others finished
                    errors[index] = rebuild_exception(pack_exception(exc, repr(agent.info)))
        _wait_all(futures.items(), errors)
