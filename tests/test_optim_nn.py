"""DistributedOptimizer and RemoteModule over the session's 3-worker group (this is worker0).

Module-level functions and classes here run on worker1/worker2 (they import this
module by reference). Parameters live on their owners; the tests compare every
distributed update with the same computation done locally with ``torch.optim``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import actorrpc as rpc
import actorrpc.autograd as dist_autograd
from actorrpc.agent import current_agent
from actorrpc.errors import DistAutogradError
from actorrpc.nn import RemoteModule
from actorrpc.optim import DistributedOptimizer

pytestmark = pytest.mark.timeout(60)

# -- helpers that run on the workers -------------------------------------------------------------


def _make_param(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A leaf parameter owned by the worker that runs this (via ``rpc.remote``)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).requires_grad_()


def _weighted(param_rref: rpc.RRef[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """On the owner: a differentiable function of its parameter and ``x``."""
    param = param_rref.local_value()
    return (torch.tanh(param * x) * x).sum()


def _weighted_local(param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(param * x) * x).sum()


def _value(param_rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
    return param_rref.local_value().detach().clone()


def _gradients_of(module_rref: rpc.RRef[nn.Module], context_id: int) -> list[torch.Tensor | None]:
    """On the owner: the context's gradient of each module parameter (None if absent)."""
    gradients = dist_autograd.get_gradients(context_id)
    return [gradients.get(p) for p in module_rref.local_value().parameters()]


_concurrency_lock = threading.Lock()
_active_steps = 0
_max_active_steps = 0
_step_count = 0


class CountingSGD(torch.optim.SGD):
    """SGD whose ``step`` records how many steps run at once in this process."""

    def step(self, closure: Any = None) -> Any:
        global _active_steps, _max_active_steps, _step_count
        with _concurrency_lock:
            _active_steps += 1
            _step_count += 1
            _max_active_steps = max(_max_active_steps, _active_steps)
        try:
            time.sleep(0.02)  # widens the window in which overlapping steps would be seen
            return super().step(closure)
        finally:
            with _concurrency_lock:
                _active_steps -= 1


def _reset_concurrency() -> None:
    global _active_steps, _max_active_steps, _step_count
    with _concurrency_lock:
        _active_steps = _max_active_steps = _step_count = 0


def _concurrency() -> tuple[int, int]:
    with _concurrency_lock:
        return _max_active_steps, _step_count


def _steps_running() -> int:
    with _concurrency_lock:
        return _active_steps


class FailingSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        raise ValueError("step exploded on purpose")


def _train_steps(param_rref: rpc.RRef[torch.Tensor], steps: int) -> int:
    """Runs on a trainer worker: its own optimizer over a parameter on another worker."""
    optimizer = DistributedOptimizer(CountingSGD, [param_rref], lr=0.01)
    x = torch.full(param_rref.to_here().shape, 0.5)
    for _ in range(steps):
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync(param_rref.owner(), _weighted, args=(param_rref, x))
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
    return steps


def _seeded_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


