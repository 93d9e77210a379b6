"""Qwen3-MoE (and dense Qwen3) forward over a batch of sequences with a paged KV cache.

One call handles any mix of prefill chunks (many new tokens per sequence, causal)
and decode steps (one or more new tokens per sequence): tokens of all sequences
are flattened into one ``[T]`` batch, each layer writes the new K/V into the
sequences' pages and attends over everything cached so far.

Communication goes through `shared.parallel.Collectives`: an all-reduce after
``o_proj`` and after dense MLPs under TP, and for MoE layers either a local
combine + all-reduce (prefill layout, inputs replicated) or an all-to-all
dispatch/combine (decode layout): the collectives' own `decode_moe` layer when
they offer one (CUDA: peer memory and masked grouped GEMMs), else
``ep_dispatch`` -> experts -> ``ep_combine``.

On CUDA (unless ``MOEBUS_KERNELS=reference``, see `kernels.ops`) the model runs the
kernels: the MoE experts are prepared once for the grouped GEMM, quantized weights
outside the experts are dequantized once (`dequantize_dense`), q/k/v run as one GEMM
(`fuse_qkv`) whose output one launch normalizes, rotates and stores into the KV pages,
each residual add runs fused with the RMSNorm after it (`kernels.norm_rope`), the
router's softmax with its top-k (`kernels.router`), and attention is
`layers.paged_attention_sdpa` (the paged decode-attention kernel for decode steps);
elsewhere it runs the torch reference ops of `shared.model.layers`.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.norm_rope import add_rms_norm, qk_norm_rope, qkv_norm_rope_store
from kernels.router import route_topk
from kernels.ops import use_kernels
from shared.kvcache import PagedKVCache
from shared.model import layers as ops
from shared.model.config import ModelConfig
from shared.model.quant_formats import BlockFp8Weight
from shared.model.weights import HeadSplit, LayerWeights, ModelWeights, MoEWeights, dequantize_dense, fuse_qkv, load_weights, prepare_for_kernels
from shared.parallel import Collectives, DecodeMoE, LocalCollectives, Topology


@dataclass(frozen=True)
class SequenceChunk:
    """New tokens of one sequence for this forward: they sit at positions ``start ..``."""

    token_ids: Sequence[int]
    start: int  # tokens of this sequence already in the cache
    page_table: Sequence[int]  # must cover start + len(token_ids) tokens


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_pages: torch.Tensor  # [T] page each new token's K/V goes to
    slot_offsets: torch.Tensor  # [T]
    last_token: torch.Tensor  # [B] flat index of each sequence's last new token
    attn: ops.AttentionMetadata

    @classmethod
    def build(cls, chunks: Sequence[SequenceChunk], page_size: int, device: torch.device) -> ForwardBatch:
        """The batch of ``chunks`` on ``device``: index tensors built with torch ops on the host and moved in
        one copy (per-token Python lists and one copy per tensor took 1.2 ms of host time at 2048 tokens)."""
        max_pages = 1
        for b, c in enumerate(chunks):
            n = len(c.token_ids)
            if n == 0:
                raise ValueError(f"sequence {b} of the batch has no new tokens")
            needed = -(-(c.start + n) // page_size)
            if len(c.page_table) < needed:
                raise ValueError(f"sequence {b}: page table has {len(c.page_table)} pages, {needed} needed for {c.start + n} tokens")
            max_pages = max(max_pages, needed)
        query_lens = [len(c.token_ids) for c in chunks]
        # Every table padded to max_pages with a valid id; attention masks the padding.
        tables = _longs(p for c in chunks for p in (*c.page_table[:max_pages], *[c.page_table[0]] * (max_pages - len(c.page_table))))
        tokens = _longs(t for c in chunks for t in c.token_ids)
        q_lens, starts = _longs(query_lens), _longs(c.start for c in chunks)
        first = torch.cumsum(q_lens, 0) - q_lens  # flat index of each sequence's first new token
        seq_of = torch.repeat_interleave(torch.arange(len(chunks)), q_lens)
        # (repeat_interleave rather than indexing by seq_of: a one-sequence CPU gather took 4 ms at 8192 tokens)
        idx_in_seq = torch.arange(tokens.numel()) - torch.repeat_interleave(first, q_lens)
        positions = torch.repeat_interleave(starts, q_lens) + idx_in_seq
        slot_pages = tables.view(len(chunks), max_pages)[seq_of, positions // page_size]
        host = [tokens, positions, slot_pages, positions % page_size, first + q_lens - 1, tables, starts + q_lens, q_lens,
                seq_of, idx_in_seq]
        (token_ids, positions, slot_pages, slot_offsets, last_token, flat_tables, context_lens, q_lens, token_seq,
         token_idx) = torch.cat(host).to(device).split([t.numel() for t in host])
        return cls(
            token_ids=token_ids,
            positions=positions,
            slot_pages=slot_pages,
            slot_offsets=slot_offsets,
            last_token=last_token,
            attn=ops.AttentionMetadata(
                page_tables=flat_tables.view(len(chunks), max_pages),
                context_lens=context_lens,
                query_lens=q_lens,
                token_seq=token_seq,
                token_idx=token_idx,
                max_q=max(query_lens, default=0),
                host_lens=tuple((len(c.token_ids), c.start + len(c.token_ids)) for c in chunks),
            ),
        )


def _longs(values: Iterable[int]) -> torch.Tensor:
    """An int64 CPU tensor of ``values`` through an array (`torch.tensor` of a list converts element by
    element: 1.1 ms for 8192 tokens, the array 0.19 ms)."""
    packed = array.array("q", values)
    return torch.frombuffer(packed, dtype=torch.long) if packed else torch.empty(0, dtype=torch.long)


LayerCallback = Callable[[int], None]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, head_dim]


class Qwen3Model:
    """One rank's shard of the model: weights plus the forward pass.

    ``kernels`` chooses the kernel ops or the torch reference ops; None (the
    default) follows `kernels.ops.use_kernels` for the weights' device. With
    kernels, the MoE weights are converted in place to the grouped-GEMM layout
    (the model owns ``weights``); experts the kernels cannot take (fp32, odd
    shapes) keep the reference ops and ``moe_reference_reason`` says why.
    Attention uses SDPA for bf16/fp16 models.

    ``max_tokens_per_rank`` (decode layout): the most tokens one forward passes on a
    rank; with it, kernel experts take the collectives' `decode_moe` layer, whose
    buffers are sized for it now (before any CUDA-graph capture).
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, topology: Topology = Topology.single(), comm: Collectives | None = None, kernels: bool | None = None, max_tokens_per_rank: int | None = None) -> None:
        self.config, self.weights, self.topology = config, weights, topology
        self.comm = comm if comm is not None else LocalCollectives()
        shard = topology.shard()
        self.heads = HeadSplit.for_rank(config, shard)
        self.experts_per_rank = config.num_experts // shard.ep_size if config.is_moe else 0
        self.dtype = weights.embed.dtype
        self.device = weights.embed.device
        self.kernels = use_kernels(self.device) if kernels is None else kernels
        # fp32 models (the parity configuration) keep the fp32 reference attention everywhere.
        fused_attention = self.kernels and self.dtype in (torch.bfloat16, torch.float16)
        self._attend = ops.paged_attention_sdpa if fused_attention else ops.paged_attention
        # Why the MoE experts run the reference ops although kernels were asked for (None when
        # they run the kernels or were not asked to); the service start-up logs it.
        self.moe_reference_reason = prepare_for_kernels(weights) if self.kernels and config.is_moe else None
        # Bytes the quantized weights outside the experts grew by when made plain (kernels only:
        # the reference path keeps dequantizing per call, as the checkpoint stores them).
        self.dense_dequantized_bytes = dequantize_dense(weights) if self.kernels else 0
        if self.kernels:
            fuse_qkv(weights)
        self.decode_moe = self._make_decode_moe(max_tokens_per_rank)

    def _make_decode_moe(self, max_tokens_per_rank: int | None) -> DecodeMoE | None:
        """The collectives' decode MoE layer, where the layout and the experts allow one."""
        c, topo = self.config, self.topology
        experts_on_kernels = self.kernels and c.is_moe and self.moe_reference_reason is None
        if not (max_tokens_per_rank and experts_on_kernels and topo.layout == "decode" and topo.ep_size > 1):
            return None
        fp8 = any(isinstance(layer.mlp, MoEWeights) and isinstance(layer.mlp.w2, BlockFp8Weight) for layer in self.weights.layers)
        return self.comm.decode_moe(c.num_experts, c.hidden_size, c.top_k, c.moe_intermediate_size, max_tokens_per_rank, fp8)

    @classmethod
    def load(cls, model_dir: str | Path, topology: Topology = Topology.single(), comm: Collectives | None = None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", kernels: bool | None = None, max_tokens_per_rank: int | None = None) -> Qwen3Model:
        config = ModelConfig.from_dir(model_dir)
        weights = load_weights(model_dir, config, topology.shard(), dtype, device)
        return cls(config, weights, topology, comm, kernels, max_tokens_per_rank)

    @property
    def local_kv_heads(self) -> int:
        return self.heads.num_kv

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache, on_layer_done: LayerCallback | None = None, all_logits: bool = False) -> torch.Tensor:
        """Logits ``[B, V]`` at each sequence's last new token (``[T, V]`` with ``all_logits``);
        ``on_layer_done`` as in `hidden_states`."""
        x = self.hidden_states(batch, cache, on_layer_done)
        return self.logits(x if all_logits else x[batch.last_token])

    @torch.inference_mode()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """lm_head over final hidden states ``[N, H]``."""
        return F.linear(x, self.weights.lm_head)

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, cache: PagedKVCache, on_layer_done: LayerCallback | None = None) -> torch.Tensor:
        """Every row's final (normed) hidden state ``[T, H]``: what lm_head reads.

        ``on_layer_done(i)`` is called once layer ``i`` (its K/V write included) has been
        issued. On CUDA that means enqueued on the current stream, not finished: a KV
        sender records an event on the stream there and waits on it before reading pages.

        The layer is split where `shared.model.prefill_graphs` splits it (its pieces are
        captured as CUDA graphs, attention runs eagerly between them): `embed`, then per layer
        `attention_input`, `attend` and `layer_output`. Those run under the caller's inference
        mode (this method's, or `PrefillGraphs.hidden_states`'): entering it costs ~2.5 us of
        host time a call, four calls a layer.
        """
        h, x, rope = self.embed(batch.token_ids, batch.positions)
        for i in range(len(self.weights.layers)):
            q = self.attention_input(i, x, rope, cache, batch.slot_pages, batch.slot_offsets)
            h, x = self.layer_output(i, h, self.attend(i, q, cache, batch.attn))
            if on_layer_done is not None:
                on_layer_done(i)
        return x

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Rope]:
        """The residual stream ``h`` of the tokens, its normed copy ``x`` (the first layer's input), and the
        RoPE angles of their positions."""
        c, layers = self.config, self.weights.layers
        h = F.embedding(token_ids, self.weights.embed)
        rope = ops.rope_cos_sin(positions, c.head_dim, c.rope_theta, self.dtype)
        # The residual stream h and its normed copy x: each residual add is fused with the
        # norm after it (the next layer's input norm, or the final norm after the last).
        h, x = self._add_norm(h, None, layers[0].input_norm if layers else self.weights.final_norm)
        return h, x, rope

    def attention_input(self, layer_idx: int, x: torch.Tensor, rope: Rope, cache: PagedKVCache, slot_pages: torch.Tensor,
                        slot_offsets: torch.Tensor, q_out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``layer_idx``'s queries ``[T, Hq, D]`` (into ``q_out`` when given) from its normed input ``x``;
        its keys and values go into the cache at the tokens' slots."""
        c, t, d, w = self.config, x.shape[0], self.config.head_dim, self.weights.layers[layer_idx].attn
        cos, sin = rope
        if w.qkv_proj is not None:  # kernel path: one GEMM, one launch for norms, RoPE and the K/V store
            return qkv_norm_rope_store(ops.linear(x, w.qkv_proj), self.heads.num_q, self.heads.num_kv, w.q_norm, w.k_norm, cos,
                                       sin, c.rms_norm_eps, cache.pools[layer_idx], slot_pages, slot_offsets, q_out=q_out)
        q = qk_norm_rope(ops.linear(x, w.q_proj).view(t, self.heads.num_q, d), w.q_norm, cos, sin, c.rms_norm_eps, use_kernel=self.kernels)
        k = qk_norm_rope(ops.linear(x, w.k_proj).view(t, self.heads.num_kv, d), w.k_norm, cos, sin, c.rms_norm_eps, use_kernel=self.kernels)
        v = ops.linear(x, w.v_proj).view(t, self.heads.num_kv, d)
        cache.write(layer_idx, slot_pages, slot_offsets, k, v)
        return q if q_out is None else q_out.copy_(q)

    def attend(self, layer_idx: int, q: torch.Tensor, cache: PagedKVCache, meta: ops.AttentionMetadata) -> torch.Tensor:
        """Attention of the queries ``q [T, Hq, D]`` over the cached keys: ``[T, Hq, D]``."""
        return self._attend(q, cache, layer_idx, meta, self.config.head_dim**-0.5)

    def layer_output(self, layer_idx: int, h: torch.Tensor, attn_out: torch.Tensor, padded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of layer ``layer_idx`` after attention: o_proj, the MLP and the residual adds; the new
        residual stream and its normed copy (the next layer's input, or the final hidden state).
        ``padded`` ([T] bool) marks rows that are padding: the experts skip them."""
        layers, t = self.weights.layers, h.shape[0]
        layer = layers[layer_idx]
        out = ops.linear(attn_out.reshape(t, self.heads.num_q * self.config.head_dim), layer.attn.o_proj)
        out = self.comm.all_reduce(out) if self.topology.tp_size > 1 else out
        h, x = self._add_norm(h, out, layer.post_attention_norm)
        following = layers[layer_idx + 1].input_norm if layer_idx + 1 < len(layers) else self.weights.final_norm
        return self._add_norm(h, self._mlp(layer, x, padded), following)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(h, delta, weight, self.config.rms_norm_eps, use_kernel=self.kernels)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor, padded: torch.Tensor | None) -> torch.Tensor:
        w = layer.mlp
        if not isinstance(w, MoEWeights):
            out = ops.dense_mlp(x, w.w13, w.w2)
            return self.comm.all_reduce(out) if self.topology.tp_size > 1 else out
        weights, ids = route_topk(F.linear(x, w.router), self.config.top_k, self.config.norm_topk_prob, use_kernel=self.kernels)
        if padded is not None:  # no expert's id: the grouped GEMM never sees these rows, which all share one route
            ids = ids.masked_fill(padded[:, None], -1)
        if self.topology.ep_size == 1:
            return ops.moe_experts(x, w.w13, w.w2, ids, weights, w.expert_start)
        if self.topology.inputs_replicated:
            return self.comm.all_reduce(ops.moe_experts(x, w.w13, w.w2, ids, weights, w.expert_start))
        if self.decode_moe is not None:
            return self.decode_moe(x, ids, weights, w)
        sent = self.comm.ep_dispatch(x, ids, weights, self.experts_per_rank)
        y = ops.moe_experts(sent.x, w.w13, w.w2, sent.topk_ids, sent.topk_weights, w.expert_start)
        return self.comm.ep_combine(y, sent)
