"""Host-side glue between torch and compiled CuTeDSL kernels: the target arch and launches.

Calling a compiled function (`JitCompiledFunction.__call__`) converts every argument
through the DSL's adapters on each call: on the H200 hosts that marshalling took 27.5 us of
the ~43 us a launch cost the host (an eager prefill forward of 16 Qwen3-30B layers makes 161
launches; `bench.prefill_step`'s ``host_issue_ms``). A :class:`Launcher` marshals once: it
keeps one ctypes cell per runtime argument, and a launch writes the values into the cells and
calls the device's executor with the cells' addresses, which is what the DSL's own
marshalling hands it (each argument as a pointer to its value, a stream as a pointer to its
handle; :func:`check_marshalling` proves that per compiled function, without a GPU).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from cuda.bindings.driver import CUstream
    from cutlass.base_dsl.jit_executor import JitCompiledFunction


def ensure_target_arch() -> None:
    """Compile for Hopper (sm_90a) unless the caller chose another target.

    Without a GPU the DSL cannot detect the architecture; CI compiles for sm_90a.
    """
    if "CUTE_DSL_ARCH" not in os.environ and not torch.cuda.is_available():
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"


def dummy_stream() -> CUstream:
    """A stream placeholder for `cute.compile` (only its type matters)."""
    import cuda.bindings.driver as cuda_driver

    return cuda_driver.CUstream(0)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | int) -> int:
    """SMs of a CUDA device (cached: `torch.cuda.get_device_properties` took ~5 us a call, on every launch
    that sizes its grid)."""
    return _sm_count(_index(device))


def _index(device: torch.device | int) -> int:
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


class LaunchError(RuntimeError):
    """A compiled function whose arguments a `Launcher` cannot pass (an annotation it does not know,
    or the DSL marshalling them otherwise than the launcher would)."""


_STREAM = "stream"


def _cell_types(fn: JitCompiledFunction) -> list[type[ctypes._SimpleCData] | str]:
    """The ctypes type of each runtime argument's value (``_STREAM`` for the stream), from the compiled
    function's runtime signature (constexpr arguments are not in it)."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute

    by_annotation: dict[Any, type[ctypes._SimpleCData] | str] = {
        cute.Pointer: ctypes.c_void_p, cutlass.Int64: ctypes.c_int64, cutlass.Int32: ctypes.c_int32,
        cutlass.Float32: ctypes.c_float, cuda_driver.CUstream: _STREAM,
    }
    signature = fn.execution_args.signature
    types = []
    for name, param in signature.parameters.items():
        cell = by_annotation.get(param.annotation)
        if cell is None:
            raise LaunchError(f"{fn.execution_args.function_name}: argument {name!r} is annotated {param.annotation!r}; "
                              f"a Launcher passes {[getattr(a, '__name__', a) for a in by_annotation]}")
        types.append(cell)
    return types


def check_marshalling(fn: JitCompiledFunction) -> None:
    """Raise `LaunchError` unless the DSL's own marshalling of ``fn``'s arguments is what a `Launcher` passes:
    one pointer per argument, to a value of the cell's type (no GPU needed)."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    from cutlass.cute.runtime import make_ptr

    types = _cell_types(fn)
    values, dsl_args = [], []
    for i, cell in enumerate(types):
        if cell is _STREAM:
            values.append(0x5000 + i)
            dsl_args.append(cuda_driver.CUstream(values[-1]))
        elif cell is ctypes.c_void_p:
            values.append(0x10000 + 256 * i)
            dsl_args.append(make_ptr(cutlass.Uint8, values[-1], cutlass.cute.AddressSpace.gmem))
        elif cell is ctypes.c_float:
            values.append(0.5 + i)
            dsl_args.append(values[-1])
        else:
            values.append(1000 + i)
            dsl_args.append(values[-1])
    exe_args, _ = fn.generate_execution_args(*dsl_args)
    if len(exe_args) != len(types):
        raise LaunchError(f"{fn.execution_args.function_name}: the DSL marshals {len(exe_args)} values for {len(types)} arguments")
    for i, (cell, value, address) in enumerate(zip(types, values, exe_args)):
        read_as = ctypes.c_void_p if cell is _STREAM else cell
        seen = read_as.from_address(address if isinstance(address, int) else address.value).value
        if seen != value:
            raise LaunchError(f"{fn.execution_args.function_name}: argument {i} marshals as {seen!r}, a Launcher would pass {value!r}")


class Launcher:
    """One compiled function on one device, launched on the device's current stream from any thread.

    ``launcher(a, b, ...)`` takes the runtime arguments but the stream, in order: device addresses
    (``tensor.data_ptr()``) for ``cute.Pointer`` and ``Int64`` address arguments, Python ints and
    floats for the rest; ``stream=`` a raw stream handle instead of the device's current stream.
    Each thread has its own cells, so threads may launch at once.
    """

    def __init__(self, fn: JitCompiledFunction, device: int) -> None:
        check_marshalling(fn)
        self.name = fn.execution_args.function_name
        self._types = _cell_types(fn)
        if self._types.count(_STREAM) != 1:
            raise LaunchError(f"{self.name}: a Launcher passes one stream argument, the function takes {self._types.count(_STREAM)}")
        self._stream_slot = self._types.index(_STREAM)
        self._arity = len(self._types) - 1
        self._device = device
        with torch.cuda.device(device):  # loads the module into the device's primary context
            self._executor = fn.to(device)
        self._tls = threading.local()

    def _cells(self) -> tuple[list[ctypes._SimpleCData], ctypes.c_void_p, list[ctypes.c_void_p]]:
        """This thread's cells: (the arguments' but the stream's, the stream's, every cell's address)."""
        cells = getattr(self._tls, "cells", None)
        if cells is None:
            every = [ctypes.c_void_p() if t is _STREAM else t() for t in self._types]
            # As c_void_p objects: the executor packs those as they are, plain ints through a conversion each.
            addresses = [ctypes.c_void_p(ctypes.addressof(c)) for c in every]
            slot = self._stream_slot
            cells = self._tls.cells = (every[:slot] + every[slot + 1:], every[slot], addresses)
        return cells

    def __call__(self, *args: int | float, stream: int | None = None) -> None:
        if len(args) != self._arity:
            raise LaunchError(f"{self.name} takes {self._arity} arguments besides the stream, got {len(args)}")
        values, stream_cell, addresses = self._cells()
        for cell, arg in zip(values, args):
            cell.value = arg
        # torch's raw handle of the device's current stream (what its compiled code launches on): 0.19 us
        # a call on an H200 host, where torch.cuda.current_stream(device).cuda_stream took 5.7
        stream_cell.value = torch._C._cuda_getCurrentRawStream(self._device) if stream is None else stream
        if torch.cuda.current_device() == self._device:  # the usual case: no device switch to pay for
            self._executor.run_compiled_program(addresses)
            return
        with torch.cuda.device(self._device):  # this thread is on another GPU: launch in this one's context
            self._executor.run_compiled_program(addresses)


_LAUNCHERS: dict[tuple[JitCompiledFunction, int], Launcher] = {}
_LOCK = threading.Lock()


def launcher(fn: JitCompiledFunction, device: torch.device | int) -> Launcher:
    """The cached `Launcher` of ``fn`` on ``device`` (a CUDA device or its index)."""
    index = _index(device)
    found = _LAUNCHERS.get((fn, index))
    if found is None:
        with _LOCK:
            found = _LAUNCHERS.get((fn, index))
            if found is None:
                found = _LAUNCHERS[(fn, index)] = Launcher(fn, index)
    return found
