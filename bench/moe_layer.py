"""One MoE layer's expert block on one GPU: `kernels.moe.grouped_moe` with FP8 block-scaled Qwen3 experts.

``grouped_moe`` quantizes each token once and gathers its E4M3 row with its scales
(`kernels.ep_prefill.ep_select` with ``x_scale``). The peer, in the same process on the same
inputs, is the order the op had before: every token's top_k bf16 copies gathered, then each
copy quantized (`ep_select` -> `expert_ffn` -> `ep_combine`). Both give the same bits, which
is checked before timing. Each is timed as a CUDA graph of ``--repeat`` calls (no launch gaps,
as a decode step's graph runs it), median of ``--iters`` replays.

Shapes: Qwen3-30B-A3B (hidden 2048, expert intermediate 768) and Qwen3-235B-A22B (4096, 1536),
128 experts, top-8, all experts on this GPU; ``--tokens`` per layer call (decode batches to
prefill chunks), routing from random router logits.

    python -m bench.moe_layer --tokens 64,512,4096,16384
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.decode_step import random_block_fp8
from bench.results import print_table, record
from bench.timing import capture_graph, event_time_us
from kernels.ep_prefill import ep_combine, ep_select
from kernels.grouped_gemm import interleave_gate_up
from kernels.moe import expert_ffn, grouped_moe

BENCH = "moe_layer"
MODELS = {"qwen3-30b-a3b": (2048, 768), "qwen3-235b-a22b": (4096, 1536)}  # hidden, expert intermediate
EXPERTS, TOPK = 128, 8


def _fp8_experts(hidden: int, inter: int) -> dict[str, torch.Tensor]:
    """Random experts quantized to E4M3 with 128x128 scales, in the layout `grouped_moe` takes."""
    device = torch.device("cuda")
    w13, w2 = random_block_fp8(EXPERTS, 2 * inter, hidden, device), random_block_fp8(EXPERTS, hidden, inter, device)
    wi, si = interleave_gate_up(w13.weight, w13.scale_inv)
    return dict(w13_interleaved=wi, w2=w2.weight, w13_scale=si, w2_scale=w2.scale_inv)


def _gathered_then_quantized(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, weights: dict) -> torch.Tensor:
    sel = ep_select(x, ids, 0, EXPERTS)
    return ep_combine(expert_ffn(sel.rows, sel.offsets, **weights), sel.row_of, w)


def _graph_us(fn, repeat: int, iters: int) -> float:
    graph = capture_graph(fn, repeat, warmup=True)
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(event_time_us(graph.replay) for _ in range(iters)) / repeat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,512,4096,16384", help="comma list of tokens per layer call")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {list(MODELS)}")
    ap.add_argument("--repeat", type=int, default=10, help="calls per CUDA graph")
    ap.add_argument("--iters", type=int, default=10, help="graph replays timed (median)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("moe_layer: needs a CUDA GPU")
        return 1
    rows = []
    for model in a.models.split(","):
        hidden, inter = MODELS[model]
        gen = torch.Generator(device="cuda").manual_seed(0)
        weights = _fp8_experts(hidden, inter)
        for tokens in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
            probs = torch.softmax(torch.randn(tokens, EXPERTS, generator=gen, device="cuda"), dim=-1)
            w, ids = probs.topk(TOPK, dim=-1)
            w = (w / w.sum(-1, keepdim=True)).bfloat16()

            def ours():
                return grouped_moe(x, topk_ids=ids, topk_weights=w, expert_start=0, **weights)

            def before():
                return _gathered_then_quantized(x, ids, w, weights)

            equal = torch.equal(ours(), before())
            ours_us, before_us = _graph_us(ours, a.repeat, a.iters), _graph_us(before, a.repeat, a.iters)
            case = {"model": model, "hidden": hidden, "moe_intermediate": inter, "experts": EXPERTS, "top_k": TOPK,
                    "tokens": tokens, "expert_weights": "fp8_block128", "timing": f"graph of {a.repeat}"}
            metrics = {"latency_us": ours_us, "same_bits": float(equal)}
            peers = {"gathered_then_quantized": {"latency_us": before_us, "ratio_to_ours": before_us / ours_us}}
            record(BENCH, case, metrics, peers)
            rows.append({"model": model, "tokens": tokens, "ours_us": ours_us, "gathered_then_quantized_us": before_us,
                         "ratio": before_us / ours_us, "same_bits": equal})
    print_table(rows, ["model", "tokens", "ours_us", "gathered_then_quantized_us", "ratio", "same_bits"])
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
