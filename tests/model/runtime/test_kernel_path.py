"""The model's kernel path (grouped-GEMM MoE, SDPA attention) against its reference ops path.

Parametrized over devices: on the CPU ``kernels=True`` runs the very same glue
with each kernel's torch reference (fp32 GEMMs rounded to bf16 where the kernels
write bf16), on CUDA the CuTeDSL kernels. The checkpoint has kernel-compatible
shapes (moe_intermediate 128: a multiple of 64 for the fused SwiGLU tiles and of
128 for FP8 blocks; hidden 128). On CUDA a 300-token prompt makes prefill use the
128-row GEMM tiles and decode the 64-row ones; the CPU runs shorter prompts (its
bf16 matmuls are slow) through the same code.

Tolerances. bf16: both paths round activations to bf16 at the same places and
accumulate in fp32; they differ in accumulation order and in where SwiGLU rounds
(once after ``silu(gate) * up`` in the kernel, after each step in the reference).
So the kernel path's error against the fp32 model must be of the size of the
reference path's own bf16 error: at most twice it plus 1e-3 (median over tokens
of the per-token relative L2 error of the logits; the maximum is set by router
near-tie flips, see test_gpu_bf16), and its argmax agreement with fp32 may trail
the reference path's by at most 10 points. FP8: the kernel path also quantizes
the expert GEMMs' activations to E4M3 per token per 128 channels (W8A8; the
reference path is W8A16). An E4M3 value is within 2^-4 relative of what it
rounds; that bounds the median logits error against the fp32 model of the same
FP8 weights (seen on the CPU: 2.7%, bf16 reference path 0.9%). MXFP8: both paths
multiply bf16 activations by the same weights (an E4M3 value times its
power-of-two scale is exact in bf16, so dequantizing to bf16 loses nothing), the
kernel path dequantizing inside the GEMM; so the bf16 bounds apply.

Greedy decoding through the runner (prefill, then batched decode steps) must give
the same tokens on both paths, except that a sequence may part ways where the
reference's top-2 logits are within a few times the typical logits difference of
the two paths (a near tie, which rounding decides), or where the kernel path's own
prefill forward over the same prefix picks the kernel's token too: then the two
paths differ in the forward itself, whose error the prefill test bounds, not in the
decode steps. The second case is a router near-tie: seen on the CPU with MXFP8,
where layer 0's 2nd and 3rd expert probabilities of one token were 0.2168 and
0.2164, so rounding chose the expert, which moved that token's logits by up to
2.1 and, through its K/V, the next tokens' logits.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import DEVICES, agreement, median_token_rel_err, random_prompts

from kernels.grouped_gemm import deinterleave_gate_up
from shared.kvcache import KVLayout, PagedKVCache
from shared.model import layers as ops
from shared.model.config import ModelConfig
from shared.model.model import ForwardBatch, Qwen3Model, SequenceChunk
from shared.model.quant_formats import BlockFp8Weight, Mxfp8Weight
from shared.model.quantize import quantize_checkpoint
from shared.model.runner import ModelRunner
from shared.model.sampling_params import SamplingParams
from shared.model.weights import FusedGateUp, dequantize_dense, load_weights, prepare_for_kernels

KERNEL_SHAPES = dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2, moe_intermediate=128)
PAGE = 16
# (prefill prompt lengths, greedy prompt lengths, greedy steps) per device type
SIZES = {"cpu": ([40, 13, 5], [21, 4], 6), "cuda": ([300, 45, 9], [37, 5, 120], 12)}
E4M3_REL_ROUNDING = 2.0**-4
FORMATS = ["bf16", "fp8", "mxfp8"]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    """{"bf16": plain checkpoint, "fp8": the same converted to FP8 blocks, "mxfp8": converted to MXFP8}."""
    plain = tiny_checkpoint("kernel_shapes", **KERNEL_SHAPES)
    paths = {"bf16": plain}
    for name, fmt in (("fp8", "fp8-block"), ("mxfp8", "mxfp8")):
        paths[name] = plain.parent / f"{plain.name}_{name}"
        if not (paths[name] / "config.json").exists():
            quantize_checkpoint(plain, paths[name], fmt)
    return paths


def _prefill_logits(model: Qwen3Model, prompts: list[list[int]]) -> torch.Tensor:
    c = model.config
    cache = PagedKVCache(KVLayout(c.num_layers, 64, model.local_kv_heads, PAGE, c.head_dim, model.dtype), model.device)
    chunks, next_page = [], 0
    for p in prompts:
        n = -(-len(p) // PAGE)
        chunks.append(SequenceChunk(p, 0, list(range(next_page, next_page + n))[::-1]))
        next_page += n
    return model.forward(ForwardBatch.build(chunks, PAGE, model.device), cache, all_logits=True).float().cpu()


def _models(path, device: str):
    """(fp32 reference, bf16 reference ops, bf16 kernel ops)."""
    fp32 = Qwen3Model.load(path, dtype=torch.float32, device=device, kernels=False)
    ref = Qwen3Model.load(path, dtype=torch.bfloat16, device=device, kernels=False)
    kern = Qwen3Model.load(path, dtype=torch.bfloat16, device=device, kernels=True)
    assert kern.moe_reference_reason is None, kern.moe_reference_reason
    assert all(isinstance(layer.mlp.w13, FusedGateUp) for layer in kern.weights.layers), "kernel path not taken"
    assert not any(isinstance(layer.mlp.w13, FusedGateUp) for layer in ref.weights.layers)
    return fp32, ref, kern


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_logits_kernels_vs_reference(checkpoints, fmt, device):
    fp32, ref, kern = _models(checkpoints[fmt], device)
    prompts = random_prompts(SIZES[device][0], seed=4)
    exact, ours_ref, ours_kern = (_prefill_logits(m, prompts) for m in (fp32, ref, kern))
    e_ref, e_kern = median_token_rel_err(ours_ref, exact), median_token_rel_err(ours_kern, exact)
    a_ref, a_kern = agreement(ours_ref, exact), agreement(ours_kern, exact)
    print(f"{fmt} {device}: median token rel err vs fp32: reference ops {e_ref:.2e}, kernels {e_kern:.2e}; "
          f"kernels vs reference ops {median_token_rel_err(ours_kern, ours_ref):.2e}; "
          f"argmax agreement with fp32: reference {a_ref:.1%} kernels {a_kern:.1%}")
    assert torch.isfinite(ours_kern).all()
    if fmt == "fp8":  # W8A8 against the reference ops' W8A16
        assert e_kern <= E4M3_REL_ROUNDING
    else:
        assert e_kern <= 2 * e_ref + 1e-3
    assert a_kern >= a_ref - 0.10


def _greedy(model: Qwen3Model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    c = model.config
    cache = PagedKVCache(KVLayout(c.num_layers, 64, model.local_kv_heads, PAGE, c.head_dim, model.dtype), model.device)
    runner = ModelRunner(model, cache)
    seqs = [runner.add(str(i), p, SamplingParams(temperature=0.0, max_tokens=steps)) for i, p in enumerate(prompts)]
    runner.prefill(seqs)
    for _ in range(steps - 1):
        runner.decode(seqs)
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_decode_kernels_vs_reference(checkpoints, fmt, device):
    _, ref, kern = _models(checkpoints[fmt], device)
    prompts, steps = random_prompts(SIZES[device][1], seed=5), SIZES[device][2]
    out_ref, out_kern = _greedy(ref, prompts, steps), _greedy(kern, prompts, steps)
    # Both paths teacher-forced on the reference's own continuation: the reference's
    # logits at each generated position, and the typical difference of the two paths.
    full = [p + o for p, o in zip(prompts, out_ref)]
    logits_ref, logits_kern = _prefill_logits(ref, full), _prefill_logits(kern, full)
    typical_diff = float((logits_kern - logits_ref).abs().amax(-1).median())
    offset = 0
    for p, o_ref, o_kern in zip(prompts, out_ref, out_kern):
        print(f"{fmt} {device}: reference {o_ref} kernels {o_kern}")
        parted = next((i for i, (a, b) in enumerate(zip(o_ref, o_kern)) if a != b), None)
        if parted is not None:
            pos = offset + len(p) - 1 + parted  # the position whose logits chose output token `parted`
            margin = float(logits_ref[pos, o_ref[parted]] - logits_ref[pos, o_kern[parted]])
            own_forward = int(logits_kern[pos].argmax())
            assert margin <= 4 * typical_diff or own_forward == o_kern[parted], (
                f"greedy tokens part at step {parted} where the reference's margin {margin:.3g} is not a near tie "
                f"(typical logits difference {typical_diff:.3g}) and the kernel path's prefill forward picks "
                f"{own_forward}, not its decode step's {o_kern[parted]}")
        offset += len(p) + len(o_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_attention_matches_reference(device):
    """Mixed batch: a prefill chunk after a cached prefix, a decode step, a fresh prompt."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(6)
    hq, hkv, d, page = 8, 2, 64, 4
    cache = PagedKVCache(KVLayout(1, 24, hkv, page, d, dtype), device)
    cache.pools[0].copy_(torch.randn(cache.pools[0].shape, generator=gen).to(dtype))
    chunks = [SequenceChunk([1] * 7, 5, [3, 9, 1]), SequenceChunk([2], 20, [0, 4, 7, 11, 13, 2]), SequenceChunk([3] * 3, 0, [20])]
    meta = ForwardBatch.build(chunks, page, torch.device(device)).attn
    q = torch.randn(11, hq, d, generator=gen).to(device=device, dtype=dtype)
    expect = ops.paged_attention(q, cache, 0, meta, d**-0.5).float()
    got = ops.paged_attention_sdpa(q, cache, 0, meta, d**-0.5).float()
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7  # bf16 output rounding, probabilities in bf16 inside SDPA
    torch.testing.assert_close(got, expect, rtol=tol, atol=tol)


