"""State a server module keeps for each session, keyed by the session's executor.

Made on first use; dropped with the executor (a weak key), and closed then when the state has a closer.
Graph definitions, process groups and peer-copy receivers each keep one of these.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PerSession(Generic[T]):
    """One ``T`` per live executor, made by ``factory``; ``close(state)`` runs when its executor goes."""

    def __init__(self, factory: Callable[[], T], close: Callable[[T], None] | None = None) -> None:
        self._factory = factory
        self._close = close
        self._states: weakref.WeakKeyDictionary[Any, T] = weakref.WeakKeyDictionary()

    def get(self, executor: Any) -> T:
        """``executor``'s state, made now if it has none."""
        state = self._states.get(executor)
        if state is None:
            state = self._states[executor] = self._factory()
            if self._close is not None:
                weakref.finalize(executor, self._close, state)
        return state

    def values(self) -> list[T]:
        """The states of every live executor (for inspection and tests)."""
        return list(self._states.values())

    def pop(self, executor: Any) -> T | None:
        """Forget ``executor``'s state (None when it had none); the caller closes it."""
        return self._states.pop(executor, None)
