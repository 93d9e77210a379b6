"""`moebus quantize`: convert a bf16/fp32 Hugging Face checkpoint to FP8.

Formats
-------
``fp8-block`` is the layout Qwen publishes (Qwen3-*-FP8): every quantized linear
weight ``<name>.weight`` is stored as F8_E4M3 next to ``<name>.weight_scale_inv``
(F32, one value per 128x128 block, real weight = fp8 * scale_inv), and config.json
gets::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
        "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.input_layernorm",
                                   "model.layers.0.mlp.gate", ...]}

``mxfp8`` is moebus's own layout for OCP MXFP8 weights: ``<name>.weight`` as
F8_E4M3 next to ``<name>.weight_scale_e8m0`` (U8 biased exponents, one per 32
values along the input dimension), with ``"quantization_config":
{"quant_method": "mxfp8", "block_size": 32, "modules_to_not_convert": [...]}``.

What is quantized follows Qwen's published FP8 checkpoints: the attention
projections (q/k/v/o) and the MLP / expert projections (gate/up/down). Embeddings,
norms, the router (``mlp.gate``) and ``lm_head`` are copied unchanged, in the
source dtype. Every other file of the directory (tokenizer, generation config,
chat template) is copied as is.

The conversion streams: each output file's safetensors header is planned from the
input headers alone, then tensors are read, quantized and appended one at a time,
so memory holds one tensor, never a shard or the model. The output is built in a
temporary sibling directory and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open

from shared.model.quant_formats import (
    MX_BLOCK,
    WEIGHT_BLOCK,
    dequantize_block_fp8,
    dequantize_mxfp8,
    quantize_block_fp8,
    quantize_mxfp8,
)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"

# Linear weights that get quantized, by family (the unit of the error report).
_QUANTIZED_FAMILIES: list[tuple[str, re.Pattern[str]]] = [
    (f"attn.{p}", re.compile(rf"\.self_attn\.{p}\.weight$")) for p in ("q_proj", "k_proj", "v_proj", "o_proj")
] + [
    (f"expert.{p}", re.compile(rf"\.mlp\.experts\.\d+\.{p}\.weight$")) for p in ("gate_proj", "up_proj", "down_proj")
] + [
    # dense MLP layers (Qwen3ForCausalLM, or `mlp_only_layers` of a MoE model)
    (f"mlp.{p}", re.compile(rf"\.mlp\.{p}\.weight$")) for p in ("gate_proj", "up_proj", "down_proj")
]
# The per-layer modules Qwen lists in `modules_to_not_convert` (with "lm_head").
_NOT_CONVERTED = re.compile(r"^(model\.layers\.(\d+)\.(input_layernorm|mlp\.gate|post_attention_layernorm))\.weight$")

# safetensors dtype names -> bytes per element
_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1, "BOOL": 1, "BF16": 2, "F16": 2,
                "I16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}
_TORCH_DTYPE_NAMES = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL",
                      torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.float32: "F32",
                      torch.int32: "I32", torch.float64: "F64", torch.int64: "I64"}


class QuantizeError(Exception):
    """The conversion cannot proceed; the message names the file or tensor."""


class AlreadyQuantizedError(QuantizeError):
    """The source checkpoint is quantized already."""


def tensor_family(name: str) -> str | None:
    """The family of a tensor that gets quantized, None for tensors kept as they are."""
    return next((family for family, pattern in _QUANTIZED_FAMILIES if pattern.search(name)), None)


# --------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class QuantFormat:
    """How one format stores a quantized weight and what its config entry says."""

    name: str
    scale_suffix: str  # replaces the trailing "weight" of the tensor name
    scale_dtype: str
    scale_shape: Callable[[list[int]], list[int]]
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    dequantize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    config: dict[str, Any]


def _block_fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = quantize_block_fp8(w, WEIGHT_BLOCK)
    return q.weight, q.scale_inv


def _mxfp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = quantize_mxfp8(w, MX_BLOCK)
    return q.weight, q.scale_e8m0


FORMATS: dict[str, QuantFormat] = {
    "fp8-block": QuantFormat(
        name="fp8-block",
        scale_suffix="weight_scale_inv",
        scale_dtype="F32",
        scale_shape=lambda s: [*s[:-2], -(-s[-2] // WEIGHT_BLOCK[0]), -(-s[-1] // WEIGHT_BLOCK[1])],
        quantize=_block_fp8_quantize,
        dequantize=lambda w, s: dequantize_block_fp8(w, s, WEIGHT_BLOCK),
        config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(WEIGHT_BLOCK)},
    ),
    "mxfp8": QuantFormat(
        name="mxfp8",
        scale_suffix="weight_scale_e8m0",
        scale_dtype="U8",
        scale_shape=lambda s: [*s[:-1], -(-s[-1] // MX_BLOCK)],
        quantize=_mxfp8_quantize,
        dequantize=lambda w, s: dequantize_mxfp8(w, s, MX_BLOCK),
        config={"quant_method": "mxfp8", "block_size": MX_BLOCK},
    ),
}


# --------------------------------------------------------------------------- statistics


@dataclass
class FamilyStats:
    """Error of one tensor family, accumulated over its tensors."""

    tensors: int = 0
    params: int = 0
    sum_sq_ref: float = 0.0
    sum_sq_err: float = 0.0
    max_abs: float = 0.0

    def add(self, ref: torch.Tensor, approx: torch.Tensor) -> None:
        diff = approx.double() - ref.double()
        self.tensors += 1
        self.params += ref.numel()
        self.sum_sq_ref += float(ref.double().square().sum())
        self.sum_sq_err += float(diff.square().sum())
        self.max_abs = max(self.max_abs, float(diff.abs().max()))

    def merge(self, other: FamilyStats) -> None:
        self.tensors += other.tensors
        self.params += other.params
        self.sum_sq_ref += other.sum_sq_ref
        self.sum_sq_err += other.sum_sq_err
        self.max_abs = max(self.max_abs, other.max_abs)

    def as_dict(self) -> dict[str, float]:
        err, ref = self.sum_sq_err, self.sum_sq_ref
        return {
            "tensors": self.tensors,
            "params": self.params,
            "rel_fro": math.sqrt(err / ref) if ref > 0 else 0.0,
            "max_abs": self.max_abs,
            "snr_db": 10 * math.log10(ref / err) if err > 0 else math.inf,
        }


@dataclass
class QuantizeReport:
    format: str
    families: dict[str, FamilyStats] = field(default_factory=dict)
    kept_tensors: int = 0

    def overall(self) -> FamilyStats:
        total = FamilyStats()
        for stats in self.families.values():
            total.merge(stats)
        return total

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "families": {name: s.as_dict() for name, s in sorted(self.families.items())},
            "overall": self.overall().as_dict(),
            "kept_tensors": self.kept_tensors,
        }


# --------------------------------------------------------------------------- safetensors output


@dataclass(frozen=True)
class _PlannedTensor:
    name: str
    dtype: str
    shape: list[int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES[self.dtype]


class _SafetensorsStreamWriter:
    """Writes a safetensors file whose header is known up front, one tensor at a time.

    File format: 8-byte little-endian header length, the JSON header (names ->
    dtype, shape, byte range in the data section), padded to 8 bytes, then data.
    """

    def __init__(self, path: Path, plan: list[_PlannedTensor]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tensor in plan:
            header[tensor.name] = {"dtype": tensor.dtype, "shape": tensor.shape,
                                   "data_offsets": [offset, offset + tensor.nbytes]}
            offset += tensor.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._plan = iter(plan)
        self._path = path
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = next(self._plan, None)
        dtype = _TORCH_DTYPE_NAMES.get(tensor.dtype)
        if expected is None or expected.name != name or expected.dtype != dtype or expected.shape != list(tensor.shape):
            raise QuantizeError(f"{self._path}: tensor {name} ({dtype} {list(tensor.shape)}) does not match the plan {expected}")
        self._file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        self._file.close()
        leftover = next(self._plan, None)
        if leftover is not None:
            raise QuantizeError(f"{self._path}: tensor {leftover.name} was planned but never written")


# --------------------------------------------------------------------------- conversion


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise QuantizeError(f"{path} is missing") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantizeError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise QuantizeError(f"{path} must hold a JSON object")
    return data


def _weight_files(src: Path) -> tuple[list[str], dict[str, Any] | None]:
    """Safetensors file names of the checkpoint and its index (None for one file)."""
    index_path = src / INDEX_FILE
    if index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise QuantizeError(f"{index_path} has no weight_map")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (src / name).is_file():
                raise QuantizeError(f"{index_path} lists {name}, which is missing from {src}")
        return files, index
    files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        raise QuantizeError(f"{src} holds no *.safetensors weights")
    return files, None


def _plan_file(path: Path, fmt: QuantFormat) -> list[tuple[str, str | None, list[_PlannedTensor]]]:
    """For each input tensor: its name, its family (None: kept) and the output tensors."""
    try:
        headers: dict[str, tuple[str, list[int]]] = {}
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                info = handle.get_slice(name)
                headers[name] = (info.get_dtype(), list(info.get_shape()))
    except Exception as exc:  # safetensors raises SafetensorError / OSError variants
        raise QuantizeError(f"{path} is not a readable safetensors file: {exc}") from exc
    plan = []
    for name, (dtype, shape) in sorted(headers.items()):
        if dtype.startswith("F8_") or name.endswith(("weight_scale_inv", "weight_scale_e8m0", "weight_scale")):
            raise AlreadyQuantizedError(f"{path}: tensor {name} ({dtype}) is already quantized")
        if dtype not in _DTYPE_BYTES:
            raise QuantizeError(f"{path}: tensor {name} has dtype {dtype}, which moebus quantize does not handle")
        family = tensor_family(name)
        if family is not None and dtype not in ("BF16", "F16", "F32"):
            raise QuantizeError(f"{path}: tensor {name} is {dtype}; only floating-point weights can be quantized")
        if family is not None and len(shape) != 2:
            raise QuantizeError(f"{path}: linear weight {name} has shape {shape}, expected [out, in]")
        if family is None:
            outputs = [_PlannedTensor(name, dtype, shape)]
        else:
            scale_name = name[: -len("weight")] + fmt.scale_suffix
            outputs = [_PlannedTensor(name, "F8_E4M3", shape),
                       _PlannedTensor(scale_name, fmt.scale_dtype, fmt.scale_shape(shape))]
        plan.append((name, family, outputs))
    return plan


def _modules_not_converted(names: list[str]) -> list[str]:
    """Qwen's list: lm_head, then per layer input_layernorm, mlp.gate, post_attention_layernorm."""
    found = [(int(m.group(2)), m.group(1)) for m in map(_NOT_CONVERTED.match, names) if m]
    return ["lm_head", *(module for _, module in sorted(found))]


