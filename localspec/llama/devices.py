"""ggml's devices (local GPUs, RPC servers): llama-cpp-python binds none of ggml's backend registry,
so the few functions needed are bound here against the ggml libraries llama_cpp has loaded."""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from localspec.llama.backend import _ensure_backend
from localspec.llama.bindings import PACKAGE_DIR, VERSION, llama_cpp
from localspec.llama.errors import LlamaError

log = logging.getLogger("localspec.llama.context")  # the llama layer's one logger (llama.cpp's own log too)

GGML_DEVICE_KINDS = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}  # enum ggml_backend_dev_type


class _DevCaps(ctypes.Structure):
    _fields_ = [("async_", ctypes.c_bool), ("host_buffer", ctypes.c_bool), ("buffer_from_host_ptr", ctypes.c_bool),
                ("events", ctypes.c_bool), ("mmap_support", ctypes.c_bool)]


class _DevProps(ctypes.Structure):  # struct ggml_backend_dev_props
    _fields_ = [("name", ctypes.c_char_p), ("description", ctypes.c_char_p), ("memory_free", ctypes.c_size_t),
                ("memory_total", ctypes.c_size_t), ("type", ctypes.c_int), ("device_id", ctypes.c_char_p),
                ("caps", _DevCaps)]


class Ggml:
    """ctypes bindings of ggml's backend and device registry (ggml-backend.h), from the same
    libraries the loaded llama_cpp uses. Get the process's one instance with `ggml()`."""

    def __init__(self) -> None:
        base = Path(getattr(llama_cpp, "_base_path", PACKAGE_DIR / "lib"))
        self._libs = []
        for name in ("ggml", "ggml-base"):  # already loaded by libllama: the same instances
            try:
                self._libs.append(llama_cpp.load_shared_library(name, base))
            except (OSError, RuntimeError) as e:
                log.debug("lib%s not loadable from %s: %s", name, base, e)
        vp, size, text = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        self.dev_count = self._bind("ggml_backend_dev_count", size)
        self.dev_get = self._bind("ggml_backend_dev_get", vp, size)
        self.dev_name = self._bind("ggml_backend_dev_name", text, vp)
        self.dev_description = self._bind("ggml_backend_dev_description", text, vp)
        self.dev_memory = self._bind("ggml_backend_dev_memory", None, vp, ctypes.POINTER(size), ctypes.POINTER(size))
        self.dev_type = self._bind("ggml_backend_dev_type", ctypes.c_int, vp)
        self.dev_get_props = self._bind("ggml_backend_dev_get_props", None, vp, ctypes.POINTER(_DevProps))
        self.dev_backend_reg = self._bind("ggml_backend_dev_backend_reg", vp, vp)
        self.dev_by_type = self._bind("ggml_backend_dev_by_type", vp, ctypes.c_int)
        self.reg_by_name = self._bind("ggml_backend_reg_by_name", vp, text)
        self.reg_name = self._bind("ggml_backend_reg_name", text, vp)
        self.reg_dev_count = self._bind("ggml_backend_reg_dev_count", size, vp)
        self.reg_dev_get = self._bind("ggml_backend_reg_dev_get", vp, vp, size)
        self.reg_get_proc_address = self._bind("ggml_backend_reg_get_proc_address", vp, vp, text)

    def _bind(self, name: str, restype, *argtypes):
        for lib in self._libs:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = restype, list(argtypes)
                return fn
        raise LlamaError(f"llama.cpp's ggml library has no {name} (llama-cpp-python {VERSION})")

    def device(self, handle: int) -> "Device":
        reg = self.dev_backend_reg(handle)
        props = _DevProps()
        self.dev_get_props(handle, ctypes.byref(props))
        return Device(handle=handle, name=(self.dev_name(handle) or b"").decode(errors="replace"),
                      description=(self.dev_description(handle) or b"").decode(errors="replace"),
                      kind=GGML_DEVICE_KINDS.get(self.dev_type(handle), "?"),
                      backend=(self.reg_name(reg) or b"").decode(errors="replace") if reg else "",
                      device_id=props.device_id.decode(errors="replace") if props.device_id else None)

    def memory(self, handle: int) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


@dataclass(frozen=True)
class Device:
    """One ggml device (a `ggml_backend_dev_t`)."""

    handle: int
    name: str  # CPU, CUDA0, RPC0, ...
    description: str  # for an RPC device: its server's HOST:PORT
    kind: str  # CPU, GPU, IGPU, ACCEL (an RPC device says GPU whatever the server runs)
    backend: str  # the backend registry's name: CPU, CUDA, RPC, ...
    device_id: str | None = None

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes; an RPC device asks its server."""
        return ggml().memory(self.handle)


_ggml: Ggml | None = None
_ggml_lock = threading.Lock()


def ggml() -> Ggml:
    global _ggml
    _ensure_backend()
    with _ggml_lock:
        if _ggml is None:
            _ggml = Ggml()
    return _ggml


def local_devices() -> list[Device]:
    """The devices of this machine llama.cpp knows (RPC servers are added per model, never here)."""
    g = ggml()
    return [g.device(g.dev_get(i)) for i in range(g.dev_count())]


def local_gpus() -> list[Device]:
    """The local GPUs llama.cpp offloads to by default: discrete GPUs (one per device id), integrated
    ones only when there is none (llama_prepare_model_devices)."""
    gpus: list[Device] = []
    igpus: list[Device] = []
    for dev in local_devices():
        if dev.backend == "RPC":
            continue
        if dev.kind == "GPU" and not any(dev.device_id and g.device_id == dev.device_id for g in gpus):
            gpus.append(dev)
        elif dev.kind == "IGPU" and (not igpus or igpus[-1].backend == dev.backend):
            igpus.append(dev)
    return gpus or igpus


def has_local_gpu() -> bool:
    """Whether this machine has a GPU llama.cpp offloads to (llama_supports_gpu_offload() also says
    yes for a CPU-only build with RPC support)."""
    try:
        return bool(local_gpus())
    except LlamaError:
        return bool(llama_cpp.llama_supports_gpu_offload()) and not llama_cpp.llama_supports_rpc()


def on_local_gpu(n_gpu_layers: int) -> bool:
    """Whether a model offloading `n_gpu_layers` layers (-1: all) runs them on a GPU of this
    machine (RPC devices count as a CPU: their kind is unknown here)."""
    return n_gpu_layers != 0 and has_local_gpu()
