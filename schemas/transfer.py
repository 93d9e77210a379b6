"""Wire structs of the KV TransferEngine (shared/transfer, DESIGN §5).

``KVTransferDescriptor`` travels inside the decode rank's ``KVReservation`` on NATS
(scheduler -> prefill instance); ``ShardHeader`` is the control message a prefill
rank sends over UCX ahead of each packed chunk of KV (or after writing it directly,
see ``CudaIpcExport``). All are msgpack-encoded.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class KVTransferLayout(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Geometry of the decode rank's KV pages the prefill side must fill."""

    num_layers: int
    page_size: int
    kv_heads: int  # all KV heads of the model: the decode rank holds every head
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"


class CudaIpcExport(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The decode rank's whole KV storage, exported once through CUDA IPC (same-host fast path).

    The fields are those of torch's ``reduce_tensor`` / ``rebuild_cuda_tensor`` for the
    storage tensor ``[layers, num_pages, 2, kv_heads, page_size, head_dim]`` of the
    layout's dtype, carried explicitly (nothing is pickled). A prefill rank opens it only
    when ``host_id`` is its own host and ``device_uuid`` is one of its visible GPUs.
    """

    host_id: str  # boot id + hostname of the decode rank's machine
    pid: int  # exporting process (a sender in that same process uses the tensor directly)
    device_uuid: str  # the GPU holding the storage
    num_pages: int
    handle: bytes  # cudaIpcMemHandle of the allocation holding the storage
    storage_size_bytes: int
    storage_offset_bytes: int  # the storage's offset inside that allocation
    tensor_offset: int  # the tensor's offset in its storage (elements)
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class KVTransferDescriptor(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Everything a prefill rank needs to write one request's KV into a decode rank.

    ``transfer_id`` scopes the UCX tags of this request on the decode worker;
    ``lease_deadline_unix`` is the wall-clock time (``time.time()``) at which the
    decode rank frees the pages if the KV has not fully landed (a senders stops writing
    then). ``cuda_ipc``: the decode rank's KV storage for direct writes from the same
    host, None on CPU or when disabled.
    """

    worker_address: bytes
    request_id: str
    transfer_id: int
    page_ids: list[int]
    num_tokens: int
    layout: KVTransferLayout
    lease_deadline_unix: float
    max_chunk_bytes: int  # largest packed chunk the decode side can stage at once
    cuda_ipc: CudaIpcExport | None = None


class ShardHeader(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A control message about KV heads [head_start, head_end) x layers [layer_start, layer_end).

    ``kind``:
    * ``"chunk"``: a packed chunk follows on the data tag, laid out ``[layers, 2, heads,
      num_tokens, head_dim]`` (token-contiguous per head), ``nbytes`` long;
    * ``"landed"``: the sender writes (``event`` None: wrote) these cells straight into the
      reserved pages through CUDA IPC; ``nbytes`` is what it writes, no data follows. With
      ``event`` (a CUDA IPC event handle recorded after the writes, on the sender's GPU)
      the header is sent as soon as the writes are issued (they may still wait for the
      prefill's compute), and the cells have landed once that event completed;
      ``writes_done_unix`` is the earliest time they can have (same host, same clock; 0.0:
      unknown, the compute was still running), ``sender_pid`` the process that recorded it;
    * ``"stopped"``: the sender of these heads gave up and will write nothing more
      (layers: all; ``nbytes`` 0), so the decode side may reuse the pages now.
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
    kind: Literal["chunk", "landed", "stopped"] = "chunk"
    event: bytes | None = None
    writes_done_unix: float = 0.0
    sender_pid: int = 0
