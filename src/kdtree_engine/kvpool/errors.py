"""The KV pool's exceptions."""

from __future__ import annotations

__all__ = ["KVPoolError", "PoolFullError", "SequenceTooLongError", "StalePlanError", "PoolInvariantError"]



class KVPoolError(RuntimeError):
    """Base class of the pool's capacity errors (the pool is left unchanged)."""


class PoolFullError(KVPoolError):
    """Not enough free pages (or sequence rows) for an allocation; nothing was changed."""

    def __init__(self, msg: str, requested: int = 0, available: int = 0):
        super().__init__(msg)
        self.requested = requested
        self.available = available


class SequenceTooLongError(KVPoolError):
    """A sequence would exceed ``max_seq_len`` (its page-table row); nothing was changed."""


class StalePlanError(RuntimeError):
    """A defragmentation plan was applied after the pool changed."""


class PoolInvariantError(RuntimeError):
    """The pool's state broke an invariant (host and device disagree, a page owned twice, ...):
    a bug, or ``num_accepted_host`` that differs from the device's ``num_accepted``."""