def quantize_checkpoint(
    src: str | Path, dst: str | Path, fmt: str, progress: Callable[[str], None] | None = None
) -> QuantizeReport:
    """Convert the checkpoint at ``src`` into ``dst`` (which must not exist or be empty)."""
    if fmt not in FORMATS:
        raise QuantizeError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    quant_format = FORMATS[fmt]
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise QuantizeError(f"source checkpoint {src} is not a directory")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise QuantizeError(f"output {dst} exists and is not an empty directory")
    if dst.resolve() == src.resolve():
        raise QuantizeError("output directory must differ from the source")
    config = _read_json(src / CONFIG_FILE)
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?")
        raise AlreadyQuantizedError(f"{src / CONFIG_FILE} already has a quantization_config ({method})")
    files, index = _weight_files(src)
    plans = {name: _plan_file(src / name, quant_format) for name in files}

    staging = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        report = QuantizeReport(format=fmt)
        for file_name, plan in plans.items():
            if progress:
                progress(f"{file_name}: {len(plan)} tensors")
            _convert_file(src / file_name, staging / file_name, plan, quant_format, report)
        all_names = [name for plan in plans.values() for name, _, _ in plan]
        config["quantization_config"] = {
            **quant_format.config,
            "modules_to_not_convert": _modules_not_converted(all_names),
        }
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if index is not None:
            _write_index(staging, index, plans)
        for entry in src.iterdir():
            # everything else the directory carries: tokenizer, generation config, chat template, ...
            if entry.is_file() and not entry.name.startswith(".") and entry.suffix != ".safetensors" \
                    and entry.name not in (CONFIG_FILE, INDEX_FILE):
                shutil.copy2(entry, staging / entry.name)
        if dst.exists():
            dst.rmdir()  # empty, checked above
        staging.rename(dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _convert_file(
    src_path: Path,
    dst_path: Path,
    plan: list[tuple[str, str | None, list[_PlannedTensor]]],
    fmt: QuantFormat,
    report: QuantizeReport,
) -> None:
    writer = _SafetensorsStreamWriter(dst_path, [t for _, _, outputs in plan for t in outputs])
    try:
        with safe_open(str(src_path), framework="pt") as handle:
            for name, family, outputs in plan:
                tensor = handle.get_tensor(name)
                if family is None:
                    writer.write(name, tensor)
                    report.kept_tensors += 1
                    continue
                reference = tensor.float()
                weight, scale = fmt.quantize(reference)
                writer.write(outputs[0].name, weight)
                writer.write(outputs[1].name, scale)
                report.families.setdefault(family, FamilyStats()).add(reference, fmt.dequantize(weight, scale))
    finally:
        writer.close()


def _write_index(staging: Path, index: dict[str, Any], plans: dict[str, list[Any]]) -> None:
    weight_map = {}
    total = 0
    for file_name, plan in plans.items():
        for _, _, outputs in plan:
            for tensor in outputs:
                weight_map[tensor.name] = file_name
                total += tensor.nbytes
    metadata = {**index.get("metadata", {}), "total_size": total}
    out = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(out, indent=2) + "\n")


