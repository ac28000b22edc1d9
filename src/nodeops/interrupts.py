"""Ctrl-C and SIGTERM around the steps that must not be cut in half: the one place that
installs signal handlers for the lifecycle (a launch's start, a submission, a teardown)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def ignoring_interrupts() -> Iterator[None]:
    """SIGINT and SIGTERM are ignored inside (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C (KeyboardInterrupt) inside the block."""

    def on_term(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def deferred_interrupts(on_first: Callable[[], None] = lambda: None) -> Iterator[list[int]]:
    """SIGINT and SIGTERM inside are recorded, not raised: the list says which came.
    ``on_first`` runs when the first one arrives (to say it was noted)."""
    got: list[int] = []

    def note(n: int, _frame: object) -> None:
        if not got:
            on_first()
        got.append(n)

    saved = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
