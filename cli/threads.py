"""Intra-op thread count for small tensor work, shared by every method.

Below ~1M entries per operation, the fork/join of torch's intra-op threads costs more than
it saves, and on a busy 2-core machine every parallel op waits at a barrier for a
descheduled thread: small filters and RL updates ran 4-80x slower with 2 threads than with
1 while another process kept both cores busy. Large arrays keep the caller's setting.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

SMALL_ARRAY_ENTRIES = 1_000_000


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Exactly `n` intra-op threads inside the block; restores the setting on exit."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def threads_for(n_entries: int):
    """One intra-op thread while the working arrays are small; the caller's setting otherwise."""
    import torch

    return intra_op_threads(1 if n_entries < SMALL_ARRAY_ENTRIES else torch.get_num_threads())


def single_thread():
    """One intra-op thread: for loops of many small ops (recurrent nets, RL updates)."""
    return threads_for(0)
