"""ONNX Runtime sessions over graphs whose weights live in our own buffers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lever_actors.errors import ConfigError

if TYPE_CHECKING:
    import onnxruntime as ort

ACCURACY = {"int8": 4, "fp32": 0}  # MatMulNBits accuracy_level: int8 activations or fp32 compute
KNOWN_PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "nnapi": "NnapiExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider",
}


@dataclass(frozen=True)
class LaneConfig:
    """How one lane's sessions run: threads, execution providers, activation precision."""

    threads: int = 1
    providers: tuple[str, ...] = ("cpu",)
    precision: str = "int8"

    @property
    def accuracy(self) -> int:
        return ACCURACY[self.precision]


def onnxruntime():
    """The onnxruntime module, imported on first use. Native-layout bundles never run a session,
    and the import alone takes about 20 MiB of RSS (measured: 39 -> 59 MiB), which a DRAM budget
    gives to pinned layers instead. A pipeline with an ``ort``-layout bundle imports it before the
    runtime's baseline is measured (:func:`count_in_baseline`), so the budget still counts it."""
    import onnxruntime as ort

    return ort


def count_in_baseline(layouts) -> None:
    """Import onnxruntime now if any of ``layouts`` will run ORT sessions: call it before
    ``memory.runtime_baseline()`` is first measured."""
    if any(layout != "native" for layout in layouts):
        onnxruntime()


def resolve_providers(names: tuple[str, ...]) -> list[str]:
    available = set(onnxruntime().get_available_providers())
    out = []
    for n in names:
        full = KNOWN_PROVIDERS.get(n.lower(), n)
        if full not in available:
            raise ConfigError(
                f"execution provider {n!r} is not available in this onnxruntime build "
                f"(available: {', '.join(sorted(available))})"
            )
        out.append(full)
    return out


def session_options(lane: LaneConfig) -> ort.SessionOptions:
    ort = onnxruntime()
    so = ort.SessionOptions()
    so.intra_op_num_threads = lane.threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    # sessions of streamed layers live for one pass: a per-session arena only holds
    # memory hostage (and fragments the heap as sessions come and go)
    so.enable_cpu_mem_arena = False
    # many small sessions, each with its own pool: spinning threads would fight for 2 cores
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


def release_freed_memory() -> None:
    """Give memory that sessions of finished passes freed back to the OS (glibc keeps it otherwise)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - probe: not glibc -> no trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


def make_session(model_bytes: bytes, weights: dict[str, np.ndarray], lane: LaneConfig) -> ort.InferenceSession:
    """A session whose external initializers come from ``weights`` (views into a layer buffer).

    ORT 1.32 copies injected external initializers (and prepacks MatMulNBits
    weights) while the session is created and never reads our buffer again, so
    the caller may recycle the buffer as soon as this returns (measured: zeroing
    the source after creation leaves outputs unchanged; tests/test_numerics.py).
    """
    ort = onnxruntime()
    so = session_options(lane)
    names = list(weights)
    values = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(weights[n])) for n in names]
    so.add_external_initializers(names, values)
    return ort.InferenceSession(model_bytes, sess_options=so, providers=resolve_providers(lane.providers))
