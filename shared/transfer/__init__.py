"""TransferEngine: moves a request's KV from prefill TP ranks into a decode rank's pages over UCX.

One ``TransferWorker`` per rank (``await TransferWorker.create()`` inside the rank's
event loop; transports from ``UCX_*`` env, e.g. ``UCX_TLS=tcp,self`` on CPU).

Decode rank::

    receiver = KVReceiver(worker, kvcache, staging=StagingPool(slot_bytes, num_slots, device))
    desc = receiver.reserve(request_id, num_tokens, lease_s)   # -> KVTransferDescriptor; OutOfPages
    # ... desc travels in KVReservation (NATS) to the scheduler and the prefill instance ...
    page_ids = await receiver.wait_complete(request_id, timeout)   # caller now owns the pages
    #   raises TransferTimeout (reservation kept), LeaseExpired, PeerFailed, ProtocolError,
    #   Cancelled, UnknownTransfer
    receiver.cancel(request_id)      # drop: pages freed now, in-flight chunks drained
    receiver.metrics.snapshot()      # for heartbeats; receiver.num_free_pages, receiver.staging

Prefill TP rank (each rank that ``kv_head_shard(rank, tp, num_kv_heads).sends``)::

    staging = StagingPool(256 << 20, 4, device)        # once per rank, shared by its senders
    sender = KVSender(worker, kvcache, desc, page_table, kv_head_shard(rank, tp, num_kv_heads),
                      timeout_s=30.0, chunk_bytes=256 << 20, staging=staging)
    model.forward(..., on_layer_done=sender.on_layer_done)   # or sender.mark_all_layers_done()
    record = await sender.finish()   # TransferRecord(bytes, wall_s, gbps); raises TransferTimeout,
                                     # PeerFailed, Cancelled; staging freed on every path
    sender.cancel()

The decode side completes a request when every (layer, KV head) cell has landed once,
whatever the prefill TP size; page sizes may differ between the two sides (the packed
chunk is token-contiguous per head). See ``worker`` for the wire protocol and ``shard``
for the staging format. Scatter/gather are torch ops on CPU and CUDA alike.
"""

from shared.transfer.errors import Cancelled, LayoutMismatch, LeaseExpired, PeerFailed, ProtocolError, TransferError, TransferTimeout, UnknownTransfer
from shared.transfer.metrics import TransferMetrics, TransferRecord
from shared.transfer.receiver import KVReceiver
from shared.transfer.sender import KVSender
from shared.transfer.shard import KVHeadShard, kv_head_shard
from shared.transfer.staging import StagingPool
from shared.transfer.worker import TransferWorker

__all__ = [
    "Cancelled",
    "KVHeadShard",
    "KVReceiver",
    "KVSender",
    "LayoutMismatch",
    "LeaseExpired",
    "PeerFailed",
    "ProtocolError",
    "StagingPool",
    "TransferError",
    "TransferMetrics",
    "TransferRecord",
    "TransferTimeout",
    "TransferWorker",
    "UnknownTransfer",
    "kv_head_shard",
]
