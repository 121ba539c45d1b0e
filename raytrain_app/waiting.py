"""The one poll-until-deadline loop: a job's state, a cluster's nodes, a process's end."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def poll(read: Callable[[], T], done: Callable[[T], bool], timeout_s: float, interval_s: float = 1.0) -> T:
    """`read()` every `interval_s` until `done` holds for its value or `timeout_s` has passed;
    the last value read (the caller tells a timeout from `done` failing on it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)