class WhereAmI(nn.Module):
    """Returns its input doubled and the name of the worker that ran ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
        return x * self.scale, rpc.get_worker_info().name


# -- helpers on this side ------------------------------------------------------------------------


def _fetch(rrefs: list[rpc.RRef[torch.Tensor]]) -> list[torch.Tensor]:
    return [rpc.rpc_sync(r.owner(), _value, args=(r,)) for r in rrefs]


def _loss(rrefs: list[rpc.RRef[torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """The sum of ``_weighted`` over the parameters, each computed on its owner."""
    total = torch.zeros(())
    for r in rrefs:
        if r.is_owner():
            total = total + _weighted_local(r.local_value(), x)
        else:
            total = total + rpc.rpc_sync(r.owner(), _weighted, args=(r, x))
    return total


def _expected_sgd(
    values: list[torch.Tensor], x: torch.Tensor, used: list[bool], **sgd_kwargs: Any
) -> list[torch.Tensor]:
    """The same loss and one ``torch.optim.SGD`` step, all in this process."""
    params = [v.clone().requires_grad_() for v in values]
    loss = sum(_weighted_local(p, x) for p, u in zip(params, used) if u)
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    optimizer = torch.optim.SGD(params, **sgd_kwargs)
    optimizer.step()
    return [p.detach() for p in params]


# -- DistributedOptimizer ------------------------------------------------------------------------


def test_step_applies_exactly_sgd_update(cluster: list[str]) -> None:
    local = _make_param(3, (5,))
    rrefs = [
        rpc.remote("worker1", _make_param, args=(1, (5,))),
        rpc.remote("worker2", _make_param, args=(2, (5,))),
        rpc.RRef(local),
    ]
    assert [r.owner().name for r in rrefs] == ["worker1", "worker2", "worker0"]
    before = _fetch(rrefs)
    x = torch.linspace(-1.0, 1.0, 5)
    kwargs = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
    optimizer = DistributedOptimizer(torch.optim.SGD, rrefs, **kwargs)
    with dist_autograd.context() as context_id:
        loss = _loss(rrefs, x)
        dist_autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    after = _fetch(rrefs)
    expected = _expected_sgd(before, x, [True, True, True], **kwargs)
    for got, want, old in zip(after, expected, before):
        assert not torch.equal(got, old)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
    assert local.grad is None  # gradients stay in the context, not in .grad


def test_step_without_id_uses_current_context(cluster: list[str]) -> None:
    rrefs = [
        rpc.remote("worker1", _make_param, args=(11, (4,))),
        rpc.remote("worker2", _make_param, args=(12, (4,))),
    ]
    before = _fetch(rrefs)
    x = torch.tensor([0.3, -0.2, 0.9, 1.5])
    optimizer = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.5)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [_loss(rrefs, x)])
        optimizer.step()
    expected = _expected_sgd(before, x, [True, True], lr=0.5)
    for got, want in zip(_fetch(rrefs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
    with pytest.raises(DistAutogradError, match="valid autograd context"):
        optimizer.step()  # outside any context


def test_parameters_without_gradients_are_unchanged(cluster: list[str]) -> None:
    used = rpc.remote("worker1", _make_param, args=(21, (3,)))
    unused_same_owner = rpc.remote("worker1", _make_param, args=(22, (3,)))
    unused_other_owner = rpc.remote("worker2", _make_param, args=(23, (3,)))
    rrefs = [used, unused_same_owner, unused_other_owner]
    before = _fetch(rrefs)
    x = torch.ones(3)
    # momentum and weight decay would move a parameter whose grad were zero instead of None
    optimizer = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.2, momentum=0.5, weight_decay=0.1)
    for _ in range(2):
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [_loss([used], x)])
            optimizer.step(context_id)
    after = _fetch(rrefs)
    assert not torch.equal(after[0], before[0])
    assert torch.equal(after[1], before[1])
    assert torch.equal(after[2], before[2])


def test_step_from_another_thread_skips_owners_outside_the_context(cluster: list[str]) -> None:
    """A thread outside the context steps it by id: worker2 never saw it and stays put."""
    rrefs = [
        rpc.remote("worker1", _make_param, args=(31, (3,))),
        rpc.remote("worker2", _make_param, args=(32, (3,))),
    ]
    before = _fetch(rrefs)
    x = torch.ones(3)
    optimizer = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.2)
    errors: list[BaseException] = []

    def step(context_id: int) -> None:
        try:
            optimizer.step(context_id)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [_loss(rrefs[:1], x)])
        thread = threading.Thread(target=step, args=(context_id,))
        thread.start()
        thread.join(timeout=30)
    assert not thread.is_alive() and not errors, errors
    expected = _expected_sgd(before[:1], x, [True], lr=0.2)
    after = _fetch(rrefs)
    torch.testing.assert_close(after[0], expected[0], rtol=0, atol=1e-7)
    assert torch.equal(after[1], before[1])


def test_step_with_unknown_context_id_raises_here(cluster: list[str]) -> None:
    param = rpc.remote("worker1", _make_param, args=(33, (2,)))
    optimizer = DistributedOptimizer(torch.optim.SGD, [param], lr=0.2)
    with dist_autograd.context() as context_id:
        pass
    message = f"Could not find autograd context with id: {context_id}"
    with pytest.raises(DistAutogradError, match=message):
        optimizer.step(context_id)


def test_concurrent_steps_are_serialized_per_worker(cluster: list[str]) -> None:
    rpc.rpc_sync("worker1", _reset_concurrency)
    threads_here, steps = 4, 3
    own = [rpc.remote("worker1", _make_param, args=(40 + i, (6,))) for i in range(threads_here)]
    trainer_param = rpc.remote("worker1", _make_param, args=(50, (6,)))
    errors: list[BaseException] = []
    start = threading.Barrier(threads_here + 1, timeout=30)

    def trainer_thread(param_rref: rpc.RRef[torch.Tensor]) -> None:
        try:
            optimizer = DistributedOptimizer(CountingSGD, [param_rref], lr=0.01)
            x = torch.full((6,), 0.5)
            start.wait()
            for _ in range(steps):
                with dist_autograd.context() as context_id:
                    loss = rpc.rpc_sync("worker1", _weighted, args=(param_rref, x))
                    dist_autograd.backward(context_id, [loss])
                    optimizer.step(context_id)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=trainer_thread, args=(r,)) for r in own]
    for thread in threads:
        thread.start()
    start.wait()
    other_trainer = rpc.rpc_async("worker2", _train_steps, args=(trainer_param, steps))
    for thread in threads:
        thread.join(timeout=50)
    assert not any(thread.is_alive() for thread in threads)
    assert other_trainer.wait() == steps
    assert not errors, errors
    max_active, count = rpc.rpc_sync("worker1", _concurrency)
    assert count == (threads_here + 1) * steps
    assert max_active == 1


def test_constructor_error_names_the_worker(cluster: list[str]) -> None:
    rrefs = [
        rpc.remote("worker1", _make_param, args=(61, (2,))),
        rpc.remote("worker2", _make_param, args=(62, (2,))),
    ]
    with pytest.raises(TypeError, match="bogus") as info:
        DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.1, bogus=1)
    assert "worker1" in str(info.value) or "worker2" in str(info.value)
    with pytest.raises(TypeError, match="worker2"):
        DistributedOptimizer(torch.optim.SGD, rrefs[1:], lr=0.1, bogus=1)


def test_step_error_names_the_worker(cluster: list[str]) -> None:
    param = rpc.remote("worker2", _make_param, args=(71, (2,)))
    optimizer = DistributedOptimizer(FailingSGD, [param], lr=0.1)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [_loss([param], torch.ones(2))])
        with pytest.raises(ValueError, match="step exploded on purpose") as info:
            optimizer.step(context_id)
    assert "worker2" in str(info.value)


def test_this_workers_own_optimizer_steps_here_without_a_call(cluster: list[str]) -> None:
    local = _make_param(81, (4,))
    rrefs = [rpc.remote("worker1", _make_param, args=(82, (4,))), rpc.RRef(local)]
    before = _fetch(rrefs)
    x = torch.tensor([0.5, -1.0, 2.0, 0.25])
    optimizer = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.3)
    stats = current_agent().stats
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [_loss(rrefs, x)])
        to_self, to_worker1 = stats.calls_sent[0], stats.calls_sent[1]
        optimizer.step(context_id)
        assert stats.calls_sent[0] == to_self  # no RPC to itself
        # (at least: a liveness ping of the I/O thread may go to worker1 meanwhile)
        assert stats.calls_sent[1] >= to_worker1 + 1
    expected = _expected_sgd(before, x, [True, True], lr=0.3)
    for got, want in zip(_fetch(rrefs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
    assert local.grad is None


def test_an_error_of_this_workers_own_step_names_it_in_the_owners_order(
    cluster: list[str],
) -> None:
    rpc.rpc_sync("worker1", _reset_concurrency)
    local = _make_param(83, (2,))
    remote_param = rpc.remote("worker1", _make_param, args=(84, (2,)))
    failing = DistributedOptimizer(FailingSGD, [rpc.RRef(local)], lr=0.1)
    counting = DistributedOptimizer(CountingSGD, [remote_param], lr=0.1)
    failing.remote_optimizers += counting.remote_optimizers  # one step over both owners
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [_loss([rpc.RRef(local), remote_param], torch.ones(2))])
        with pytest.raises(ValueError, match="step exploded on purpose") as info:
            failing.step(context_id)
        running = rpc.rpc_sync("worker1", _steps_running)
        _, count = rpc.rpc_sync("worker1", _concurrency)
    assert str(info.value).startswith("On WorkerInfo(id=0, name=worker0):")
    assert count == 1 and running == 0  # worker1's step ran, and had finished
    # the first error in the order of the owners: worker2's, listed before this worker's
    first = DistributedOptimizer(FailingSGD, [rpc.remote("worker2", _make_param, args=(85, (2,)))],
                                 lr=0.1)
    first.remote_optimizers += failing.remote_optimizers[:1]
    with dist_autograd.context() as context_id:
        with pytest.raises(ValueError, match="step exploded on purpose") as info:
            first.step(context_id)
    assert str(info.value).startswith("On WorkerInfo(id=2, name=worker2):")
    assert local.grad is None


def test_params_must_be_rrefs(cluster: list[str]) -> None:
    with pytest.raises(ValueError, match="RRef"):
        DistributedOptimizer(
            torch.optim.SGD, [torch.zeros(2, requires_grad=True)], lr=0.1  # type: ignore[list-item]
        )


# -- RemoteModule --------------------------------------------------------------------------------


def test_remote_module_forward_matches_local(cluster: list[str]) -> None:
    remote_net = RemoteModule("worker1/cpu", _seeded_net, args=(5,))
    local_net = _seeded_net(5)
    x = torch.randn(3, 4)
    expected = local_net(x)
    torch.testing.assert_close(remote_net(x), expected)
    future = remote_net.forward_async(x)
    assert isinstance(future, torch.futures.Future)
    torch.testing.assert_close(future.wait(), expected)
    fetched = remote_net.get_module_rref().to_here()
    for a, b in zip(fetched.state_dict().values(), local_net.state_dict().values()):
        assert torch.equal(a, b)
    torch.testing.assert_close(fetched(x), expected)


def test_remote_module_runs_on_its_owner(cluster: list[str]) -> None:
    module = RemoteModule("worker2/cpu", WhereAmI)
    out, where = module(torch.ones(2))
    assert where == "worker2"
    assert torch.equal(out, torch.full((2,), 2.0))
    out, where = module.forward_async(torch.ones(2)).wait()
    assert where == "worker2"
    assert module.get_module_rref().owner().name == "worker2"


def test_remote_parameters_are_owned_by_the_remote_worker(cluster: list[str]) -> None:
    remote_net = RemoteModule("worker1/cpu", _seeded_net, args=(6,))
    local_net = _seeded_net(6)
    params = remote_net.remote_parameters()
    assert len(params) == len(list(local_net.parameters()))
    for rref, local in zip(params, local_net.parameters()):
        assert isinstance(rref, rpc.RRef)
        assert rref.owner().name == "worker1"
        assert not rref.is_owner()
        assert torch.equal(rref.to_here(), local)


def test_gradients_flow_through_remote_module(cluster: list[str]) -> None:
    remote_net = RemoteModule("worker1/cpu", _seeded_net, args=(7,))
    local_net = _seeded_net(7)
    x = torch.randn(5, 4)
    local_net(x).pow(2).sum().backward()
    with dist_autograd.context() as context_id:
        loss = remote_net(x).pow(2).sum()
        dist_autograd.backward(context_id, [loss])
        gradients = rpc.rpc_sync(
            "worker1", _gradients_of, args=(remote_net.get_module_rref(), context_id)
        )
    assert len(gradients) == 4 and all(g is not None for g in gradients)
    for got, param in zip(gradients, local_net.parameters()):
        torch.testing.assert_close(got, param.grad)


def test_remote_module_trains_with_distributed_optimizer(cluster: list[str]) -> None:
    remote_net = RemoteModule("worker2/cpu", _seeded_net, args=(8,))
    local_net = _seeded_net(8)
    optimizer = DistributedOptimizer(torch.optim.SGD, remote_net.remote_parameters(), lr=0.1)
    local_optimizer = torch.optim.SGD(local_net.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for _ in range(3):
        with dist_autograd.context() as context_id:
            loss = (remote_net(x) - y).pow(2).mean()
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        local_optimizer.zero_grad()
        local_loss = (local_net(x) - y).pow(2).mean()
        local_loss.backward()
        local_optimizer.step()
        torch.testing.assert_close(loss, local_loss, rtol=0, atol=1e-6)


def test_cuda_remote_device_raises_value_error(cluster: list[str]) -> None:
    with pytest.raises(ValueError, match="CPU"):
        RemoteModule("worker1/cuda:0", nn.Linear, args=(2, 2))
    with pytest.raises(ValueError, match="worker name"):
        RemoteModule("/cpu", nn.Linear, args=(2, 2))
    with pytest.raises(ValueError, match="remote_device"):
        RemoteModule("worker1/gpu0", nn.Linear, args=(2, 2))  # not a device at all


def test_remote_module_constructor_error_reaches_caller(cluster: list[str]) -> None:
    with pytest.raises(TypeError, match="worker1"):
        RemoteModule("worker1/cpu", nn.Linear, args=(2, 2), kwargs={"bogus": True})


def test_remote_module_parameters_raises(cluster: list[str]) -> None:
    module = RemoteModule("worker1/cpu", nn.Linear, args=(2, 2))
    with pytest.raises(ValueError, match="remote_parameters"):
        module.parameters()
    for method in ("state_dict", "named_parameters", "to", "cuda", "children", "zero_grad"):
        with pytest.raises(ValueError, match=f"``{method}`` not supported for RemoteModule"):
            getattr(module, method)()


def _is_training(module_rref: rpc.RRef[nn.Module]) -> list[bool]:
    return [m.training for m in module_rref.local_value().modules()]


def test_remote_module_train_eval_and_rank_device(cluster: list[str]) -> None:
    module = RemoteModule("rank:2/cpu", _seeded_net, args=(9,))
    assert module.get_module_rref().owner().name == "worker2"
    assert module.eval() is module and not module.training
    assert rpc.rpc_sync("worker2", _is_training, args=(module.get_module_rref(),)) == [False] * 4
    module.train()
    assert rpc.rpc_sync("worker2", _is_training, args=(module.get_module_rref(),)) == [True] * 4
    with pytest.raises(ValueError, match="rank"):
        RemoteModule("rank:x/cpu", nn.Linear, args=(2, 2))
