"""Fair shares between the users of one API process.

The process is one client of the engine core, so the engine's per-client limit is shared by every HTTP user
here. Two bounds keep one user from taking it all:

- `UserAdmission`: a user has at most `limit` prompts in flight (a request of N prompts counts N); past it, 429.
- `EngineSlots`: at most `size` engine requests in flight from this process, never more than the engine admits
  from one client; a freed slot goes to the waiting user with the fewest requests in the engine, so a user with
  one prompt waits for one slot, not behind another user's thousand. Under the engine's priority policy a request
  waits here as it would in the engine's queue: the lowest priority value first (then the fairness rule), since
  with the window full the engine's own queue stays empty.
"""

import asyncio
import heapq
import itertools
from collections import Counter

from launch.api_server.errors import ApiError


class UserAdmission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.counts: Counter[str] = Counter()

    def admit(self, user: str, prompts: int) -> None:
        """Count the prompts against the user's limit, or raise ApiError 429."""
        if self.counts[user] + prompts > self.limit:
            raise ApiError(429, f"too many requests in flight: this user has {self.counts[user]} prompts in flight "
                                f"and asked for {prompts} more, past the limit of {self.limit} "
                                "(--max-user-requests)")
        self.counts[user] += prompts

    def release(self, user: str, prompts: int) -> None:
        self.counts[user] -= prompts
        if self.counts[user] <= 0:
            del self.counts[user]


class EngineSlots:
    def __init__(self, size: int) -> None:
        self.free = size
        self.in_engine: Counter[str] = Counter()
        self.waiting: dict[str, list[tuple[int, int, asyncio.Future]]] = {}  # per user: (priority, arrival, waiter)
        self.arrivals = itertools.count()

    async def acquire(self, user: str, priority: int = 0) -> None:
        """Wait for a slot, granted by priority, then fairly; a cancelled wait holds none."""
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self.waiting.setdefault(user, []), (priority, next(self.arrivals), future))
        self._grant()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted just before the cancel: give it back
                self.release(user)
            raise

    def release(self, user: str) -> None:
        self.in_engine[user] -= 1
        if not self.in_engine[user]:
            del self.in_engine[user]
        self.free += 1
        self._grant()

    def _grant(self) -> None:
        while self.free and self.waiting:
            # ties: the user waiting longest
            user = min(self.waiting, key=lambda u: (self.waiting[u][0][0], self.in_engine[u]))
            queue = self.waiting[user]
            _, _, future = heapq.heappop(queue)
            if not queue:
                del self.waiting[user]
            if future.cancelled():
                continue
            future.set_result(None)
            self.free -= 1
            self.in_engine[user] += 1
