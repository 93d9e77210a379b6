"""Wire structs of the KV TransferEngine (shared/transfer, DESIGN §5).

``KVTransferDescriptor`` travels inside the decode rank's ``KVReservation`` on NATS
(scheduler -> prefill instance); ``ShardHeader`` is the control message a prefill
rank sends over UCX ahead of each packed chunk of KV. Both are msgpack-encoded.
"""

from __future__ import annotations

import msgspec


class KVTransferLayout(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Geometry of the decode rank's KV pages the prefill side must fill."""

    num_layers: int
    page_size: int
    kv_heads: int  # all KV heads of the model: the decode rank holds every head
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"


class KVTransferDescriptor(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Everything a prefill rank needs to write one request's KV into a decode rank.

    ``transfer_id`` scopes the UCX tags of this request on the decode worker;
    ``lease_deadline_unix`` is the wall-clock time (``time.time()``) at which the
    decode rank frees the pages if the KV has not fully landed.
    """

    worker_address: bytes
    request_id: str
    transfer_id: int
    page_ids: list[int]
    num_tokens: int
    layout: KVTransferLayout
    lease_deadline_unix: float
    max_chunk_bytes: int  # largest packed chunk the decode side can stage at once


class ShardHeader(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Announces one packed chunk: KV heads [head_start, head_end) x layers [layer_start, layer_end).

    The chunk that follows on the data tag is laid out ``[layers, 2, heads, num_tokens,
    head_dim]`` (token-contiguous per head), ``nbytes`` long.
    """

    request_id: str
    transfer_id: int
    head_start: int
    head_end: int
    layer_start: int
    layer_end: int
    num_tokens: int
    nbytes: int
    dtype: str
