"""What a transport's busy polls read before they spin without yielding
(``_zmq._SPIN_SECONDS``): when a socket last carried a message, and whether another
thread of the process was handed work (or took the core from a spin) a moment ago.

Both are written with plain stores from any thread and read without a lock: a store
seen late costs one poll that spins or yields when the other would have been better.
"""

from __future__ import annotations

__all__ = ["SHARED_CORE_PAUSE_SECONDS", "SocketActivity", "SpinGate"]

SHARED_CORE_PAUSE_SECONDS = 0.02
"""How long polls yield from their start after a hand-off or a spin that lost its core."""


class SocketActivity:
    """When a message last went by socket, in or out, in one transport (a hint for its
    busy polls: libzmq's threads may have it in hand)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = float("-inf")


class SpinGate:
    """Until when a transport's busy polls yield from their start: closed with a store
    (the agent's inbox at each hand-off, without a call on that path)."""

    __slots__ = ("closed_until", "pause")

    def __init__(self) -> None:
        self.closed_until = 0.0
        self.pause = SHARED_CORE_PAUSE_SECONDS  # how long a hand-off closes it

    def close_for_a_while(self, now: float) -> None:
        self.closed_until = now + self.pause
