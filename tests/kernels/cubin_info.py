"""Per-kernel attributes ptxas wrote into a cubin (ELF ``.nv.info``): the registers a thread got and its
stack frame, where spilled registers go.  CuTeDSL's PTX shows no spill (``.local`` appears only once
ptxas has allocated registers), so a register budget is checked here, without a GPU or CUDA tools."""

from __future__ import annotations

import struct
from pathlib import Path

_EIATTR = {0x2F: "regcount", 0x11: "frame_size"}  # per-function attributes, value (function index, number)
_FORMAT_SVAL = 0x04  # attribute with a 16-bit size and a value of that many bytes


def _sections(data: bytes) -> dict[str, bytes]:
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name, _, _, _, offset, size in headers:
        end = data.index(b"\0", names_at + name)
        out[data[names_at + name:end].decode()] = data[offset:offset + size]
    return out


def kernel_attributes(cubin: Path) -> dict[str, int]:
    """``regcount`` and ``frame_size`` (bytes) of the cubin's kernel (the largest, if it holds several)."""
    info = _sections(cubin.read_bytes()).get(".nv.info", b"")
    found: dict[str, int] = {}
    i = 0
    while i + 4 <= len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt != _FORMAT_SVAL:
            i += 4  # flag or 16-bit value attributes: 4 bytes
            continue
        size = struct.unpack_from("<H", info, i + 2)[0]
        if attr in _EIATTR and size == 8:
            name = _EIATTR[attr]
            found[name] = max(found.get(name, 0), struct.unpack_from("<II", info, i + 4)[1])
        i += 4 + size
    if set(found) != set(_EIATTR.values()):
        raise ValueError(f"{cubin}: no register count or frame size in .nv.info (found {found})")
    return found
