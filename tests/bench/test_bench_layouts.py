"""Multi-GPU benchmark layouts checked without a GPU: KV-transfer placement, the EP sizes the
dispatch/combine benchmark takes, decode_step's refusals and FP8 weights, and the plan of
bench/gpu_scale.sh at 2, 4 and 8 GPUs."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from bench import decode_step, dispatch_combine
from bench.kv_transfer import PlacementError, plan_placement, visible_devices
from shared.transfer import kv_head_shard

ROOT = Path(__file__).resolve().parents[2]


# -- KV transfer placement ----------------------------------------------------------------


def test_two_gpus_keep_the_original_layout():
    p = plan_placement([1, 2], kv_heads=4, gpus=2)
    assert p.decode_gpu == 1
    assert p.senders == {1: [(0, 0)], 2: [(0, 0), (1, 0)]}  # both TP=2 ranks on GPU 0
    assert p.slots(2) == [(0, 0), (0, 1)]  # two processes on GPU 0; TP=1 reuses the first
    assert p.case_fields(1) == {} and p.case_fields(2) == {}  # rows as before
    assert visible_devices(1, [0]) == "1,0" and visible_devices(0, [1]) == "0,1"


def test_four_tp_ranks_on_eight_gpus_send_to_the_next_gpu():
    p = plan_placement([1, 2, 4], kv_heads=4, gpus=8)
    assert p.decode_gpu == 4
    assert p.senders[4] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert p.senders[2] == [(0, 0), (1, 1)]
    assert p.case_fields(4) == {"sender_gpus": [0, 1, 2, 3], "decode_gpu": 4}
    assert all(gpu != p.decode_gpu for senders in p.senders.values() for _, gpu in senders)
    assert visible_devices(4, [3, 0, 1, 2, 0]) == "4,0,1,2,3"


def test_four_tp_ranks_on_four_gpus_share_the_gpus_before_the_decode_rank():
    p = plan_placement([1, 2, 4], kv_heads=4, gpus=4)
    assert p.decode_gpu == 3
    assert [gpu for _, gpu in p.senders[4]] == [0, 1, 2, 0]
    assert p.slots(4) == [(0, 0), (1, 0), (2, 0), (0, 1)]


def test_replicated_heads_send_once_each():
    p = plan_placement([8], kv_heads=4, gpus=8)
    assert p.decode_gpu == 7
    ranks = [rank for rank, _ in p.senders[8]]
    assert ranks == [0, 2, 4, 6]
    heads = sorted(h for r in ranks for h in range(kv_head_shard(r, 8, 4).start, kv_head_shard(r, 8, 4).end))
    assert heads == [0, 1, 2, 3]


@pytest.mark.parametrize("layouts, gpus, words", [([1], 1, "2 GPUs"), ([3], 8, "TP=3"), ([0, 1], 8, "positive")])
def test_impossible_placements_are_refused(layouts, gpus, words):
    with pytest.raises(PlacementError, match=words):
        plan_placement(layouts, kv_heads=4, gpus=gpus)


# -- dispatch/combine EP sizes ----------------------------------------------------------------


def test_dispatch_combine_world_checks():
    assert dispatch_combine.check_world(8, gpus=8) is None
    assert dispatch_combine.check_world(16, gpus=16) is None
    assert "split evenly" in dispatch_combine.check_world(3, gpus=8)
    assert "2..16" in dispatch_combine.check_world(32, gpus=32)
    assert "needs 8 GPUs" in dispatch_combine.check_world(8, gpus=4)


# -- decode_step ------------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--ep", "3"], "do not split evenly over 3"),
    (["--ep", "2", "--device", "cpu", "--impls", "torch-reference"], "--ep needs CUDA"),
    (["--weights", "fp4"], "invalid choice"),
    (["--model", "qwen3-1t"], "invalid choice"),
])
def test_decode_step_refusals(args, words, capsys):
    with pytest.raises(SystemExit):
        decode_step.main(args)
    assert words in capsys.readouterr().err


def test_random_block_fp8_experts_are_valid_and_scaled():
    w = decode_step.random_block_fp8(3, 256, 384, torch.device("cpu"))
    assert w.weight.shape == (3, 256, 384) and w.weight.dtype == torch.float8_e4m3fn
    assert w.scale_inv.shape == (3, 2, 3)
    std = w.dequantize().std().item()
    assert 0.018 < std < 0.022  # drawn with std 0.02


def test_decode_step_runs_fp8_experts_on_cpu_and_records_them(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBUS_RESULTS_DIR", str(tmp_path))
    rc = decode_step.main(["--device", "cpu", "--impls", "torch-reference", "--weights", "fp8", "--layers", "1", "--experts", "8",
                           "--vocab", "256", "--batches", "2", "--context", "8", "--iters", "1"])
    assert rc == 0
    (line,) = [json.loads(x) for x in (tmp_path / "decode_step.jsonl").read_text().splitlines()]
    assert line["case"]["model"] == "qwen3-30b-a3b-shapes" and line["case"]["expert_weights"] == "fp8"
    assert line["metrics"]["tokens_per_s"] > 0 and line["metrics"]["experts_hit_per_layer"] == 8  # top-8 of 8


# -- bench/gpu_scale.sh -----------------------------------------------------------------------


def _plan(gpus: int, mode: str = "comm") -> dict[str, tuple[int, list[str]]]:
    env = os.environ | {"SCALE_DRY_RUN": "1", "SCALE_GPUS": str(gpus)}
    out = subprocess.run(["bash", "bench/gpu_scale.sh", mode], cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    plan = {}
    for line in out.splitlines():
        _, name, limit, *command = shlex.split(line)
        plan[name] = (int(limit), command)
    return plan


def test_gpu_scale_script_parses():
    subprocess.run(["bash", "-n", "bench/gpu_scale.sh"], cwd=ROOT, check=True)


def test_gpu_scale_plan_follows_the_gpu_count():
    eight, four, two = _plan(8), _plan(4), _plan(2)
    assert eight["bench_dispatch_combine"][1][-2:] == ["--world", "8"] and four["bench_dispatch_combine"][1][-2:] == ["--world", "4"]
    assert eight["bench_allreduce"][1][-2:] == ["--world", "8"]
    assert eight["bench_ep_prefill"][1][-2:] == ["--world", "4"] and "bench_ep_prefill" in four and "bench_ep_prefill" not in two
    assert "decode_step" in eight and "decode_step" not in four
    decode = eight["decode_step"][1]
    assert decode[decode.index("--ep") + 1] == "8" and decode[decode.index("--batches") + 1:decode.index("--profile")] == ["32", "64", "128"]
    kv = _plan(8, "kv")["bench_kv_transfer"][1]
    assert kv[kv.index("--prefill-ranks") + 1] == "1,2,4"


def test_gpu_scale_bench_commands_parse_and_stop_only_at_the_gpu_count(capsys):
    # Their arguments are accepted; on this machine they stop at the missing GPUs.
    plan = _plan(8)
    for name, module in (("bench_dispatch_combine", dispatch_combine), ("decode_step", decode_step)):
        command = plan[name][1]
        with pytest.raises(SystemExit):
            module.main(command[3:])  # after "python3 -m bench.<name>"
        err = capsys.readouterr().err
        assert ("needs 8 GPUs" in err) or ("--ep needs CUDA" in err), err


@pytest.mark.slow
def test_kv_transfer_bench_with_four_prefill_ranks_on_cpu(tmp_path, monkeypatch):
    # Real processes over UCX/TCP: each layout's first transfer is checked bit for bit on the
    # decode side, and a layout whose transfer fails or differs records no row.
    from bench import kv_transfer

    monkeypatch.setenv("MOEBUS_RESULTS_DIR", str(tmp_path))
    rc = kv_transfer.main(["--device", "cpu", "--prefill-ranks", "1,4", "--tokens", "64", "--layers", "2", "--iters", "1",
                           "--overlap-iters", "0", "--chunk-mib", "4"])
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "kv_transfer.jsonl").read_text().splitlines()]
    assert sorted(r["case"]["prefill_layout"] for r in rows) == ["tp1", "tp4"]
    assert all("decode_gpu" not in r["case"] for r in rows)  # CPU rows keep the original case fields
    assert all(r["metrics"]["gbps"] > 0 for r in rows)
