"""One Qwen3-235B MoE layer in the prefill layout on W GPUs (TP = EP = W, default: every visible GPU).

6000 tokens, hidden 4096, 128 experts (128 / W per rank), top-8, expert intermediate
1536, bf16. Inputs are replicated on every rank; each rank runs its own experts.

* ours: `ep_select` (CuTeDSL) -> grouped GEMMs -> `ep_combine` (CuTeDSL) ->
  our all-reduce, timed eagerly and as one CUDA graph of ``ops`` layers;
* reference: the torch reference select/combine -> the same grouped GEMMs ->
  NCCL all-reduce (eager: the reference select synchronises with the host).

Both paths use ``torch._grouped_mm`` for the expert GEMMs so the comparison is
about the exchange; the per-stage times of our path are reported too. The two
outputs are compared before timing.

    python -m bench.ep_prefill_layer [--world W]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.timing import capture_graph, ranks_time_us
from kernels._local_group import run_local_group

TOKENS, HIDDEN, EXPERTS, TOPK, INTER = 6000, 4096, 128, 8, 1536
ALIGN = 16  # group starts on 16-row boundaries for the grouped GEMM


def _bench_rank(rank: int, world: int) -> dict:
    from kernels import ep_prefill as ep
    from kernels.allreduce import CudaAllReduce

    num_local = EXPERTS // world
    start = rank * num_local
    g = torch.Generator(device="cuda").manual_seed(0)  # replicated inputs
    x = (torch.randn(TOKENS, HIDDEN, generator=g, device="cuda") * 0.5).bfloat16()
    logits = torch.randn(TOKENS, EXPERTS, generator=g, device="cuda")
    w, ids = torch.softmax(logits, dim=-1).topk(TOPK, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float().contiguous()
    ids = ids.int().contiguous()
    gw = torch.Generator(device="cuda").manual_seed(100 + rank)
    w13 = (torch.randn(num_local, 2 * INTER, HIDDEN, generator=gw, device="cuda") * HIDDEN**-0.5).bfloat16()
    w2 = (torch.randn(num_local, HIDDEN, INTER, generator=gw, device="cuda") * INTER**-0.5).bfloat16()
    comm = CudaAllReduce(dist.group.WORLD)
    comm.warmup((torch.bfloat16,))

    def experts(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        offs = offsets[1:]
        h = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm((F.silu(gate) * up).contiguous(), w2.transpose(-2, -1), offs=offs)

    def ours() -> torch.Tensor:
        sel = ep.ep_select(x, ids, start, num_local, ALIGN)
        out = ep.ep_combine(experts(sel.rows, sel.offsets), sel.row_of, w)
        return comm(out, out=out)

    def reference() -> torch.Tensor:
        sel = ep.ep_select_reference(x, ids, start, num_local, ALIGN)
        out = ep.ep_combine_reference(experts(sel.rows, sel.offsets), sel.row_of, w)
        dist.all_reduce(out)
        return out

    a, b = ours(), reference()
    torch.cuda.synchronize()
    rel_err = ((a.float() - b.float()).norm() / b.float().norm()).item()

    sel = ep.ep_select(x, ids, start, num_local, ALIGN)
    y = experts(sel.rows, sel.offsets)
    partial = ep.ep_combine(y, sel.row_of, w)
    stages = {
        "select_us": ranks_time_us(lambda: ep.ep_select(x, ids, start, num_local, ALIGN)),
        "expert_gemms_us": ranks_time_us(lambda: experts(sel.rows, sel.offsets)),
        "combine_us": ranks_time_us(lambda: ep.ep_combine(y, sel.row_of, w)),
        "allreduce_us": ranks_time_us(lambda: comm(partial, out=torch.empty_like(partial))),
        "ref_select_us": ranks_time_us(lambda: ep.ep_select_reference(x, ids, start, num_local, ALIGN)),
        "ref_combine_us": ranks_time_us(lambda: ep.ep_combine_reference(y, sel.row_of, w)),
        "nccl_allreduce_us": ranks_time_us(lambda: dist.all_reduce(partial.clone())),
    }
    layer_eager = ranks_time_us(ours)
    ref_eager = ranks_time_us(reference)

    ops = 4
    graph = capture_graph(ours, ops)
    layer_graph = ranks_time_us(graph.replay) / ops
    rows_local = int(sel.counts.sum())
    return {"rel_err": rel_err, "layer_eager_us": layer_eager, "layer_graph_us": layer_graph, "ref_eager_us": ref_eager, "rows": rows_local, **stages}


def main(argv: list[str] | None = None) -> int:
    from bench.results import print_table, record

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    world = p.parse_args(argv).world
    if world < 2 or EXPERTS % world:
        raise SystemExit(f"--world must be >= 2 and divide {EXPERTS} experts, got {world}")
    res = run_local_group(_bench_rank, world, "nccl", timeout=600)
    r = res[0]
    case = {"tokens": TOKENS, "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "intermediate": INTER, "tp": world, "ep": world, "dtype": "bf16"}
    metrics = {k: v for k, v in r.items() if not k.startswith("ref_") and k != "nccl_allreduce_us"}
    metrics["speedup_vs_reference"] = r["ref_eager_us"] / r["layer_eager_us"]
    peers = {"torch_reference_nccl": {"layer_eager_us": r["ref_eager_us"], "select_us": r["ref_select_us"], "combine_us": r["ref_combine_us"], "allreduce_us": r["nccl_allreduce_us"]}}
    record("ep_prefill_layer", case, metrics, peers)
    print_table([{"path": "ours", "layer_us(eager)": r["layer_eager_us"], "layer_us(graph)": r["layer_graph_us"], "select": r["select_us"],
                  "gemms": r["expert_gemms_us"], "combine": r["combine_us"], "allreduce": r["allreduce_us"]},
                 {"path": "ref+nccl", "layer_us(eager)": r["ref_eager_us"], "layer_us(graph)": float("nan"), "select": r["ref_select_us"],
                  "gemms": r["expert_gemms_us"], "combine": r["ref_combine_us"], "allreduce": r["nccl_allreduce_us"]}],
                ["path", "layer_us(eager)", "layer_us(graph)", "select", "gemms", "combine", "allreduce"])
    print(f"rel err ours vs reference: {r['rel_err']:.2e}; rows on rank 0: {r['rows']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
