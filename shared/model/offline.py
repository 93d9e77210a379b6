"""`moebus generate`: one prompt through a checkpoint in this process (no services).

Streams the text as it is generated, or with ``--json`` prints one object
``{"token_ids", "text", "finish_reason"}`` (the generated ids, their text with
special tokens skipped, and "stop" or "length"). Sampling defaults come from the
checkpoint's ``generation_config.json`` unless ``--temperature`` /
``--top-k`` / ``--top-p`` are given; ``--temperature 0`` is greedy.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

import torch

from shared.kvcache import KVCacheError
from shared.model.config import GenerationConfig
from shared.model.errors import ModelError
from shared.model.runner import ModelRunner
from shared.model.sampling_params import InvalidSamplingParams, SamplingParams
from shared.model.tiny import DTYPES
from shared.model.tokenizer import Tokenizer, TokenizerError

PAGE_SIZE = 16


def generate(model_dir: str, prompt: str, *, chat: bool, params: SamplingParams, dtype: torch.dtype, device: str,
             stream: TextIO | None = None) -> dict[str, Any]:
    """Generate for ``prompt``; writes text pieces to ``stream`` as they complete, if given."""
    tokenizer = Tokenizer.from_dir(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    num_pages = -(-(len(prompt_ids) + params.max_tokens) // PAGE_SIZE)
    runner = ModelRunner.from_dir(model_dir, num_pages=num_pages, page_size=PAGE_SIZE, dtype=dtype, device=device)
    detok = tokenizer.detokenizer(skip_special_tokens=True)
    seq = runner.add("offline", prompt_ids, params)
    runner.prefill([seq])
    while True:
        piece = detok.add(seq.token_ids[-1])
        if stream is not None and piece:
            stream.write(piece)
            stream.flush()
        if seq.finished:
            break
        runner.decode([seq])
    tail = detok.flush()
    if stream is not None and tail:
        stream.write(tail)
    return {"token_ids": seq.output_ids, "text": detok.text, "finish_reason": seq.finish_reason}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="moebus generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (HF format)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn with the chat template")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=None, help="0 = greedy; default from generation_config.json")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    a = ap.parse_args(argv)
    try:
        gen = GenerationConfig.from_dir(a.model)
        default_temp = gen.temperature if gen.do_sample else 0.0
        params = SamplingParams(
            temperature=default_temp if a.temperature is None else a.temperature,
            top_k=gen.top_k if a.top_k is None else a.top_k,
            top_p=gen.top_p if a.top_p is None else a.top_p,
            seed=a.seed,
            max_tokens=a.max_tokens,
        )
        result = generate(a.model, a.prompt, chat=a.chat, params=params, dtype=DTYPES[a.dtype], device=a.device, stream=None if a.json else sys.stdout)
    except (ModelError, TokenizerError, InvalidSamplingParams, KVCacheError, ValueError) as e:
        print(f"moebus generate: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(f"\n[finish_reason={result['finish_reason']}]", file=sys.stderr)
    return 0
