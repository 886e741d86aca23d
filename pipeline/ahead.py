"""Work on a sequence of items in threads, ahead of the caller, with the results in order."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def ordered_ahead(
    work: Callable[[Item], Result], items: Iterable[Item], workers: int | None = None
) -> Iterator[Result]:
    """`work(item)` for each of `items`, in their order. Up to `workers` (default: one per
    core) items are worked on in threads while the caller handles the result before them, so
    at most workers + 1 results are in memory. It pays when `work` runs mostly without the GIL
    (numba, numpy, pyarrow) and the caller's part is sequential."""
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque[Future[Result]] = deque()
        for item in items:
            pending.append(pool.submit(work, item))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
