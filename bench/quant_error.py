"""Quantization error of FP8 block-scaled (128x128) vs MXFP8 (E8M0 per 32) weights,
and of per-token-group activation quantization, on Qwen3-30B-A3B tensor shapes.

Real checkpoints are not available offline, so the weights are synthetic with three
value distributions that bracket real ones: gaussian, heavy-tailed (Student t, 3
degrees of freedom) and gaussian with log-normally scaled output channels. Run:

    python -m bench.quant_error            # prints a table, appends bench/results/quant_error.jsonl
"""

from __future__ import annotations

import argparse

import torch

from bench.results import print_table, record
from shared.model.quant_formats import (
    dequantize_act_per_token_group,
    quant_error,
    quantize_act_per_token_group,
    quantize_block_fp8,
    quantize_mxfp8,
)

# Qwen3-30B-A3B: hidden 2048, 32 q / 4 KV heads of 128, expert intermediate 768
WEIGHT_SHAPES = {
    "attn.q_proj": (4096, 2048),
    "attn.k_proj": (512, 2048),
    "attn.o_proj": (2048, 4096),
    "expert.gate_proj": (768, 2048),
    "expert.down_proj": (2048, 768),
}


def synthetic_weight(shape: tuple[int, int], distribution: str, generator: torch.Generator) -> torch.Tensor:
    if distribution == "gaussian":
        return torch.randn(shape, generator=generator) * 0.02
    if distribution == "student_t3":
        normal = torch.randn(shape, generator=generator)
        chi2 = torch.randn((3, *shape), generator=generator).square().sum(0)
        return 0.02 * normal / torch.sqrt(chi2 / 3)
    if distribution == "channel_scaled":
        scales = torch.exp(torch.randn(shape[0], 1, generator=generator) * 1.0)
        return torch.randn(shape, generator=generator) * 0.02 * scales
    raise ValueError(f"unknown distribution {distribution}")


def synthetic_activations(tokens: int, hidden: int, generator: torch.Generator) -> torch.Tensor:
    # LLM hidden states: mostly O(1) values plus a few channels two orders larger
    x = torch.randn(tokens, hidden, generator=generator)
    outliers = torch.randperm(hidden, generator=generator)[:4]
    x[:, outliers] *= 100.0
    return x


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help="print only, do not append to bench/results")
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    for distribution in ("gaussian", "student_t3", "channel_scaled"):
        for family, shape in WEIGHT_SHAPES.items():
            w = synthetic_weight(shape, distribution, generator)
            block = quant_error(w, quantize_block_fp8(w).dequantize())
            mx = quant_error(w, quantize_mxfp8(w).dequantize())
            metrics = {
                "fp8_block_rel_fro_pct": 100 * block.rel_fro, "fp8_block_snr_db": block.snr_db,
                "mxfp8_rel_fro_pct": 100 * mx.rel_fro, "mxfp8_snr_db": mx.snr_db,
            }
            case = {"tensor": family, "shape": list(shape), "distribution": distribution, "seed": args.seed}
            rows.append({**case, **metrics})
            if not args.no_record:
                record("quant_error", case, metrics)
    x = synthetic_activations(256, 2048, generator)
    act = quant_error(x, dequantize_act_per_token_group(*quantize_act_per_token_group(x, 128)))
    act_mx = quant_error(x, quantize_mxfp8(x).dequantize())
    case = {"tensor": "activations", "shape": [256, 2048], "distribution": "4_outlier_channels_x100", "seed": args.seed}
    metrics = {"fp8_block_rel_fro_pct": 100 * act.rel_fro, "fp8_block_snr_db": act.snr_db,
               "mxfp8_rel_fro_pct": 100 * act_mx.rel_fro, "mxfp8_snr_db": act_mx.snr_db}
    rows.append({**case, **metrics})
    if not args.no_record:
        record("quant_error", case, metrics)
    print("fp8_block: 128x128 weight blocks, 1x128 activation groups; mxfp8: 1x32 groups, power-of-two scales")
    print_table(rows, ["tensor", "distribution", "fp8_block_rel_fro_pct", "fp8_block_snr_db",
                       "mxfp8_rel_fro_pct", "mxfp8_snr_db"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
