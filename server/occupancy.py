"""`Occupancy`: how many are inside something, and an event set exactly while none is.

A stream's items waiting for room (`streams.StreamRoom`: the stream reads no more while
any waits) and the text thread's reads in progress (`text_thread.TextThread`: the drain
waits until none is) are each one. Event-loop objects: entered and left on the loop.
"""

from __future__ import annotations

import asyncio


class Occupancy:
    """A count of those inside; `empty` is set exactly while it is 0 (at first too).
    A waiter woken by `empty` looks at it again: someone may have entered since."""

    def __init__(self) -> None:
        self._inside = 0
        self.empty = asyncio.Event()
        self.empty.set()

    def enter(self) -> None:
        self._inside += 1
        self.empty.clear()

    def leave(self) -> None:
        self._inside -= 1
        if self._inside == 0:
            self.empty.set()
