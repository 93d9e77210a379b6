"""The activation quantizer on a GPU, against the torch reference on the same GPU bit for bit: the plain
layout (odd block counts, partial last blocks, a view off a 16-byte boundary) and the masked one, whose rows
past each group's count are not written (the outputs are pre-filled through the caching allocator and checked
for the fill)."""

from __future__ import annotations

import pytest
import torch

from kernels.act_quant import quantize_act, quantize_act_reference, scale_row_stride
from kernels.act_quant_sm90 import quantize_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("k", [768, 1040])
def test_masked_rows_match_reference_and_others_stay_unwritten(k):
    gen = torch.Generator(device="cuda").manual_seed(k)
    groups, capacity = 6, 40
    counts = torch.tensor([3, 0, 40, 17, 1, 39], dtype=torch.int32, device="cuda")
    x = (torch.randn(groups, capacity, k, generator=gen, device="cuda") * 3).bfloat16()
    # Fill the blocks the quantizer's two allocations get next (the caching allocator hands freed
    # blocks back in the same order; checked below), so an unwritten element still holds the fill.
    kb = -(-k // 128)
    fill_q = torch.full((groups, capacity, k), 0x7F, dtype=torch.uint8, device="cuda")  # E4M3 NaN pattern
    # The scales' storage: rows padded to 16 bytes (scale_row_stride), of which `scale` is a view.
    fill_s = torch.full((groups, capacity, scale_row_stride(kb)), -1.0, dtype=torch.float32, device="cuda")
    addresses = (fill_q.data_ptr(), fill_s.data_ptr())
    del fill_q, fill_s
    q, s = quantize_act(x, counts)
    torch.cuda.synchronize()
    assert (q.data_ptr(), s.data_ptr()) == addresses, "the allocator did not reuse the filled blocks: the test's premise"
    assert s.shape == (groups, capacity, kb) and s.stride() == (capacity * scale_row_stride(kb), scale_row_stride(kb), 1)
    q_ref, s_ref = quantize_act_reference(x)
    owned = torch.arange(capacity, device="cuda")[None, :] < counts[:, None]
    assert torch.equal(q.view(torch.uint8)[owned], q_ref.view(torch.uint8)[owned])
    assert torch.equal(s[owned], s_ref[owned])
    assert bool((q.view(torch.uint8)[~owned] == 0x7F).all()), "rows past a group's count were written"
    assert bool((s[~owned] == -1.0).all()), "scales past a group's count were written"


@pytest.mark.parametrize("blocks_per_warp", [None, 2, 8])  # None: by size (warp_blocks_for)
@pytest.mark.parametrize("shape, offset", [
    ((4, 33, 768), 0),    # 6 blocks a row: a warp's blocks span rows; the grid's last CTA partly empty
    ((300, 1040), 0),     # 9 blocks a row, the last one 16 channels wide
    ((7, 272), 0),        # 3 blocks a row, the last one 16 channels wide
    ((37, 2048), 3),      # a view 6 bytes past a 16-byte boundary (copied before the kernel's 16-byte loads)
    ((4096, 1040), 0),    # 36864 blocks: eight a warp by size on 132 SMs
])
def test_plain_quantization_matches_reference_bit_for_bit(shape, offset, blocks_per_warp):
    gen = torch.Generator(device="cuda").manual_seed(7)
    numel = torch.Size(shape).numel()
    base = (torch.randn(numel + offset, generator=gen, device="cuda") * 2).bfloat16()
    x = base[offset:].view(shape)
    x.view(-1, shape[-1])[1, :128] = 0  # an all-zero block: the floored scale, exact zeros
    q, s = quantize_act(x) if blocks_per_warp is None else quantize_cuda(x, blocks_per_warp=blocks_per_warp)
    q_ref, s_ref = quantize_act_reference(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert s.stride()[-2] == scale_row_stride(s.shape[-1])
