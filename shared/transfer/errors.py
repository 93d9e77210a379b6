"""Typed failures of a KV transfer; ``cause`` is the key used in failure metrics."""

from __future__ import annotations


class TransferError(Exception):
    """Base class: a KV transfer for ``request_id`` did not complete."""

    cause = "error"

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"KV transfer {request_id!r}: {message}")
        self.request_id = request_id


class TransferTimeout(TransferError):
    """The transfer's deadline passed before it completed."""

    cause = "timeout"


class LeaseExpired(TransferError):
    """The decode-side reservation's lease ran out; its pages were freed."""

    cause = "lease_expired"


class PeerFailed(TransferError):
    """The UCX peer failed (process died, connection reset, endpoint error)."""

    cause = "peer_failed"


class Cancelled(TransferError):
    """The transfer was cancelled by its owner."""

    cause = "cancelled"


class ProtocolError(TransferError):
    """A peer sent a chunk that does not fit the reservation (bad heads, layers, size)."""

    cause = "protocol"


class LayoutMismatch(ValueError):
    """The two sides' KV layouts cannot be mapped onto each other (raised before any transfer)."""


class UnknownTransfer(KeyError):
    """No reservation with this request id exists on this receiver."""