# --------------------------------------------------------------------------- CLI


def format_report(report: QuantizeReport) -> str:
    columns = ["family", "tensors", "params", "rel_fro_%", "max_abs", "snr_db"]
    rows = []
    for name, stats in [*sorted(report.families.items()), ("all quantized", report.overall())]:
        d = stats.as_dict()
        rows.append([name, str(d["tensors"]), str(d["params"]), f"{100 * d['rel_fro']:.3f}",
                     f"{d['max_abs']:.4g}", f"{d['snr_db']:.2f}"])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    lines.append(f"{report.kept_tensors} tensors kept in their source dtype (embeddings, norms, router, lm_head)")
    return "\n".join(lines)


def arguments() -> argparse.ArgumentParser:
    """The command line of `moebus quantize`."""
    parser = argparse.ArgumentParser(prog="moebus quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="source checkpoint directory (bf16/fp32)")
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    parser.add_argument("--format", required=True, choices=sorted(FORMATS), help="target format")
    parser.add_argument("--stats-json", help="also write the error statistics as JSON to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    try:
        report = quantize_checkpoint(args.model, args.out, args.format,
                                     progress=lambda msg: print(msg, file=sys.stderr))
    except QuantizeError as exc:
        print(f"moebus quantize: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({args.format})")
    print(format_report(report))
    if args.stats_json:
        Path(args.stats_json).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
