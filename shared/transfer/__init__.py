"""TransferEngine: moves a request's KV from prefill TP ranks into a decode rank's pages.

Two paths behind one API: UCX (any host: packed chunks into the decode rank's staging,
scattered there) and, on one host, CUDA IPC (the sender writes straight from its pages
into the decode pages with one kernel per layer report, enqueued behind the layer's
compute, and announces them over UCX;
``cuda_ipc`` has the mechanism and its safety rules, ``direct_write`` the copies).

One ``TransferWorker`` per rank: ``worker = await TransferWorker.create(progress_mode=None)``
inside the rank's event loop (transports from ``UCX_*`` env, e.g. ``UCX_TLS=tcp,self`` on
CPU; ``progress_mode`` "thread" or "thread-polling", the default where CUDA is
available; completions arrive as futures, the loop idles between them). Every call below runs on that loop, except
``KVSender.on_layer_done``, which any thread may call.

Decode rank::

    receiver = KVReceiver(worker, kvcache, staging=StagingPool(256 << 20, 4, device))  # staging optional
    #   on CUDA it exports kvcache.storage through CUDA IPC (cuda_ipc=False or MOEBUS_KV_CUDA_IPC=0: not)
    desc = receiver.reserve(request_id, num_tokens, lease_s)   # -> KVTransferDescriptor (msgspec)
    #   raises OutOfPages (nothing allocated), ValueError (duplicate id, bad args, one layer
    #   of the request larger than a staging slot)
    # ... desc travels inside KVReservation (NATS) to the prefill instance ...
    page_ids = await receiver.wait_complete(request_id, timeout)   # now the caller owns the pages
    #   raises TransferTimeout (reservation kept), LeaseExpired, PeerFailed, ProtocolError,
    #   Cancelled (also to a late waiter: the last 1024 outcomes are kept), UnknownTransfer
    receiver.cancel(request_id) -> bool  # pages freed now; chunks still on the wire are drained
    await receiver.close()
    receiver.metrics.stats()             # heartbeat struct: completed, bytes, seconds, failures by cause
    receiver.num_free_pages, receiver.num_reservations, receiver.staging.in_use_bytes,
    receiver.num_quarantined_pages   # pages of ended reservations a direct writer may still write

Prefill TP rank (only ranks whose ``kv_head_shard(rank, tp, num_kv_heads).sends``)::

    prepare_direct_writes(device, kv_dtype, head_dim)   # once at start on CUDA: compiles and loads
    #   the CUDA IPC path's copy kernel, so the first transfer pays no JIT compile
    sender = KVSender(worker, kvcache, desc, page_table, kv_head_shard(rank, tp, num_kv_heads),
                      timeout_s=30.0, chunk_bytes=256 << 20)   # UCX: packs into worker.staging_pool(device)
    forward(..., on_layer_done=sender.on_layer_done)   # or sender.mark_all_layers_done()
    #   or senders built after the forward started: reports = LayerReports(device);
    #   forward(..., on_layer_done=reports.on_layer_done) in a thread, then reports.attach(sender)
    sender.path                      # "cuda_ipc" (descriptor's export opened) or "ucx"
    record = await sender.finish()   # TransferRecord(request_id, nbytes, wall_s, chunks, started_unix, phases_s, path)
    #   raises TransferTimeout (sender timeout or the reservation's lease, whichever is first),
    #   PeerFailed (decode rank died / endpoint error), Cancelled (sender.cancel()); the
    #   staging is released on every path. Keep the local pages until finish() returns.

The decode side completes a request when every (layer, KV head) cell has landed once,
whatever the prefill TP size; page sizes may differ between the two sides (the packed
chunk is token-contiguous per head). Modules: ``worker`` (UCX worker, endpoint cache,
tag protocol), ``shard`` (head mapping, pack/scatter), ``staging`` (slot arenas),
``cuda_ipc`` (storage export / open, same-host identity, landing events),
``direct_write`` (the CUDA IPC path's copy plan; the kernel is ``kernels.kv_copy``, CuTeDSL), ``receiver``, ``sender``, ``metrics``,
``errors``, ``streams`` (CUDA side streams), ``reports`` (a forward's layer reports for
senders built while it runs). The UCX path's pack and scatter are torch
ops on CPU and on CUDA alike: per layer group one index_select / index_copy_ over the
full pages plus one indexed copy of the partial last page, moving 8-byte words; on CUDA
they run on high-priority side streams. Both sides record where each transfer's time
went (``TransferRecord.phases_s``; see sender and receiver).
"""

from shared.transfer.direct_write import prepare_direct_writes
from shared.transfer.errors import Cancelled, LayoutMismatch, LeaseExpired, PeerFailed, ProtocolError, TransferError, TransferTimeout, UnknownTransfer
from shared.transfer.metrics import TransferMetrics, TransferRecord
from shared.transfer.receiver import KVReceiver
from shared.transfer.reports import LayerReports
from shared.transfer.sender import KVSender
from shared.transfer.shard import KVHeadShard, kv_head_shard
from shared.transfer.staging import StagingPool
from shared.transfer.worker import TransferWorker

__all__ = [
    "Cancelled",
    "KVHeadShard",
    "KVReceiver",
    "KVSender",
    "LayerReports",
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
    "prepare_direct_writes",
]
