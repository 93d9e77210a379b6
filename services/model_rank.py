"""What the model-running ranks (a prefill TP rank, a decode DP rank) share.

The check of the instance's checkpoint before any rank starts, start-up of one rank
process (logging, device, environment, process group, the model runner), its
serve-drain-close lifecycle, and a request's sampling parameters in the runtime's
terms. Supervising the rank processes is services/ranks.py's job; this module
imports torch and the model runtime, which services/ranks.py, `moebus up` and the
control-plane services (services/common.py) do not import.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from kernels.ops import kernel_mode
from schemas.internal import Job, TopCandidates
from shared.logging import configure_logging, get_logger
from shared.model.config import ModelConfig
from shared.model.errors import ShardingError
from shared.model.kv_budget import DeviceMemory, pages_from_memory
from shared.model.layers import decode_attention_mode
from shared.model.model import Qwen3Model
from shared.model.runner import ModelRunner, StepOutput
from shared.model.sampling_params import SamplingParams
from shared.model.weights import SafetensorsCheckpoint, check_shardable
from shared.parallel import Topology, init_distributed
from shared.settings import DecodeSettings, PrefillSettings, ServiceSettings, SettingsError
from shared.tasks import cancel_and_wait, no_lost_cancel

log = get_logger(__name__)


def check_rank_checkpoint(settings: ServiceSettings) -> None:
    """The model ranks' `services.common.parse_settings` check: the checkpoint's config.json
    (`ConfigError`), its weight files' headers (`CheckpointError`) and whether tp/dp splits its heads
    and experts (`ShardingError`): a wrong setting stops the instance before any rank starts, not
    one rank deep inside its weight loading while the others wait at the rendezvous."""
    # The runtime switches of the model ranks (environment variables, not settings fields): a typo stops
    # the instance here on any device, not only once a CUDA rank reads the switch while building its model.
    try:
        kernel_mode()
        decode_attention_mode()
    except ValueError as e:
        raise SettingsError(str(e)) from None
    if settings.gpu_memory_utilization and (settings.device == "cpu" or (settings.device == "auto" and not torch.cuda.is_available())):
        raise SettingsError(f"gpu_memory_utilization={settings.gpu_memory_utilization:g} sizes the KV cache of a GPU rank, "
                            "but this instance runs on the CPU: set kv_pages instead")
    config = ModelConfig.from_dir(settings.model)
    SafetensorsCheckpoint(settings.model)  # the weight files exist and their headers read
    if isinstance(settings, PrefillSettings):
        field, topology = "tp", Topology.prefill(settings.tp, 0)
    elif isinstance(settings, DecodeSettings):
        field, topology = "dp", Topology.decode(settings.dp, 0)
    else:
        raise TypeError(f"{type(settings).__name__} is not the settings of a prefill or decode instance")
    try:
        check_shardable(config, topology.shard())
    except ShardingError as e:
        raise ShardingError(f"{field}={topology.world_size}: {e}") from e


def resolve_device(device: str, rank: int, gpus: Sequence[int] = ()) -> str:
    """"auto" -> the rank's GPU when CUDA is available, else "cpu"; "cuda" -> the rank's GPU:
    ``gpus[rank]`` when the instance lists its GPUs, else GPU ``rank`` (modulo the GPUs present).

    Listing GPUs, rather than hiding the others with CUDA_VISIBLE_DEVICES, keeps every GPU
    visible, which the same-host KV path (CUDA IPC into the decode GPU) needs.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{gpus[rank]}" if gpus else f"cuda:{rank % torch.cuda.device_count()}"
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """The compute and KV dtype of a rank on ``device``: "auto" is bfloat16 on a GPU, as vLLM's "auto" takes
    the checkpoint's (Qwen3's are bfloat16) and as the kernels need it, and float32 on the CPU, where
    the reference ops run (float32 was the default everywhere: a checkpoint served on GPUs without
    MOEBUS_DTYPE ran the reference ops, at a fraction of the kernels' speed)."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def prepare_rank_environment(device: str, world: int) -> None:
    """Settings every rank process needs before torch/UCX start."""
    if device == "cpu":
        # The ranks of a group share the host's cores; more threads than cores only thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # DESIGN §6: no NVLink multicast
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if device == "cpu":
        os.environ.setdefault("UCX_TLS", "tcp,self")  # no GPU transports to probe on a CPU host
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def start_model_rank(settings: PrefillSettings | DecodeSettings, topology: Topology, dist_port: int, **runner_options: Any) -> ModelRunner:
    """Set up this rank's process (logging, device, environment, process group) and load its model shard.

    `topology.layout` names the service ("prefill" or "decode"); `runner_options` go to
    `ModelRunner.from_dir` on top of the settings' KV cache, dtype and device.
    """
    rank, world = topology.rank, topology.world_size
    configure_logging(topology.layout, settings.log_level, settings.log_json, instance=settings.instance, rank=rank)
    device = resolve_device(settings.device, rank, settings.gpus)
    dtype = resolve_dtype(settings.dtype, device)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL object collectives use the current device
    prepare_rank_environment(device.split(":")[0], world)
    comm = init_distributed(topology, torch.device(device), master_port=dist_port) if world > 1 else None
    runner = ModelRunner.from_dir(
        settings.model,
        num_pages=_kv_pages(settings, torch.device(device), dtype),
        page_size=settings.page_size,
        dtype=dtype,
        device=device,
        topology=topology,
        comm=comm,
        **runner_options,
    )
    model = runner.model
    if model.moe_reference_reason is not None:
        # Kernels were asked for but the experts could not take them: slower, so say why once.
        log.warning("moe_reference_ops", reason=model.moe_reference_reason)
    # Which compute paths this rank runs (the GPU end-to-end test checks them here).
    log.info("model_loaded", device=device, dtype=str(dtype).removeprefix("torch."), kernels=model.kernels,
             moe_kernels=model.kernels and model.config.is_moe and model.moe_reference_reason is None,
             decode_moe=type(model.decode_moe).__name__ if model.decode_moe is not None else None,
             collectives=type(comm).__name__ if comm is not None else None,
             dense_dequantized_mib=round(model.dense_dequantized_bytes / 2**20, 1))
    return runner


def _kv_pages(settings: PrefillSettings | DecodeSettings, device: torch.device, dtype: torch.dtype) -> int | Callable[[Qwen3Model], int]:
    """The rank's KV pages: ``kv_pages``, or with ``gpu_memory_utilization`` what is left of that share of the GPU
    once the model is loaded (`shared.model.kv_budget`), profiled with the largest forward the rank runs."""
    utilization = settings.gpu_memory_utilization
    if not utilization:
        return settings.kv_pages
    baseline = DeviceMemory.measure(device, utilization)  # before the weights: what is not this rank's
    # The largest forward counted twice: a decode rank's CUDA graphs hold their own memory pool beside the eager steps;
    # a prefill batch may also gather a cached prefix's K/V (up to max_batch_context_tokens), which the profile's
    # fresh prompt does not. Prefill CUDA graphs add their pool (at most a forward of their largest bucket, which is
    # at most this one): three copies while the setting is on, also where the model turns out to allow none (on the CPU,
    # or with the reference ops).
    if isinstance(settings, DecodeSettings):
        lengths, copies = [1] * settings.max_batch, 2
    else:
        lengths, copies = [settings.max_batch_tokens], 3 if settings.cuda_graphs else 2
    return functools.partial(pages_from_memory, baseline=baseline, utilization=utilization, page_size=settings.page_size,
                             dtype=dtype, profile_lengths=lengths, activation_copies=copies)


def run_threads_on_device(device: torch.device) -> None:
    """Make the running loop's worker threads (`asyncio.to_thread`) start on the rank's GPU.

    The current CUDA device is per thread and a new thread starts on GPU 0, while the
    model steps, the group's collectives and the KV packing run off the event loop. Torch
    ops and the CuTeDSL kernels (`kernels._cute_runtime.launcher`) follow their
    tensors' device, but NCCL object collectives and anything else that uses the current
    device do not (before the kernels took their tensors' device, a rank placed on cuda:1
    hit cudaErrorIllegalAddress at its first kernel on 2x H200). Call before anything
    uses the default executor.
    """
    if device.type == "cuda":
        executor = ThreadPoolExecutor(thread_name_prefix=f"rank-{device}", initializer=torch.cuda.set_device, initargs=(device,))
        asyncio.get_running_loop().set_default_executor(executor)


class RankLoop(Protocol):
    """A rank's serving loop (DecodeRank, PrefillGroup)."""

    async def run(self) -> None: ...  # returns once every rank of the group has drained

    async def drain(self) -> None: ...

    async def close(self) -> None: ...


