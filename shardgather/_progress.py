"""One progress bar per job, on rank 0, counting the bytes of every rank.

Every rank moves its own bytes (node-local writes, loads that read each rank's own
blocks), so rank 0's own count is 1/N of the job. Each rank adds what it moved to one
counter in the job's store every 64 MiB (and when it is done); rank 0 shows its own
bytes at once and the others' when it reads the counter — while it waits for them
after its own part. The bar ends exactly at the total the plan announced: the done
round proves every rank's bytes are in place.

Only with ``progress=True``: nothing is counted, posted or polled otherwise.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ._dist import Call

REPORT_BYTES = 64 << 20
STALL_S = 5.0  # rank 0 stops watching a counter that did not move for this long


class Progress:
    """The bar of one job (one verb). A job in several parts (a checkpoint's model and
    optimizer) calls :meth:`part` before each: each part counts on a counter of its own."""

    def __init__(self, call: Call, enabled: bool, total: int, desc: str) -> None:
        self.call, self.enabled = call, enabled
        self.bar: Any = None
        self.unreported = 0
        self.parts = 0
        self.base = 0  # bytes of the parts already complete
        self.part_total = total
        self.seen = 0  # other ranks' bytes of this part shown so far
        self.keys: tuple[str, str] | None = None
        if enabled and call.rank == 0:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc)

    def _keys(self) -> None:
        """This part's counters: bytes, and ranks done (made once per part, when used)."""
        if self.keys is None:
            name = f"progress/{self.parts}"
            self.keys = (self.call.counter_key(name), self.call.counter_key(name + "/ranks"))

    def counters(self) -> None:
        """Make this part's store counters now (a job whose bytes are counted later, on a
        writer thread, makes them on the calling thread, where the call's keys live)."""
        if self.enabled and self.call.distributed:
            self._keys()

    def part(self, nbytes: int) -> None:
        """The next part of the job moves ``nbytes`` (all ranks together)."""
        self.parts += 1
        self.part_total, self.seen, self.keys = nbytes, 0, None

    def update(self, n: int) -> None:
        """This rank moved ``n`` more bytes."""
        if not self.enabled or n <= 0:
            return
        if self.bar is not None:
            self.bar.update(n)
            return
        self.unreported += n
        if self.unreported >= REPORT_BYTES:
            self.report()

    def report(self, last: bool = False) -> None:
        """Post this rank's unreported bytes (ranks other than 0); ``last``: its share
        of the part is done (rank 0 stops watching once every other rank said so)."""
        if not self.enabled or self.bar is not None or not self.call.distributed:
            return
        self._keys()
        assert self.keys is not None
        with contextlib.suppress(Exception):
            if self.unreported:
                self.call.store.add(self.keys[0], self.unreported)
            if last:
                self.call.store.add(self.keys[1], 1)
        self.unreported = 0

    def watch_others(self) -> None:
        """Rank 0, its own share done: show the other ranks' bytes as they report,
        until every one of them is done, a rank failed (the next round raises) or the
        counters stall for STALL_S (a stuck rank: the next round's timeout deals with
        it). Never past the part's total (replicated blocks count once per replica)."""
        if self.bar is None or not self.call.distributed:
            return
        store, moved = self.call.store, time.monotonic()
        self._keys()
        assert self.keys is not None
        room = max(0, self.base + self.part_total - self.bar.n)
        while True:
            try:
                n = store.add(self.keys[0], 0)
                ranks = store.add(self.keys[1], 0)
                failed = self.call.any_failed()
            except Exception:
                return
            if n > self.seen:
                self.bar.update(min(n - self.seen, room))
                room -= min(n - self.seen, room)
                self.seen, moved = n, time.monotonic()
            if ranks >= self.call.world - 1 or failed or time.monotonic() - moved > STALL_S:
                return
            time.sleep(0.1)

    def done(self) -> None:
        """The part is complete on every rank (its done round passed): shown whole."""
        if self.bar is not None:
            self.base += self.part_total
            self.bar.n = self.base
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
