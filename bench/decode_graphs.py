"""Benchmark: a decode service's step through `ModelRunner.decode`, eager vs CUDA-graph replays.

What a decode rank runs per step (`shared.model.cuda_graphs`): building the step's inputs,
the forward, sampling, the host bookkeeping; timed as wall time per `decode` call (the
sampler's token read-back synchronises each step). The model is a tiny Qwen3-MoE with
kernel shapes (make-tiny: 2 layers, hidden 128, 16 experts of intermediate 128, top-4,
bf16) on one GPU, so the figures show what graphs save in launch and host overhead, not
a large model's bandwidth-bound step (bench/decode_step.py measures that, forward only).
Each batch runs with a context of ``--context`` cached tokens per sequence.

    python -m bench.decode_graphs [--batches 1 8 32] [--context 64] [--iters 30]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from bench.results import print_table, record
from bench.timing import time_step
from shared.model.runner import ModelRunner
from shared.model.sampling_params import SamplingParams
from shared.model.tiny import make_tiny

BENCH = "decode_graphs"
SHAPES = dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64, experts=16, top_k=4, moe_intermediate=128,
              vocab=512, tokenizer=False, dtype="float32", seed=3)
PAGE = 16


def step_seconds(runner: ModelRunner, batch: int, context: int, iters: int) -> float:
    """Median wall seconds of one `decode` over ``batch`` sequences (``bench.timing.time_step``)."""
    layout = runner.cache.layout
    params = SamplingParams(temperature=0.0, max_tokens=iters + 8)
    seqs = []
    for i in range(batch):
        pages = runner.cache.allocator.alloc(layout.pages_for(context + iters + 8))
        seqs.append(runner.add(f"s{i}", [(7 * i + 1) % SHAPES["vocab"]] * context, params, page_table=pages, num_cached=context, output_ids=[1]))
    seconds = time_step(lambda: runner.decode(seqs), runner.cache.device, iters)
    for s in seqs:
        runner.release(s)
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    torch.cuda.set_device(0)
    path = make_tiny(tempfile.mkdtemp(prefix="decode-graphs-"), **SHAPES)
    pages = max(a.batches) * -(-(a.context + a.iters + 8) // PAGE) + 1
    runners = {}
    for impl in ("eager", "cuda-graph"):
        loaded = ModelRunner.from_dir(path, num_pages=pages, page_size=PAGE, dtype=torch.bfloat16, device="cuda:0")
        runners[impl] = ModelRunner(loaded.model, loaded.cache)  # no EOS: every sequence runs every step
    runners["cuda-graph"].use_decode_graphs(max(a.batches), max_graphs=64)
    rows = []
    for b in a.batches:
        seconds = {impl: step_seconds(r, b, a.context, a.iters) for impl, r in runners.items()}
        for impl, s in seconds.items():
            metrics = {"step_ms": s * 1e3, "tokens_per_s": b / s}
            peers = {}
            if impl == "cuda-graph":
                metrics["speedup_vs_eager"] = seconds["eager"] / s
                peers["eager"] = {"step_ms": seconds["eager"] * 1e3, "tokens_per_s": b / seconds["eager"]}
            case = {"model": "tiny-kernel-shapes", "layers": SHAPES["layers"], "hidden": SHAPES["hidden"], "experts": SHAPES["experts"],
                    "batch": b, "context": a.context, "dtype": "bfloat16", "impl": impl, "path": "ModelRunner.decode"}
            record(BENCH, case, metrics, peers)
            rows.append({"impl": impl, "batch": b, **metrics})
    print(runners["cuda-graph"].decode_graphs.stats())
    print_table(rows, ["impl", "batch", "step_ms", "tokens_per_s", "speedup_vs_eager"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
