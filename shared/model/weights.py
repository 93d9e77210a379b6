"""Loading a Hugging Face safetensors checkpoint, each rank reading only its slice.

Files are memory-mapped (``safe_open``) and every tensor is read through
``get_slice``, so a rank touches only the bytes of its shard:

* TP (prefill layout) splits ``q_proj``/``o_proj`` by attention head and
  ``k_proj``/``v_proj`` by KV head; when TP exceeds the KV heads, rank ``r``
  holds KV head ``r * num_kv_heads // tp`` (each head replicated on
  ``tp / num_kv_heads`` ranks). Dense MLPs split their intermediate dimension.
* EP gives each rank a contiguous expert range, fused at load into
  ``w13 [E_local, 2I, H]`` (gate rows then up rows) and ``w2 [E_local, H, I]``.
* FP8 checkpoints keep E4M3 weights and their ``weight_scale_inv`` blocks as a
  `BlockFp8Weight`; a TP split must fall on block boundaries. Gate and up rows that
  end inside a row block are fused on a finer row block (`_with_row_block`).
* MXFP8 checkpoints keep E4M3 weights and their ``weight_scale_e8m0`` exponents
  (one per 32 values of K) as an `Mxfp8Weight`; rows split freely, a TP split of
  K must fall on 32-value boundaries.

`prepare_for_kernels` then puts the expert weights into the grouped-GEMM kernels'
layout (gate/up rows interleaved with their FP8 block scales or MXFP8 exponents,
`FusedGateUp`), once, when a model runs them, and `dequantize_dense` turns the
quantized weights outside the experts (attention projections, dense MLPs) into
plain weights of the activation dtype, so no step dequantizes them again.

Router, norms, embeddings and ``lm_head`` are replicated on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.grouped_gemm import interleave_gate_up
from kernels.grouped_gemm_mxfp8 import interleave_gate_up_mxfp8, kernel_scale_layout
from kernels.moe import grouped_moe_unsupported
from shared.model.config import Fp8Quantization, ModelConfig, Mxfp8Quantization
from shared.model.errors import CheckpointError, MissingTensor, ShapeMismatch, ShardingError
from shared.model.quant_formats import BlockFp8Weight, Mxfp8Weight
from shared.parallel import ShardSpec

Linear = torch.Tensor | BlockFp8Weight | Mxfp8Weight  # a [N, K] (or [E, N, K]) weight: plain, FP8 block-scaled or MXFP8


@dataclass(frozen=True)
class FusedGateUp:
    """Experts' gate/up weights in the layout of the fused SwiGLU grouped GEMM.

    Made once by `prepare_for_kernels` from ``w13 [E, 2I, H]`` (gate rows then up
    rows) with `kernels.grouped_gemm.interleave_gate_up`: rows interleaved in
    64-row gate/up blocks; FP8 block-scaled weights get one fp32 scale per 64-row
    half block, MXFP8 weights keep their per-row E8M0 exponents, moved with their
    rows (`kernels.grouped_gemm_mxfp8.interleave_gate_up_mxfp8`).
    """

    weight: torch.Tensor  # [E, 2I, H], bfloat16 or float8_e4m3fn
    scale: torch.Tensor | None  # [E, 2I/64, ceil(H/128)] fp32 for FP8 block-scaled weights, else None
    scale_e8m0: torch.Tensor | None = None  # [E, 2I, ceil(H/32)] uint8 for MXFP8 weights, else None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


@dataclass
class AttentionWeights:
    q_proj: Linear  # [local_heads * D, H]
    k_proj: Linear  # [local_kv_heads * D, H]
    v_proj: Linear
    o_proj: Linear  # [H, local_heads * D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor
    # q, k and v stacked for one GEMM (`fuse_qkv`, kernel path); q/k/v_proj are then views of it.
    qkv_proj: torch.Tensor | None = None


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, H], all experts (routing is computed everywhere)
    w13: Linear | FusedGateUp  # [E_local, 2I, H]; FusedGateUp once prepared for the kernels
    w2: Linear  # [E_local, H, I]
    expert_start: int  # global id of local expert 0

    @property
    def num_local_experts(self) -> int:
        return self.w13.shape[0]


@dataclass
class DenseMLPWeights:
    w13: Linear  # [2 * I_local, H]
    w2: Linear  # [H, I_local]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    attn: AttentionWeights
    mlp: MoEWeights | DenseMLPWeights


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [V, H]; the embedding itself when tied


@dataclass(frozen=True)
class HeadSplit:
    """Attention heads a TP rank owns: q heads ``[q_start, q_start+num_q)``, KV likewise."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int

    @classmethod
    def for_rank(cls, config: ModelConfig, shard: ShardSpec) -> HeadSplit:
        q, kv, tp, r = config.num_heads, config.num_kv_heads, shard.tp_size, shard.tp_rank
        if q % tp:
            raise ShardingError(f"num_attention_heads={q} is not divisible by TP={tp}")
        if tp <= kv:
            if kv % tp:
                raise ShardingError(f"num_key_value_heads={kv} is not divisible by TP={tp}")
            return cls(r * q // tp, q // tp, r * kv // tp, kv // tp)
        if tp % kv:
            raise ShardingError(f"TP={tp} exceeds num_key_value_heads={kv} but is not a multiple of it")
        return cls(r * q // tp, q // tp, r * kv // tp, 1)


def expert_range(config: ModelConfig, shard: ShardSpec) -> tuple[int, int]:
    """``[start, stop)`` of the experts rank ``shard.ep_rank`` owns."""
    e, ep = config.num_experts, shard.ep_size
    if e % ep:
        raise ShardingError(f"num_experts={e} is not divisible by EP={ep}")
    per = e // ep
    return shard.ep_rank * per, (shard.ep_rank + 1) * per


def check_shardable(config: ModelConfig, shard: ShardSpec) -> None:
    """Raise `ShardingError` when the attention heads or the experts cannot be split as ``shard``
    says, before any weight is read (the split is the same test on every rank)."""
    HeadSplit.for_rank(config, shard)
    expert_range(config, shard)


class SafetensorsCheckpoint:
    """Tensor-level, memory-mapped access to ``model.safetensors`` or a sharded index."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self._handles: dict[str, object] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"cannot read the weight_map of the index: {e}", file=str(index)) from None
            self._file_of: dict[str, str] = dict(weight_map)
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if len(files) != 1:
                raise CheckpointError(
                    f"expected model.safetensors.index.json or exactly one *.safetensors file, found {len(files)}",
                    file=str(self.dir),
                )
            self._file_of = {name: files[0].name for name in self._open(files[0].name).keys()}

    def _open(self, file: str):
        handle = self._handles.get(file)
        if handle is None:
            path = self.dir / file
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error type for corrupt headers
                raise CheckpointError(f"cannot open safetensors file: {e}", file=str(path)) from None
            self._handles[file] = handle
        return handle

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _slice(self, name: str):
        if name not in self._file_of:
            raise MissingTensor("tensor not found in checkpoint", file=str(self.dir), tensor=name)
        file = self._file_of[name]
        try:
            return self._open(file).get_slice(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise MissingTensor(f"listed in the index but not readable: {e}", file=str(self.dir / file), tensor=name) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, expected_shape: tuple[int, ...], rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        """Read ``name[rows, cols]`` (the dims a 1-D tensor lacks are ignored) after checking its full shape."""
        sl = self._slice(name)
        shape = tuple(sl.get_shape())
        if shape != tuple(expected_shape):
            raise ShapeMismatch(
                f"shape {list(shape)} does not match {list(expected_shape)} implied by config.json",
                file=str(self.dir / self._file_of[name]),
                tensor=name,
            )
        try:
            if len(shape) == 1:
                return sl[rows]
            return sl[rows, cols]
        except Exception as e:
            raise CheckpointError(f"cannot read tensor data: {e}", file=str(self.dir / self._file_of[name]), tensor=name) from None


class WeightLoader:
    """Reads one rank's `ModelWeights` from a checkpoint for a given `ShardSpec`."""

    def __init__(self, model_dir: str | Path, config: ModelConfig, shard: ShardSpec, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.ckpt = SafetensorsCheckpoint(model_dir)
        self.config, self.shard, self.dtype, self.device = config, shard, dtype, torch.device(device)
        self.heads = HeadSplit.for_rank(config, shard)

    def load(self) -> ModelWeights:
        c = self.config
        embed = self._dense("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        if c.tie_word_embeddings:
            lm_head = embed
        else:
            lm_head = self._dense("lm_head.weight", (c.vocab_size, c.hidden_size))
        layers = [self._layer(i) for i in range(c.num_layers)]
        return ModelWeights(embed, layers, self._dense("model.norm.weight", (c.hidden_size,)), lm_head)

    # ------------------------------------------------------------------ layers

    def _layer(self, i: int) -> LayerWeights:
        p, h = f"model.layers.{i}.", self.config.hidden_size
        mlp = self._moe(p + "mlp.") if self.config.moe_layers[i] else self._dense_mlp(p + "mlp.")
        return LayerWeights(
            input_norm=self._dense(p + "input_layernorm.weight", (h,)),
            post_attention_norm=self._dense(p + "post_attention_layernorm.weight", (h,)),
            attn=self._attention(p + "self_attn."),
            mlp=mlp,
        )

    def _attention(self, p: str) -> AttentionWeights:
        c, hs, d = self.config, self.heads, self.config.head_dim
        q_rows = slice(hs.q_start * d, (hs.q_start + hs.num_q) * d)
        kv_rows = slice(hs.kv_start * d, (hs.kv_start + hs.num_kv) * d)
        q_shape, kv_shape = (c.num_heads * d, c.hidden_size), (c.num_kv_heads * d, c.hidden_size)
        return AttentionWeights(
            q_proj=self._linear(p + "q_proj.weight", q_shape, rows=q_rows),
            k_proj=self._linear(p + "k_proj.weight", kv_shape, rows=kv_rows),
            v_proj=self._linear(p + "v_proj.weight", kv_shape, rows=kv_rows),
            o_proj=self._linear(p + "o_proj.weight", (c.hidden_size, c.num_heads * d), cols=q_rows),
            q_norm=self._dense(p + "q_norm.weight", (d,)),
            k_norm=self._dense(p + "k_norm.weight", (d,)),
        )

    def _dense_mlp(self, p: str) -> DenseMLPWeights:
        c, tp, r = self.config, self.shard.tp_size, self.shard.tp_rank
        inter = c.intermediate_size
        if inter % tp:
            raise ShardingError(f"intermediate_size={inter} is not divisible by TP={tp}")
        part = slice(r * inter // tp, (r + 1) * inter // tp)
        gate = self._linear(p + "gate_proj.weight", (inter, c.hidden_size), rows=part)
        up = self._linear(p + "up_proj.weight", (inter, c.hidden_size), rows=part)
        down = self._linear(p + "down_proj.weight", (c.hidden_size, inter), cols=part)
        return DenseMLPWeights(w13=_concat([gate, up], dim=0, what=p + "{gate,up}_proj"), w2=down)

    def _moe(self, p: str) -> MoEWeights:
        c = self.config
        start, stop = expert_range(c, self.shard)
        i, h = c.moe_intermediate_size, c.hidden_size
        w13, w2 = [], []
        for e in range(start, stop):
            ep = f"{p}experts.{e}."
            gate = self._linear(ep + "gate_proj.weight", (i, h))
            up = self._linear(ep + "up_proj.weight", (i, h))
            w13.append(_concat([gate, up], dim=0, what=ep + "{gate,up}_proj"))
            w2.append(self._linear(ep + "down_proj.weight", (h, i)))
        return MoEWeights(
            router=self._dense(p + "gate.weight", (c.num_experts, h)),
            w13=_stack(w13),
            w2=_stack(w2),
            expert_start=start,
        )

    # ------------------------------------------------------------------ tensors

    def _dense(self, name: str, shape: tuple[int, ...], rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        return self.ckpt.read(name, shape, rows, cols).to(device=self.device, dtype=self.dtype)

    def _linear(self, name: str, shape: tuple[int, int], rows: slice = slice(None), cols: slice = slice(None)) -> Linear:
        """A projection weight: plain, or E4M3 + scales when the checkpoint stores them next to it."""
        q = self.config.quantization
        if isinstance(q, Fp8Quantization) and name + "_scale_inv" in self.ckpt:
            return self._block_fp8(name, shape, rows, cols, q.block)
        if isinstance(q, Mxfp8Quantization) and name + "_scale_e8m0" in self.ckpt:
            return self._mxfp8(name, shape, rows, cols, q.block_size)
        return self._dense(name, shape, rows, cols)

    def _block_fp8(self, name: str, shape: tuple[int, int], rows: slice, cols: slice, block: tuple[int, int]) -> BlockFp8Weight:
        bn, bk = block
        srows = _block_slice(rows, shape[0], bn, name, "rows", "FP8")
        scols = _block_slice(cols, shape[1], bk, name, "columns", "FP8")
        weight = self._e4m3(name, shape, rows, cols, "weight_scale_inv")
        scale_shape = (-(-shape[0] // bn), -(-shape[1] // bk))
        scale = self.ckpt.read(name + "_scale_inv", scale_shape, srows, scols).float()
        return BlockFp8Weight(weight.to(self.device), scale.to(self.device), block)

    def _mxfp8(self, name: str, shape: tuple[int, int], rows: slice, cols: slice, block_size: int) -> Mxfp8Weight:
        # One scale per row and 32 values of K: the scale rows are the weight rows.
        scols = _block_slice(cols, shape[1], block_size, name, "columns", "MXFP8")
        weight = self._e4m3(name, shape, rows, cols, "weight_scale_e8m0")
        scale_name = name + "_scale_e8m0"
        scale = self.ckpt.read(scale_name, (shape[0], -(-shape[1] // block_size)), rows, scols)
        if scale.dtype != torch.uint8:
            raise CheckpointError(f"dtype {scale.dtype}, expected uint8 (E8M0 exponents)", file=str(self.ckpt.dir), tensor=scale_name)
        return Mxfp8Weight(weight.to(self.device), scale.to(self.device), block_size)

    def _e4m3(self, name: str, shape: tuple[int, int], rows: slice, cols: slice, scale_suffix: str) -> torch.Tensor:
        weight = self.ckpt.read(name, shape, rows, cols)
        if weight.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"has {scale_suffix} but dtype {weight.dtype}, expected float8_e4m3fn", file=str(self.ckpt.dir), tensor=name)
        return weight


def _block_slice(part: slice, size: int, block: int, name: str, what: str, fmt: str) -> slice:
    """The scale-block range covering ``part`` of a dimension; ``part`` must start and end on block edges."""
    start, stop = part.start or 0, size if part.stop is None else part.stop
    if start % block or (stop % block and stop != size):
        raise ShardingError(
            f"{name}: the shard's {what} [{start}, {stop}) do not fall on {fmt} {block}-blocks; "
            "choose a TP size that splits heads/intermediate on block boundaries"
        )
    return slice(start // block, -(-stop // block))


def _concat(parts: list[Linear], dim: int, what: str) -> Linear:
    """Fuse projections along ``dim`` (0: output rows), scales alongside."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=dim)
    if isinstance(parts[0], Mxfp8Weight):
        # Rows carry their own scales; along K every part but the last must end on a 32-block.
        if dim in (-1, parts[0].weight.dim() - 1) and any(p.weight.shape[-1] % p.block_size for p in parts[:-1]):
            raise ShardingError(f"{what}: cannot fuse MXFP8 weights along K off {parts[0].block_size}-value blocks")
        return Mxfp8Weight(torch.cat([p.weight for p in parts], dim), torch.cat([p.scale_e8m0 for p in parts], dim), parts[0].block_size)
    block = parts[0].block
    if dim == 0 and any(p.weight.shape[0] % block[0] for p in parts):
        # Parts that end inside a row block (gate/up of a moe_intermediate_size below 128, as the demo
        # model's 32) are fused on the finest row block that all of them fill; vLLM refuses such
        # checkpoints. The experts then differ in block from w2 and run the reference ops.
        rows = math.gcd(block[0], *(p.weight.shape[0] for p in parts))
        parts = [_with_row_block(p, rows) for p in parts]
        block = parts[0].block
    for p in parts:
        if p.weight.shape[dim] % block[dim]:
            raise ShardingError(f"{what}: cannot fuse FP8 weights whose size {p.weight.shape[dim]} is not a multiple of the {block[dim]}-block")
    return BlockFp8Weight(torch.cat([p.weight for p in parts], dim), torch.cat([p.scale_inv for p in parts], dim), block)


def _with_row_block(w: BlockFp8Weight, rows: int) -> BlockFp8Weight:
    """The same weight with scales per ``rows`` rows (a divisor of its row block): each scale
    repeated over the finer blocks it covered, so every value dequantizes as before."""
    scale = w.scale_inv.repeat_interleave(w.block[0] // rows, dim=-2)[..., : -(-w.weight.shape[-2] // rows), :]
    return BlockFp8Weight(w.weight, scale, (rows, w.block[1]))


def _stack(parts: list[Linear]) -> Linear:
    if isinstance(parts[0], torch.Tensor):
        return torch.stack(parts)
    if isinstance(parts[0], Mxfp8Weight):
        return Mxfp8Weight(torch.stack([p.weight for p in parts]), torch.stack([p.scale_e8m0 for p in parts]), parts[0].block_size)
    return BlockFp8Weight(torch.stack([p.weight for p in parts]), torch.stack([p.scale_inv for p in parts]), parts[0].block)


def load_weights(model_dir: str | Path, config: ModelConfig, shard: ShardSpec = ShardSpec(), dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> ModelWeights:
    """One rank's weights; see the module docstring for how each tensor is split."""
    return WeightLoader(model_dir, config, shard, dtype, device).load()


def prepare_for_kernels(weights: ModelWeights) -> str | None:
    """Put every MoE layer's ``w13`` into the grouped-GEMM layout, in place.

    In place so that each layer's plain ``w13`` is released as soon as its
    interleaved copy exists (peak memory: one layer more, not a second copy of the
    experts). Returns None when done, or, leaving the weights untouched, why the
    kernels cannot take these experts (dtype, FP8 or MXFP8 block, shapes); the model then
    runs the reference ops for them.
    """
    # Indices only: holding the layers' MoEWeights here would keep every plain w13 alive.
    todo = [i for i, layer in enumerate(weights.layers)
            if isinstance(layer.mlp, MoEWeights) and not isinstance(layer.mlp.w13, FusedGateUp)]
    for i in todo:
        reason = _unsupported(weights.embed.dtype, weights.layers[i].mlp)
        if reason is not None:
            return reason
    for i in todo:
        m = weights.layers[i].mlp
        if isinstance(m.w13, BlockFp8Weight):
            fused = FusedGateUp(*interleave_gate_up(m.w13.weight, m.w13.scale_inv.float()))
        elif isinstance(m.w13, Mxfp8Weight):
            weight, scale_e8m0 = interleave_gate_up_mxfp8(m.w13.weight, m.w13.scale_e8m0)
            fused = FusedGateUp(weight, None, kernel_scale_layout(scale_e8m0))
            # The kernel's TMA reads scale rows 16 bytes apart: held so, no call copies them (K = I = 768: 24 bytes).
            m = dataclasses.replace(m, w2=dataclasses.replace(m.w2, scale_e8m0=kernel_scale_layout(m.w2.scale_e8m0)))
        else:
            fused = FusedGateUp(*interleave_gate_up(m.w13))
        weights.layers[i] = dataclasses.replace(weights.layers[i], mlp=dataclasses.replace(m, w13=fused))
    return None


def dequantize_dense(weights: ModelWeights) -> int:
    """Replace every FP8 block-scaled or MXFP8 weight outside the experts by its
    dequantized copy in the activation dtype, in place; returns the bytes this adds.

    The reference `linear` dequantizes such a weight on every call: per step that reads
    the FP8 bytes, writes and reads back twice as many, 5 bytes per parameter where a
    plain bf16 weight costs 2 (at decode, where these projections are replicated on
    every rank, that is most of a step's bytes outside the experts). The result is
    the same to the bit: the values are the ones `linear` would have made. The price
    is memory: these weights take twice their FP8 size (Qwen3-235B-A22B: ~6.7e9
    parameters outside the experts, ~13 GB in bf16). Layer by layer, so the peak is
    one layer's copy.
    """
    dtype = weights.embed.dtype
    added = 0

    def plain(w: Linear) -> Linear:
        nonlocal added
        if not isinstance(w, (BlockFp8Weight, Mxfp8Weight)):
            return w
        dense = w.dequantize(dtype)
        added += dense.numel() * dense.element_size() - w.weight.numel() * w.weight.element_size()
        return dense

    for i, layer in enumerate(weights.layers):
        a = layer.attn
        attn = dataclasses.replace(a, q_proj=plain(a.q_proj), k_proj=plain(a.k_proj), v_proj=plain(a.v_proj), o_proj=plain(a.o_proj))
        mlp = layer.mlp
        if isinstance(mlp, DenseMLPWeights):
            mlp = dataclasses.replace(mlp, w13=plain(mlp.w13), w2=plain(mlp.w2))
        weights.layers[i] = dataclasses.replace(layer, attn=attn, mlp=mlp)
    return added


def fuse_qkv(weights: ModelWeights) -> None:
    """Stack every layer's q, k and v projections into one weight, in place: attention then
    runs one GEMM where it ran three (at decode, each a few microseconds on a small batch),
    and `kernels.norm_rope.qkv_norm_rope_store` takes its output apart. ``q_proj`` /
    ``k_proj`` / ``v_proj`` become row slices of ``qkv_proj`` (views: no memory added).
    Plain weights of one dtype only (quantized ones are made plain first by
    `dequantize_dense`); layers already fused are left as they are."""
    for i, layer in enumerate(weights.layers):
        a = layer.attn
        projs = (a.q_proj, a.k_proj, a.v_proj)
        if a.qkv_proj is not None or not all(isinstance(w, torch.Tensor) for w in projs) or len({(w.dtype, w.device) for w in projs}) > 1:
            continue
        qkv = torch.cat(projs)
        q, k, v = qkv.split([w.shape[0] for w in projs])
        weights.layers[i] = dataclasses.replace(layer, attn=dataclasses.replace(a, q_proj=q, k_proj=k, v_proj=v, qkv_proj=qkv))


def _unsupported(act_dtype: torch.dtype, m: MoEWeights) -> str | None:
    if type(m.w13) is not type(m.w2):
        return f"w13 ({type(m.w13).__name__}) and w2 ({type(m.w2).__name__}) of the experts differ in format"
    if isinstance(m.w13, Mxfp8Weight):
        if m.w13.block_size != m.w2.block_size:
            return f"MXFP8 blocks of w13 ({m.w13.block_size}) and w2 ({m.w2.block_size}) differ"
        return grouped_moe_unsupported(act_dtype, tuple(m.w13.shape), m.w13.weight.dtype, mx_block=m.w13.block_size)
    fp8 = isinstance(m.w13, BlockFp8Weight)
    if fp8 and m.w13.block != m.w2.block:
        return f"FP8 blocks of w13 {m.w13.block} and w2 {m.w2.block} differ"
    dtype = m.w13.weight.dtype if fp8 else m.w13.dtype
    return grouped_moe_unsupported(act_dtype, tuple(m.w13.shape), dtype, m.w13.block if fp8 else None)
