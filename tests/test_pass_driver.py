"""Unit tests of the backward-pass driver (gradients handed back in replies)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from actorrpc.autograd._pass_driver import PassDriver, kept_positions
from actorrpc.errors import DistAutogradError

pytestmark = pytest.mark.timeout(30)


def _inline_submit(fn: Any, *args: Any) -> None:
    fn(*args)


class _Passes:
    """Fake local passes: continuing at message m returns what ``plan[m]`` says."""

    def __init__(self, plan: dict[int, tuple[list[torch.futures.Future], list[Any]]]) -> None:
        self.plan = plan
        self.ran: list[tuple[int, list[Any]]] = []
        self.kept: list[dict[int, int]] = []

    def __call__(self, message_id: int, grads: list[Any], kept: dict[int, int]) -> Any:
        self.ran.append((message_id, grads))
        self.kept.append(kept)
        step = self.plan[message_id]
        if isinstance(step, BaseException):
            raise step
        return step


def test_completes_only_after_handed_back_passes_and_their_messages() -> None:
    later: torch.futures.Future = torch.futures.Future()
    passes = _Passes({7: ([later], [(3, ["g3"])])})
    driver = PassDriver(passes, _inline_submit)
    first: torch.futures.Future = torch.futures.Future()
    driver.add([first], [(1, ["g1"])])
    assert not driver.result.done()
    first.set_result([(7, ["g7"])])  # the reply hands back gradients for send function 7
    assert passes.ran == [(7, ["g7"])]
    assert not driver.result.done()  # the pass at 7 sent a message still unanswered
    later.set_result(None)
    assert driver.result.wait() == [(1, ["g1"]), (3, ["g3"])]  # owed to our requester


def test_no_messages_completes_at_once() -> None:
    driver = PassDriver(_Passes({}), _inline_submit)
    driver.add([], [])
    assert driver.result.wait() == []


def test_first_error_is_raised_after_everything_finished() -> None:
    failing: torch.futures.Future = torch.futures.Future()
    slow: torch.futures.Future = torch.futures.Future()
    driver = PassDriver(_Passes({}), _inline_submit)
    driver.add([failing, slow], [])
    failing.set_exception(DistAutogradError("boom on worker1"))
    assert not driver.result.done()  # still waits for the other message
    slow.set_result(None)
    with pytest.raises(DistAutogradError, match="boom on worker1"):
        driver.result.wait()


def test_a_failing_handed_back_pass_fails_the_result() -> None:
    passes = _Passes({5: DistAutogradError("no send function for message 5")})
    driver = PassDriver(passes, _inline_submit)
    reply: torch.futures.Future = torch.futures.Future()
    driver.add([reply], [])
    reply.set_result([(5, [None])])
    with pytest.raises(DistAutogradError, match="message 5"):
        driver.result.wait()


@pytest.mark.parametrize("reply", ["nonsense", [(1,)], [("x", [])], [(1, "not a list")]])
def test_a_malformed_reply_fails_instead_of_hanging(reply: Any) -> None:
    driver = PassDriver(_Passes({}), _inline_submit)
    future: torch.futures.Future = torch.futures.Future()
    driver.add([future], [])
    future.set_result(reply)
    with pytest.raises(DistAutogradError, match="malformed reply"):
        driver.result.wait()


def test_a_reply_s_tensors_may_be_kept_at_their_last_use_within_one_message_only() -> None:
    """A reply handing back one tensor object for two messages (pickle's memo) marks it
    as not kept: the context must copy it (see ``DistAutogradContext.accumulate``). A
    tensor given twice within one message may be kept at its last position only."""
    shared, alone, other, twice = torch.ones(2), torch.zeros(2), torch.ones(3), torch.ones(4)
    passes = _Passes({7: ([], []), 8: ([], [])})
    driver = PassDriver(passes, _inline_submit)
    reply: torch.futures.Future = torch.futures.Future()
    driver.add([reply], [])
    reply.set_result([(7, [shared, alone, twice, twice]), (8, [shared, None, other])])
    expected = {id(alone): 1, id(twice): 3, id(other): 2}
    assert passes.kept == [expected] * 2
    assert kept_positions([[shared, shared], [None]]) == {id(shared): 1}
    assert kept_positions([[shared], [shared]]) == {}
    driver.result.wait()
