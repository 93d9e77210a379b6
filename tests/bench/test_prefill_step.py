"""bench.prefill_step without a GPU: its prompt cases, its FLOP count and its records."""

from __future__ import annotations

import json

import pytest

from bench import prefill_step
from bench.decode_budget import MODELS
from shared.model.config import ModelConfig


@pytest.mark.parametrize("spec, parsed", [("1x8192", (1, 8192)), ("16x512", (16, 512))])
def test_prompt_cases_parse(spec, parsed):
    assert prefill_step.parse_prompts(spec) == parsed


@pytest.mark.parametrize("spec", ["0x128", "4x0", "4*128", "x128", "4x", "1x-8"])
def test_impossible_prompt_cases_are_refused(spec, capsys):
    with pytest.raises(SystemExit):
        prefill_step.main(["--device", "cpu", "--prompts", spec])
    assert "expected SxN" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--cached", "-1"], ["--profile", "-2"], ["--iters", "0"]])
def test_impossible_counts_are_refused(args, capsys):
    with pytest.raises(SystemExit):
        prefill_step.main(["--device", "cpu", *args])
    assert "--cached and --profile must not be negative and --iters must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [(["--graph-max-tokens", "0"], "--graph-max-tokens must be positive"),
                                           (["--impls", "kernels", "kernels+cuda-graph"], "kernels+cuda-graph needs a CUDA device")])
def test_impossible_graph_options_are_refused(args, message, capsys):
    with pytest.raises(SystemExit):
        prefill_step.main(["--device", "cpu", *args])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--tp", "0"], ["--tp", "2"]])
def test_tensor_parallel_ranks_need_as_many_gpus(args, capsys):
    with pytest.raises(SystemExit):
        prefill_step.main(["--device", "cpu", *args])
    assert f"--tp {args[1]} needs that many GPUs and --device cuda" in capsys.readouterr().err


def _flops_token_by_token(c: ModelConfig, seqs: int, new: int, cached: int) -> int:
    """The same count written per token: its projections, router and experts, and one
    QK^T + PV per key it attends to (the cached ones and the new ones up to itself)."""
    h, d, i = c.hidden_size, c.head_dim, c.moe_intermediate_size
    total = 0
    for _ in range(c.num_layers):
        for _ in range(seqs):
            for j in range(new):
                q, k, v, o = (2 * h * c.num_heads * d, 2 * h * c.num_kv_heads * d, 2 * h * c.num_kv_heads * d, 2 * c.num_heads * d * h)
                experts = c.top_k * (2 * h * 2 * i + 2 * i * h)  # gate_up [2I, H], down [H, I]
                keys = cached + j + 1
                total += q + k + v + o + 2 * h * c.num_experts + experts + c.num_heads * keys * 2 * (2 * d)
    return total + seqs * 2 * h * c.vocab_size


@pytest.mark.parametrize("seqs, new, cached", [(1, 7, 0), (3, 5, 11), (2, 16, 4)])
def test_forward_flops_counts_each_token_once(seqs, new, cached):
    c = ModelConfig.from_dict(dict(MODELS["qwen3-30b-a3b"]) | {"num_hidden_layers": 2})
    assert prefill_step.forward_flops(c, seqs, new, cached) == _flops_token_by_token(c, seqs, new, cached)


def test_prefill_step_runs_both_impls_on_cpu_and_records_the_peer(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBUS_RESULTS_DIR", str(tmp_path))
    rc = prefill_step.main(["--device", "cpu", "--weights", "fp8", "--layers", "1", "--experts", "8", "--vocab", "256",
                            "--prompts", "1x24", "2x8", "--cached", "16", "--iters", "1"])
    assert rc == 0
    lines = [json.loads(x) for x in (tmp_path / "prefill_step.jsonl").read_text().splitlines()]
    assert [(x["case"]["impl"], x["case"]["seqs"], x["case"]["new_tokens"]) for x in lines] == [
        ("torch-reference", 1, 24), ("torch-reference", 2, 8), ("kernels", 1, 24), ("kernels", 2, 8)]
    for x in lines:
        assert x["case"]["cached_tokens"] == 16 and x["case"]["expert_weights"] == "fp8"
        tokens = x["case"]["seqs"] * x["case"]["new_tokens"]
        assert x["metrics"]["tokens_per_s"] == pytest.approx(tokens / x["metrics"]["forward_ms"] * 1e3)
        assert x["metrics"]["host_issue_ms"] > 0 and x["metrics"]["batch_build_ms"] > 0
        assert x["metrics"]["host_share"] == pytest.approx(x["metrics"]["host_issue_ms"] / x["metrics"]["forward_ms"])
        assert "gpu_ms" not in x["metrics"]  # a GPU-only time needs a GPU (bench.timing.gpu_time)
    for ref, kern in zip(lines[:2], lines[2:]):
        assert kern["peers"]["torch-reference"]["forward_ms"] == ref["metrics"]["forward_ms"]
        assert kern["metrics"]["speedup_vs_reference"] == pytest.approx(ref["metrics"]["forward_ms"] / kern["metrics"]["forward_ms"])
