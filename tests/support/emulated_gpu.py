"""One GPU time-sliced between rank processes, for the CUDA HybridEP backend's barrier (CPU).

Why: the first GPU run (issue 38) failed in a way the thread emulation of the barrier in
tests/hybridep/test_cuda_binding.py cannot show. There every barrier call blocks its host
thread until every rank has arrived, so a rank can never post its next barrier before a slow
peer has read its previous one. On the device it can:

- a launch returns at once: a rank's host queues barrier after barrier on its stream (a
  failed call's abort barriers right behind the barrier it already passed);
- the contexts of different processes time-slice: the GPU runs one rank's queued kernels as
  long as they make progress and switches when a kernel spins (a barrier waiting for a peer)
  or the stream is empty; a peer re-reads a word only when it gets the GPU back;
- `barrier_kernel` (csrc/hybridep/intranode.cu) returns at once when the status block reports
  a failure, reads its epoch when it starts, posts it (with the abort bit) into arrivals[rank],
  polls every rank's word in rank order, and records PEER_FAILED after passing, or
  BARRIER_TIMEOUT naming the first rank still missing.

`EmulatedGpu` runs that algorithm over Python words, with the arrival rule compiled from csrc
(`art_hybridep_barrier_arrival`, the function the kernel calls), so a change to the rule is
tested as built. The host is the test: it calls each rank's backend in turn and says which
context gets the GPU (`run`), so a schedule is deterministic. A timeout needs no clock: when
the host waits (`synchronize`) and a full round of slices moves nothing, nothing ever will,
and every spinning barrier's budget expires.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

ABORT_BIT = 1 << 63
WAIT, PASSED, ABORTED = 0, 1, 2  # art_hybridep_barrier_arrival's verdicts
STATUS_BARRIER_TIMEOUT, STATUS_PEER_FAILED = 1, 2


class EmulatedGpu:
    """The ranks' streams, arrival and epoch words, and status blocks of one buffer."""

    def __init__(self, world: int, arrival_rule: Callable[[int, int], int]) -> None:
        self.world, self.rule = world, arrival_rule
        self.arrivals = [0] * world  # rank 0's arrivals[W]
        self.epochs = [0] * world  # each rank's own epoch word
        self.statuses = [torch.zeros(4, dtype=torch.int32) for _ in range(world)]
        self.streams: list[collections.deque] = [collections.deque() for _ in range(world)]
        self.launches: list[tuple[int, str]] = []
        self._expired = False
        self._next = 0

    # -- launches (return at once, as on the device) --------------------------------------
    def launch_barrier(self, rank: int, abort: bool) -> None:
        self.launches.append((rank, "abort barrier" if abort else "barrier"))
        self.streams[rank].append(self._barrier(rank, abort))

    def launch_kernel(self, rank: int, name: str) -> None:
        """A kernel that needs no peer (dispatch's copies): it runs when its turn comes."""
        self.launches.append((rank, name))
        self.streams[rank].append(self._local())

    # -- the device -------------------------------------------------------------------------
    def run(self, rank: int) -> bool:
        """Give `rank`'s context the GPU: run its kernels until one spins or none is left.
        Returns whether anything moved."""
        stream, moved = self.streams[rank], False
        while stream:
            try:
                moved |= next(stream[0])
            except StopIteration:
                stream.popleft()
                moved = True
                continue
            break  # spinning: the GPU goes to the next context
        self._next = (rank + 1) % self.world
        return moved

    def synchronize(self) -> None:
        """Every host waits for its stream: slices in turn; once a whole round moves
        nothing, the spinning barriers time out (and later kernels see the failure)."""
        while any(self.streams):
            moved = False
            for _ in range(self.world):
                moved |= self.run(self._next)
            if not moved:
                self._expired = True
                for rank in range(self.world):
                    self.run(rank)
                self._expired = False

    def _record(self, rank: int, code: int, who: int, epoch: int) -> None:
        self.statuses[rank][1], self.statuses[rank][2] = who, epoch
        self.statuses[rank][0] = code

    def _local(self):
        return
        yield  # a generator that finishes at its first step

    def _barrier(self, rank: int, abort: bool):
        """barrier_kernel, step by step: yields whether a step moved anything, each time it
        must spin."""
        if int(self.statuses[rank][0]) != 0:
            return
        target = self.epochs[rank] + 1
        self.arrivals[rank] = target | ABORT_BIT if abort else target
        aborted, moved = -1, True
        for r in range(self.world):
            while True:
                verdict = self.rule(self.arrivals[r], target)
                if verdict != WAIT:
                    if verdict == ABORTED and aborted < 0:
                        aborted = r
                    moved = True
                    break
                if self._expired:
                    self._record(rank, STATUS_BARRIER_TIMEOUT, r, target)
                    return
                yield moved
                moved = False
        self.epochs[rank] = target
        if aborted >= 0:
            self._record(rank, STATUS_PEER_FAILED, aborted, target)
