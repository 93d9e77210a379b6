"""KV page-to-page copy: a group of layers of one sequence's KV, from one paged pool into another.

Both pools are ``[layers, pages, 2 (K/V), heads, page_size, head_dim]`` (HND inside a
page, ``shared.kvcache``). The destination may hold more heads than the source: source
heads ``[0, H)`` land in destination heads ``[head_start, head_start + H)``. Token ``t``
of the sequence lives in page ``table[t // page_size]`` at slot ``t % page_size`` on each
side. The same-host CUDA IPC transfer (``shared.transfer.direct_write``) uses it to write
a prefill rank's KV shard straight into a decode rank's reserved pages, the destination
being the decode's storage mapped through CUDA IPC.

``kv_copy`` picks the implementation by device:

* CPU: ``kv_copy_reference``, a gather of tokens ``[0, num_tokens)`` by the source table
  and a scatter by the destination table in torch; the definition the kernel is tested
  against.
* CUDA: the CuTeDSL kernel (``kernels.kv_copy_sm90``, imported on this path only). The
  caller cuts the bytes into rows (``RowPlan``): the token axis in blocks of ``block``
  tokens that lie in one page on each side, each block in ``rows`` rows contiguous on
  both sides. CTAs take (layer, block, row) items, look the two page ids up in the
  tables on the GPU and move the row with ``vector_bytes``-wide accesses (16 bytes
  wherever the layout allows: every bf16 / fp16 / fp32 / fp8 head_dim that is a multiple
  of 16), several loads in flight per thread before their stores, which are plain global
  stores (to peer memory when the destination is mapped through CUDA IPC; never
  ``multimem``). The last block is copied whole: its slots past ``num_tokens`` lie in the
  sequence's last page on each side, which the caller reserved for it.

The kernel is compiled once per process and access width (``prepare_kv_copy`` compiles
and loads it ahead of the first copy) and takes every size, stride and address as a
runtime scalar, so one binary serves every layout and request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VECTOR_BYTES = (16, 8, 4, 2)  # access widths the kernel is compiled for, widest first
MAX_ITEMS = 2**31 - 1  # (layer, block, row) items of one launch, counted in int32 by the kernel


class KVCopyError(ValueError):
    """A copy the kernel cannot do (pools, tables, alignment, width, size); the message says which."""


@dataclass(frozen=True)
class RowPlan:
    """How one sequence's KV bytes split into rows (planned by ``shared.transfer.direct_write``).

    ``block`` tokens per block (it divides both page sizes); ``blocks`` blocks cover
    ``num_tokens``. Each block is ``rows`` rows, contiguous on both sides and moved with
    ``vector_bytes``-wide accesses: ``heads_per_row`` consecutive heads of one K/V half
    (``rows_per_kv`` rows per half), or with ``rows == 1`` both halves of a whole page
    (``rows_per_kv == 1``). Destination heads start at ``head_start``.
    """

    vector_bytes: int
    block: int
    blocks: int
    rows: int
    rows_per_kv: int
    heads_per_row: int
    head_start: int
    num_tokens: int


def kv_copy_reference(src: torch.Tensor, src_table: torch.Tensor, dst: torch.Tensor, dst_table: torch.Tensor,
                      layers: range, head_start: int, num_tokens: int) -> None:
    """Copy tokens ``[0, num_tokens)`` of every source head of ``layers`` into destination heads
    ``[head_start, head_start + src heads)``: gather by ``src_table``, scatter by ``dst_table``."""
    src_ps, dst_ps, heads = src.shape[4], dst.shape[4], src.shape[3]
    tokens = torch.arange(num_tokens, device=src.device)
    src_pages, dst_pages = src_table.to(src.device, torch.long)[tokens // src_ps], dst_table.to(src.device, torch.long)[tokens // dst_ps]
    # Advanced indices split by slices put the token axis first: [tokens, layers, 2, heads, head_dim].
    values = src[layers.start : layers.stop][:, src_pages, :, :, tokens % src_ps]
    dst[layers.start : layers.stop, :, :, head_start : head_start + heads][:, dst_pages, :, :, tokens % dst_ps] = values


def kv_copy(src: torch.Tensor, src_table: torch.Tensor, dst: torch.Tensor, dst_table: torch.Tensor, layers: range,
            plan: RowPlan, stream: torch.cuda.Stream | None = None) -> None:
    """Copy ``layers`` of one sequence from pool ``src`` into pool ``dst`` as ``plan`` says: the
    CuTeDSL kernel on CUDA (one launch on ``stream``, default the current one), the torch
    reference elsewhere.

    On CUDA the tables are contiguous int32 tensors on ``src``'s device whose page ids the
    caller has checked (the kernel trusts them), and ``plan`` must describe rows that are
    contiguous on both sides (``shared.transfer.direct_write.plan_rows``). Raises
    ``KVCopyError`` on pools, tables or alignment the copy cannot take.
    """
    if src.dim() != 6 or dst.dim() != 6 or src.dtype != dst.dtype or not 0 <= layers.start < layers.stop <= min(src.shape[0], dst.shape[0]):
        raise KVCopyError(f"KV copy of layers {layers} from {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}: "
                          "needs two [layers, pages, 2, heads, page_size, head_dim] pools of one dtype holding those layers")
    if not src.is_cuda:
        if dst.device != src.device:
            raise KVCopyError(f"KV copy from {src.device} into {dst.device}: the reference copies within one device")
        kv_copy_reference(src, src_table, dst, dst_table, layers, plan.head_start, plan.num_tokens)
        return
    if not dst.is_cuda or not src.is_contiguous() or not dst.is_contiguous():
        raise KVCopyError(f"the KV copy kernel needs two contiguous CUDA pools, got {src.device} and {dst.device}")
    for name, table, page_size in (("source", src_table, src.shape[4]), ("destination", dst_table, dst.shape[4])):
        need = -(-plan.num_tokens // page_size)
        if table.dtype != torch.int32 or table.device != src.device or not table.is_contiguous() or table.numel() < need:
            raise KVCopyError(f"{name} page table must be a contiguous int32 tensor of at least {need} pages on {src.device}, "
                              f"got {table.dtype} {tuple(table.shape)} on {table.device}")
    from kernels import kv_copy_sm90  # CuTeDSL is imported only on the GPU path

    kv_copy_sm90.launch(src.device, stream or torch.cuda.current_stream(src.device), plan.vector_bytes,
                        *_kernel_args(src, src_table, dst, dst_table, layers, plan))


def _kernel_args(src: torch.Tensor, src_table: torch.Tensor, dst: torch.Tensor, dst_table: torch.Tensor, layers: range,
                 plan: RowPlan) -> tuple[tuple[int, int, int, int], int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The kernel's arguments (``kv_copy_sm90.launch``): addresses (src, dst, src table, dst table;
    the first layer of ``layers``, the first destination head), items, items per layer, the row
    shape and both pools' (page, K/V, head, layer) strides in vectors."""
    vec, esz = plan.vector_bytes, src.element_size()
    src_at = src.data_ptr() + layers.start * src.stride(0) * esz
    dst_at = dst.data_ptr() + (layers.start * dst.stride(0) + plan.head_start * dst.stride(3)) * esz
    row_bytes = src.shape[5] * esz  # one token of one head
    if vec not in VECTOR_BYTES or any(x % vec for x in (src_at, dst_at, row_bytes)):
        raise KVCopyError(f"KV copy with {vec}-byte accesses: rows of {row_bytes} bytes at {src_at:#x} / {dst_at:#x} "
                          f"are not {vec}-byte aligned (kernel widths: {VECTOR_BYTES})")
    items_per_layer = plan.blocks * plan.rows
    items = items_per_layer * len(layers)
    if items > MAX_ITEMS:
        raise KVCopyError(f"KV copy of {items} (layer, block, row) items, above the kernel's {MAX_ITEMS}")
    tok = row_bytes // vec
    shape = (plan.rows, plan.rows_per_kv, plan.heads_per_row * plan.block * tok, plan.block, src.shape[4], dst.shape[4], tok)
    # Contiguous pools: every stride is a multiple of a row, so of the vector too.
    src_strides, dst_strides = (tuple(s * esz // vec for s in (t.stride(1), t.stride(2), t.stride(3), t.stride(0))) for t in (src, dst))
    return (src_at, dst_at, src_table.data_ptr(), dst_table.data_ptr()), items, items_per_layer, shape, src_strides, dst_strides


def prepare_kv_copy(device: torch.device, vector_bytes: int) -> None:
    """Compile the kernel for ``vector_bytes``-wide accesses and, on CUDA, run it once on a scratch
    pool, so the first real copy on ``device`` pays neither the compile nor the module load."""
    from kernels import kv_copy_sm90

    kv_copy_sm90.compile_kv_copy(vector_bytes)
    if device.type != "cuda":
        return
    pool = torch.zeros(1, 2, 2, 1, 1, vector_bytes, dtype=torch.uint8, device=device)  # [layer, 2 pages, K/V, head, slot, dim]
    tables = torch.tensor([0, 1], dtype=torch.int32, device=device)
    plan = RowPlan(vector_bytes, block=1, blocks=1, rows=1, rows_per_kv=1, heads_per_row=2, head_start=0, num_tokens=1)
    kv_copy(pool, tables[:1], pool, tables[1:], range(1), plan)  # page 0 -> page 1
    torch.cuda.synchronize(device)