def test_prepare_for_kernels_converts_in_place_or_says_why(tiny_checkpoint, checkpoints):
    path = checkpoints["bf16"]
    config = ModelConfig.from_dir(path)
    weights = load_weights(path, config, dtype=torch.bfloat16)
    plain = weights.layers[0].mlp.w13.clone()
    assert prepare_for_kernels(weights) is None
    fused = weights.layers[0].mlp.w13
    assert isinstance(fused, FusedGateUp) and fused.scale is None
    assert torch.equal(deinterleave_gate_up(fused.weight)[0], plain)
    assert prepare_for_kernels(weights) is None  # idempotent

    fp8 = load_weights(checkpoints["fp8"], ModelConfig.from_dir(checkpoints["fp8"]), dtype=torch.bfloat16)
    assert prepare_for_kernels(fp8) is None
    assert fp8.layers[1].mlp.w13.scale.shape == (8, 2 * 128 // 64, 128 // 128)

    mx = load_weights(checkpoints["mxfp8"], ModelConfig.from_dir(checkpoints["mxfp8"]), dtype=torch.bfloat16)
    plain_mx = mx.layers[1].mlp.w13
    assert isinstance(plain_mx, Mxfp8Weight)
    plain_q, plain_e8m0 = plain_mx.weight.clone(), plain_mx.scale_e8m0.clone()
    assert prepare_for_kernels(mx) is None
    fused = mx.layers[1].mlp.w13
    assert isinstance(fused, FusedGateUp) and fused.scale is None and fused.scale_e8m0.dtype == torch.uint8
    # each row keeps its own exponents: undoing the interleave gives the file's weights and scales back
    assert torch.equal(deinterleave_gate_up(fused.weight)[0].view(torch.uint8), plain_q.view(torch.uint8))
    assert torch.equal(deinterleave_gate_up(fused.scale_e8m0)[0], plain_e8m0)
    w2 = mx.layers[1].mlp.w2
    assert isinstance(w2, Mxfp8Weight)  # same weights; its scales in the kernel's 16-byte rows
    assert w2.scale_e8m0.stride()[-2] % 16 == 0 and w2.scale_e8m0.data_ptr() % 16 == 0

    fp32 = load_weights(path, config, dtype=torch.float32)
    assert "float32" in prepare_for_kernels(fp32)
    assert not isinstance(fp32.layers[0].mlp.w13, FusedGateUp)
    small = tiny_checkpoint("gqa4_top8_norm")  # moe_intermediate 32
    odd = load_weights(small, ModelConfig.from_dir(small), dtype=torch.bfloat16)
    assert "multiple of 64" in prepare_for_kernels(odd)
    model = Qwen3Model(ModelConfig.from_dir(small), odd, kernels=True)  # runs, MoE on the reference ops
    assert not isinstance(model.weights.layers[0].mlp.w13, FusedGateUp)
    assert "multiple of 64" in model.moe_reference_reason


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
def test_reference_switch_on_cuda(checkpoints, device, monkeypatch):
    """Built on CUDA the model takes the kernel path by default, the reference ops under MOEBUS_KERNELS=reference."""
    monkeypatch.delenv("MOEBUS_KERNELS", raising=False)
    default = Qwen3Model.load(checkpoints["bf16"], dtype=torch.bfloat16, device=device)
    assert default.kernels and isinstance(default.weights.layers[0].mlp.w13, FusedGateUp)
    monkeypatch.setenv("MOEBUS_KERNELS", "reference")
    forced = Qwen3Model.load(checkpoints["bf16"], dtype=torch.bfloat16, device=device)
    assert not forced.kernels and not isinstance(forced.weights.layers[0].mlp.w13, FusedGateUp)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_dequantize_dense_makes_the_projections_plain_once(checkpoints, fmt):
    """Attention projections become exactly what the reference `linear` makes per call; experts stay quantized."""
    path = checkpoints[fmt]
    weights = load_weights(path, ModelConfig.from_dir(path), dtype=torch.bfloat16)
    quantized = (BlockFp8Weight, Mxfp8Weight)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    before = [{n: getattr(layer.attn, n) for n in names} for layer in weights.layers]
    assert all(isinstance(w, quantized) for layer in before for w in layer.values())
    expect = [{n: w.dequantize(torch.bfloat16) for n, w in layer.items()} for layer in before]
    fp8_bytes = sum(w.weight.numel() for layer in before for w in layer.values())  # one byte per E4M3 value

    added = dequantize_dense(weights)

    for layer, want in zip(weights.layers, expect):
        for n in names:
            got = getattr(layer.attn, n)
            assert type(got) is torch.Tensor and got.dtype == torch.bfloat16 and torch.equal(got, want[n]), n
        assert isinstance(layer.mlp.w13, quantized) and isinstance(layer.mlp.w2, quantized)  # the experts' kernels take these
    assert added == fp8_bytes  # 2 bytes per value in (bf16), 1 byte out (E4M3)
    assert dequantize_dense(weights) == 0  # nothing left to do

    x = torch.randn(5, weights.embed.shape[1], generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    assert torch.equal(ops.linear(x, weights.layers[0].attn.q_proj), ops.linear(x, before[0]["q_proj"]))


def test_kernel_model_dequantizes_dense_weights_and_reference_model_does_not(checkpoints):
    kern = Qwen3Model.load(checkpoints["fp8"], dtype=torch.bfloat16, kernels=True)
    ref = Qwen3Model.load(checkpoints["fp8"], dtype=torch.bfloat16, kernels=False)
    assert kern.dense_dequantized_bytes > 0 and type(kern.weights.layers[0].attn.o_proj) is torch.Tensor
    assert ref.dense_dequantized_bytes == 0 and isinstance(ref.weights.layers[0].attn.o_proj, BlockFp8Weight)
    assert Qwen3Model.load(checkpoints["bf16"], dtype=torch.bfloat16, kernels=True).dense_dequantized_bytes == 0


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_kernel_model_fuses_qkv_into_one_weight_without_copies(checkpoints, fmt):
    """On the kernel path every layer's q/k/v projections are row slices of one stacked weight
    (the checkpoint's values, FP8 ones dequantized first); the reference path keeps three."""
    ref = Qwen3Model.load(checkpoints[fmt], dtype=torch.bfloat16, kernels=False)
    kern = Qwen3Model.load(checkpoints[fmt], dtype=torch.bfloat16, kernels=True)
    for k_layer, r_layer in zip(kern.weights.layers, ref.weights.layers):
        a, r = k_layer.attn, r_layer.attn
        assert r.qkv_proj is None and a.qkv_proj is not None
        rows = [w.shape[0] for w in (a.q_proj, a.k_proj, a.v_proj)]
        assert a.qkv_proj.shape[0] == sum(rows)
        for part, start in zip((a.q_proj, a.k_proj, a.v_proj), (0, rows[0], rows[0] + rows[1])):
            assert part.data_ptr() == a.qkv_proj[start].data_ptr()  # a view, not a copy
        plain = [w if isinstance(w, torch.Tensor) else w.dequantize(torch.bfloat16) for w in (r.q_proj, r.k_proj, r.v_proj)]
        assert torch.equal(a.qkv_proj, torch.cat(plain))


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs_on_the_kernel_path_are_the_prefill_logits_log_softmax(checkpoints, device):
    """bf16 kernels: a prefill batch of two prompts, the second asking for prompt logprobs (top 3),
    against log_softmax of the same batch's logits from the model's own forward."""
    kern = Qwen3Model.load(checkpoints["bf16"], dtype=torch.bfloat16, device=device, kernels=True)
    other, prompt = random_prompts(SIZES[device][0][:2], seed=9)
    want = torch.log_softmax(_prefill_logits(kern, [other, prompt])[len(other) : len(other) + len(prompt) - 1], dim=-1)
    c = kern.config
    runner = ModelRunner(kern, PagedKVCache(KVLayout(c.num_layers, 64, kern.local_kv_heads, PAGE, c.head_dim, kern.dtype), kern.device))
    asking = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    got = runner.prefill([runner.add("o", other, SamplingParams(temperature=0.0, max_tokens=2)), runner.add("p", prompt, asking)])[1].prompt_logprobs
    assert got is not None and got.first == 1 and got.top is not None
    torch.testing.assert_close(torch.tensor(got.logprobs), want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], rtol=0, atol=2e-3)
    torch.testing.assert_close(torch.tensor([t.logprobs for t in got.top]), want.topk(3, dim=-1).values, rtol=0, atol=2e-3)
