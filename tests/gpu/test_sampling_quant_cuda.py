"""Sampler and FP8 quantization formats on CUDA at Qwen3 vocabulary / weight sizes.

The CPU tests (tests/model/test_sampling.py, test_quant.py) prove the math; these
check that the same code is right on the GPU: seeded rows reproduce independently
of the batch with CUDA generators, the top-k / top-p masks hold at a 151936-token
vocabulary, and quantization gives bit-identical results to the CPU.
"""

from __future__ import annotations

import pytest
import torch

from shared.model.quant_formats import (
    quantize_act_per_token_group,
    quantize_block_fp8,
    quantize_mxfp8,
)
from shared.model.sampling import Sampler, adjust_logits, make_generator, prompt_logprobs, request_generator
from shared.model.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
VOCAB = 151936


def _logits(batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(batch, VOCAB, device=DEV, generator=g) * 4).to(torch.bfloat16)


def test_seeded_rows_reproduce_regardless_of_batch_on_cuda() -> None:
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=100 + i) for i in range(8)]
    logits = _logits(8, 0)
    alone = [
        int(Sampler().sample(logits[i : i + 1], [p], [request_generator(p, DEV)])[0])
        for i, p in enumerate(params)
    ]
    order = [5, 2, 7, 0, 1, 6, 3, 4]
    filler = SamplingParams(temperature=1.0)  # unseeded rows between them
    batch_params, batch_rows = [], []
    for i in order:
        batch_params += [params[i], filler]
        batch_rows += [i, (i + 1) % 8]
    tokens, _ = Sampler().sample(logits[batch_rows], batch_params, [request_generator(p, DEV) for p in batch_params])
    assert [int(tokens[2 * k]) for k in range(8)] == [alone[i] for i in order]


def test_logit_bias_bans_and_min_p_on_cuda_match_the_cpu() -> None:
    logits = _logits(4, 3).float()
    top = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0.0, logit_bias={7: 100, top[0]: -3.5}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, min_p=0.5, seed=1), SamplingParams(temperature=0.0, logit_bias={top[3]: -100})]
    banned = [(), (top[1], 5), (), ()]
    on_gpu = adjust_logits(logits, params, None, banned)
    torch.testing.assert_close(on_gpu.cpu(), adjust_logits(logits.cpu(), params, None, banned), rtol=0, atol=0)
    tokens, _ = Sampler().sample(logits, params, [request_generator(p, DEV) for p in params], banned=banned)
    assert int(tokens[0]) == 7 and int(tokens[1]) != top[1] and int(tokens[3]) != top[3]
    # min_p 0.5 at temperature 1: only tokens within log(2) of the row's best logit survive
    assert logits[2, int(tokens[2])] >= logits[2].max() - torch.log(torch.tensor(2.0, device=DEV))


def test_masks_greedy_and_logprobs_on_cuda() -> None:
    batch = 64
    logits = _logits(batch, 1)
    params = (
        [SamplingParams(temperature=0.0, logprobs=True)] * 16
        + [SamplingParams(temperature=1.5, top_k=5, seed=i, logprobs=True) for i in range(16)]
        + [SamplingParams(temperature=1.0, top_p=1e-6, seed=i) for i in range(16)]
        + [SamplingParams(temperature=1.0, top_k=20, top_p=0.5, seed=i) for i in range(16)]
    )
    generators = [request_generator(p, DEV) for p in params]
    tokens, logprobs = Sampler(default_generator=make_generator(0, DEV)).sample(logits, params, generators)
    assert tokens.device.type == "cuda"
    argmax = logits.float().argmax(dim=-1)
    assert torch.equal(tokens[:16], argmax[:16])
    top5 = logits[16:32].float().topk(5, dim=-1).indices
    assert torch.all((top5 == tokens[16:32, None]).any(dim=-1))
    assert torch.equal(tokens[32:48], argmax[32:48])  # a tiny top_p keeps only the most likely token
    top20 = logits[48:].float().topk(20, dim=-1).indices
    assert torch.all((top20 == tokens[48:, None]).any(dim=-1))
    expected = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(768, 2048), (2048, 768), (300, 200)])
def test_quantization_on_cuda_is_bit_identical_to_cpu(shape: tuple[int, int]) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.02
    cpu_block, gpu_block = quantize_block_fp8(w), quantize_block_fp8(w.to(DEV))
    assert torch.equal(gpu_block.weight.view(torch.uint8).cpu(), cpu_block.weight.view(torch.uint8))
    assert torch.equal(gpu_block.scale_inv.cpu(), cpu_block.scale_inv)
    cpu_mx, gpu_mx = quantize_mxfp8(w), quantize_mxfp8(w.to(DEV))
    assert torch.equal(gpu_mx.weight.view(torch.uint8).cpu(), cpu_mx.weight.view(torch.uint8))
    assert torch.equal(gpu_mx.scale_e8m0.cpu(), cpu_mx.scale_e8m0)
    torch.testing.assert_close(gpu_block.dequantize().cpu(), cpu_block.dequantize(), rtol=0, atol=0)
    torch.testing.assert_close(gpu_mx.dequantize().cpu(), cpu_mx.dequantize(), rtol=0, atol=0)
    cpu_act, gpu_act = quantize_act_per_token_group(w), quantize_act_per_token_group(w.to(DEV))
    assert torch.equal(gpu_act[0].view(torch.uint8).cpu(), cpu_act[0].view(torch.uint8))
    assert torch.equal(gpu_act[1].cpu(), cpu_act[1])


def test_prompt_logprobs_on_cuda_match_the_cpu() -> None:
    """A 1100-token prompt's logprobs and top-5 at the full vocabulary (three passes on CUDA)."""
    logits = _logits(1100, 3)
    next_ids = torch.randint(0, VOCAB, (1100,), generator=torch.Generator().manual_seed(4)).tolist()
    chosen, top = prompt_logprobs(lambda a, b: logits[a:b], next_ids, 5)
    want = torch.log_softmax(logits.cpu().float(), dim=-1)
    torch.testing.assert_close(torch.tensor(chosen), want[torch.arange(1100), torch.tensor(next_ids)], rtol=0, atol=1e-4)
    assert top is not None
    torch.testing.assert_close(torch.tensor([t.logprobs for t in top]), want.topk(5, dim=-1).values, rtol=0, atol=1e-4)