async def run_until_stopped(rank_loop: RankLoop, stop: asyncio.Event) -> None:
    """Run `rank_loop` until `stop` is set (SIGTERM/SIGINT) or its loop ends, then drain,
    wait for the loop to end (the whole group drained) and close it.

    The rank is closed (its heartbeats stopped, its KV receiver closed) however this ends: also when
    its loop raised (after the drain, which still says `draining` to the schedulers), when the drain
    raised, or when the caller is cancelled; a loop still running then is cancelled and waited for
    first. The error that ended it is what propagates, so the rank process still exits non-zero
    with it logged (should the close fail too, the close's error propagates with it as its context)."""
    loop = asyncio.get_running_loop().create_task(rank_loop.run())
    try:
        # `await loop` hands a cancel of ours to the loop, which may end without raising it.
        with no_lost_cancel():
            stopped = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait([loop, stopped], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()  # the loop ended on its own (or we are cancelled): nobody waits for a signal any more
            await rank_loop.drain()
            await loop
    finally:
        try:
            if not loop.done():  # the drain raised, or we were cancelled: the loop must not outlive its rank
                await cancel_and_wait(loop)
        finally:
            await rank_loop.close()


def sampling_params(job: Job) -> SamplingParams:
    """The runtime's sampling parameters for a request (the gateway resolved every default)."""
    return SamplingParams(
        temperature=job.sampling.temperature,
        top_k=job.sampling.top_k,
        top_p=job.sampling.top_p,
        seed=job.sampling.seed,
        logprobs=job.logprobs,
        max_tokens=job.max_tokens,
        stop_token_ids=tuple(job.stop_token_ids),
        presence_penalty=job.sampling.presence_penalty,
        frequency_penalty=job.sampling.frequency_penalty,
        repetition_penalty=job.sampling.repetition_penalty,
        top_logprobs=job.top_logprobs,
        ignore_eos=job.ignore_eos,
        prompt_logprobs=job.prompt_logprobs,
        min_p=job.sampling.min_p,
        logit_bias=job.sampling.logit_bias,
        min_tokens=job.sampling.min_tokens,
    )


def prompt_candidates(out: StepOutput) -> tuple[list[float] | None, list[TopCandidates] | None]:
    """A prefill step's prompt logprobs and alternatives as its `TokenBatch` carries them."""
    prompt = out.prompt_logprobs
    if prompt is None:
        return None, None
    return prompt.logprobs, None if prompt.top is None else [TopCandidates(t.token_ids, t.logprobs) for t in prompt.top]


def top_candidates(out: StepOutput) -> list[TopCandidates] | None:
    """A step's top alternatives as a `TokenBatch` of one token carries them (None when not asked)."""
    top = out.top_logprobs
    return None if top is None else [TopCandidates(top.token_ids, top.logprobs)]
