"""make-tiny and generate as a user runs them: CLI, full Qwen3 vocabulary, real tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from runtime_helpers import hf_model

from services.cli import main as moebus
from shared.model.tokenizer import Tokenizer

PROMPT = "Tell me a story about a dragon 🐉 and a 猫."


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_full")
    assert moebus(["make-tiny", "--out", str(out), "--seed", "3", "--max-shard-size", "20MB"]) == 0
    return out


def run_generate(capsys, model_dir, *args: str) -> dict:
    """`moebus generate --json` through the CLI dispatcher, in this process (CI time)."""
    capsys.readouterr()
    assert moebus(["generate", "--model", str(model_dir), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_make_tiny_writes_a_complete_hf_checkpoint(tiny_with_tokenizer):
    names = {p.name for p in tiny_with_tokenizer.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1
    gen = json.loads((tiny_with_tokenizer / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]


def test_generate_json_greedy_matches_transformers_and_is_varied(tiny_with_tokenizer, capsys):
    result = run_generate(capsys, tiny_with_tokenizer, "--prompt", PROMPT, "--chat", "--max-tokens", "32", "--temperature", "0")
    tok = Tokenizer.from_dir(tiny_with_tokenizer)
    prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]), add_special_tokens=False)
    hf = hf_model(tiny_with_tokenizer)
    ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False, top_k=None, top_p=None, temperature=None)
    assert result["token_ids"] == ref[0, len(prompt_ids) :].tolist()
    assert result["text"] == tok.decode(result["token_ids"], skip_special_tokens=True)
    assert result["finish_reason"] == ("stop" if result["token_ids"][-1] in (151645, 151643) else "length")
    assert len(set(result["token_ids"])) >= 16


def test_generate_seed_makes_sampling_reproducible(tiny_with_tokenizer, capsys):
    args = ("--prompt", "Hello", "--max-tokens", "12", "--temperature", "1.0")
    a = run_generate(capsys, tiny_with_tokenizer, *args, "--seed", "7")
    b = run_generate(capsys, tiny_with_tokenizer, *args, "--seed", "7")
    c = run_generate(capsys, tiny_with_tokenizer, *args, "--seed", "8")
    assert a == b and a["token_ids"] != c["token_ids"]


def test_generate_rejects_an_empty_prompt_in_a_real_process(tiny_with_tokenizer):
    proc = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--model", str(tiny_with_tokenizer), "--prompt", ""], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "prompt is empty" in proc.stderr
