"""The scheduler's waiting requests, admitted round-robin across clients (engine-core process).

A daemon serves several frontends: one client's 20,000-request batch must not hold back another
client's single request until the batch has drained. Each client has its own FCFS queue; the head of
the whole queue is the head of the client whose turn it is, and taking it passes the turn on.
Preempted requests go back ahead of everything (they hold progress and were admitted before).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from coreserve.engine_core.request import Request


class WaitingQueue:
    """Removal is lazy (a removed request is skipped when it reaches a head): aborting all of a client's
    20,000 waiting requests costs O(n), not O(n^2)."""

    def __init__(self) -> None:
        self._resumed: deque[Request] = deque()  # preempted, newest first: re-admitted before any other
        self._by_client: OrderedDict[bytes, deque[Request]] = OrderedDict()  # first key: whose turn
        self._removed: set[Request] = set()  # still in a deque, to be skipped
        self._num = 0

    def __len__(self) -> int:
        return self._num

    def __bool__(self) -> bool:
        return self._num > 0

    def __getitem__(self, index: int) -> Request:
        """Only the head (index 0) is defined: the next request to admit."""
        if index != 0 or not self:
            raise IndexError("only the head of the waiting queue can be read")
        return self._head()[0]

    def append(self, req: Request) -> None:
        self._by_client.setdefault(req.client_id, deque()).append(req)
        self._num += 1

    def appendleft(self, req: Request) -> None:
        """A preempted request: it goes back ahead of all new ones."""
        self._resumed.appendleft(req)
        self._num += 1

    def popleft(self) -> Request:
        queue = self._head()
        req = queue.popleft()
        self._num -= 1
        if queue is not self._resumed:
            self._pass_turn(req.client_id, queue)
        return req

    def remove(self, req: Request) -> None:
        self._removed.add(req)
        self._num -= 1

    def _head(self) -> deque[Request]:
        """The deque whose first request is admitted next, with removed requests dropped from heads."""
        while self._resumed and self._resumed[0] in self._removed:
            self._removed.discard(self._resumed.popleft())
        if self._resumed:
            return self._resumed
        while True:
            client, queue = next(iter(self._by_client.items()))
            while queue and queue[0] in self._removed:
                self._removed.discard(queue.popleft())
            if queue:
                return queue
            del self._by_client[client]

    def _pass_turn(self, client: bytes, queue: deque[Request]) -> None:
        if queue:
            self._by_client.move_to_end(client)
        else:
            del self._by_client[client]
