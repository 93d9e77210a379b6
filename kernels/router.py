"""MoE routing after the router GEMM: softmax, top-k and the optional renormalization, fused.

``route_topk(logits [T, E], k, norm_topk_prob)`` -> ``(weights [T, k] in the logits'
dtype, expert ids [T, k] int64)``, the selection transformers' Qwen3-MoE makes: fp32
softmax over the experts, the k largest probabilities in descending order, divided by
their sum when ``norm_topk_prob``, cast to the activation dtype. As torch ops that is six
kernels (softmax, a top-k of two, sum, divide, cast); on CUDA it is one, a warp per token.

The kernel computes the same fp32 softmax (``exp(x - max) / sum``) and picks the same
experts; where two probabilities are equal it takes the lower expert id. Its fp32 sums
run in another order than torch's, so a probability can differ in its last bit: a
weight by one unit of bf16 at most, and an expert choice only where two probabilities
agree to that bit (a router near-tie, which rounding decides on any implementation).

This module imports only torch; the CuTeDSL kernel is :mod:`kernels.router_sm90`. It
takes bf16 logits for up to 256 experts in multiples of 32 and ``k <= 32``; other inputs
take the reference.
"""

from __future__ import annotations

import torch

MAX_EXPERTS = 256  # 8 per lane of a warp


def route_topk_reference(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops of transformers' Qwen3-MoE router after its GEMM."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, *, use_kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in logits.dtype, ids [T, k] int64)`` (module doc); ``use_kernel=False``
    runs the reference whatever the device (a model on the reference path)."""
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"route_topk: logits must be [T, E] with 1 <= top_k <= E, got {tuple(logits.shape)} and top_k={top_k}")
    experts = logits.shape[1]
    if not (use_kernel and logits.is_cuda and logits.dtype == torch.bfloat16 and experts % 32 == 0
            and experts <= MAX_EXPERTS and top_k <= 32):
        return route_topk_reference(logits, top_k, norm_topk_prob)
    from kernels import router_sm90  # CuTeDSL is imported only on the GPU path

    return router_sm90.route_topk_cuda(logits.contiguous(), top_k, norm_topk_prob)
