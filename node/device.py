"""Accelerator placement for every role: the ``[device]`` section, device resolution, precision
(autocast + fp16 grad scaler), host<->device tensor movement and the device metrics.

Owns :class:`DeviceConfig` (registered as the top-level ``device`` section of the node config),
:func:`resolve_device` (the one place ``auto``/``cuda:N`` becomes a :class:`torch.device`, or a
:class:`~node.config.ConfigError` naming the field and what was found), :func:`autocast` and
:func:`grad_scaler` (precision), :class:`PinnedPool` (reusable page-locked host buffers for
device->host copies of tensors to send), :func:`to_device` / :func:`load_to_device` (received,
checkpointed or downloaded *host* tensors onto the configured device, no extra copy when already
there), and the ``swarmnode_device_info`` / ``swarmnode_cuda_memory_*`` gauges plus the card
details (:func:`device_details`) the coordinator reads to place stages by capacity.

Start-up order (docs/architecture.md, 'Node lifecycle'): hivemind forks its DHT process, so no CUDA call may happen
before the DHT is up. Importing this module and validating :class:`DeviceConfig` touch neither
torch nor CUDA; call :func:`resolve_device` from the role's ``start()`` (after
``Membership.start_dht``), never at import or config time. ``device = "cpu"`` never calls
``torch.cuda`` at all.

Peer data is never ``torch.load``-ed here: tensors arrive decoded by ``protocol/codec.py`` (raw
bytes + header) and are only *placed* by :func:`load_to_device`.

    dev = resolve_device(cfg.device)                     # in role.start(), after the DHT
    model.to(dev); opt = build_optimizer(model.parameters(), inner)
    scaler = grad_scaler(dev, cfg.device.precision)
    with autocast(dev, cfg.device.precision): loss = lm_loss(model(x), y)
    host = pool.to_host("theta", delta)                  # send from a reusable pinned buffer
    theirs = load_to_device(received, dev)               # host tensors -> device
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import Gauge
from pydantic import BaseModel, ConfigDict, field_validator

from node.errors import ConfigError
from node.metrics import REGISTRY

if TYPE_CHECKING:  # torch is imported lazily: config checks stay cheap and CUDA-free
    import torch

__all__ = ["DeviceConfig", "PinnedPool", "autocast", "device_details", "grad_scaler", "load_to_device",
           "outer_state_device", "record_memory", "resolve_device", "to_device", "DEVICE_INFO", "CUDA_MEMORY_ALLOCATED",
           "CUDA_MEMORY_PEAK"]

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")

DEVICE_INFO = Gauge("swarmnode_device_info", "Device this node trains on (value 1).",
                    ["device", "name", "capability"], registry=REGISTRY)
CUDA_MEMORY_ALLOCATED = Gauge("swarmnode_cuda_memory_allocated_bytes",
                              "CUDA memory held by tensors on the training device (set only on CUDA).",
                              registry=REGISTRY)
CUDA_MEMORY_PEAK = Gauge("swarmnode_cuda_memory_peak_bytes",
                         "Peak CUDA memory held by tensors since start (set only on CUDA).", registry=REGISTRY)


class DeviceConfig(BaseModel):
    """The ``[device]`` section: where and in which precision this node trains."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    device: str = "auto"
    """"auto" (the first visible GPU, else the CPU), "cpu", "cuda" (= cuda:0) or "cuda:N". Leave
    "auto" on single-GPU hosts; set "cpu" to keep a GPU free for something else, or "cuda:N" (or
    CUDA_VISIBLE_DEVICES) to pick one GPU of several. An unavailable device stops the node at
    start with what torch found."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision of forward passes (autocast); weights, optimizer and outer state stay
    fp32. "bf16" roughly halves activation memory and speeds up Ampere+ GPUs (and works on CPU);
    "fp16" is for older GPUs without bf16 (V100, T4) and adds a loss scaler. Keep "fp32" when
    comparing against reference runs (results then match a CPU run to ~1e-5)."""

    @field_validator("device")
    @classmethod
    def _device_form(cls, v: str) -> str:
        v = v.strip().lower()
        if not _DEVICE.match(v):
            raise ValueError(f"device={v!r}: use \"auto\", \"cpu\", \"cuda\" or \"cuda:N\" (N = 0, 1, ...)")
        return v


def _cuda_found() -> str:
    import torch

    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"torch.cuda.is_available()={available}, device_count={count}, "
            f"CUDA_VISIBLE_DEVICES={visible if visible is not None else '(unset)'}, "
            f"torch {torch.__version__} built with CUDA {torch.version.cuda or 'none (CPU build)'}")


def resolve_device(cfg: DeviceConfig) -> "torch.device":
    """The :class:`torch.device` for ``cfg.device``; raises ConfigError (exit 2) naming the field
    and what torch found when the GPU is missing. Call after the DHT has started (module doc)."""
    import torch

    want = cfg.device
    if want == "cpu":
        dev = torch.device("cpu")
    elif want == "auto":
        dev = torch.device("cuda:0") if torch.cuda.is_available() and torch.cuda.device_count() > 0 \
            else torch.device("cpu")
    else:
        index = int(want.split(":")[1]) if ":" in want else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(
                f"device.device={want!r} but that GPU is not usable here ({_cuda_found()}). Use "
                "device.device=\"auto\" or \"cpu\", pick an index below device_count, or run the CUDA "
                "image with `docker run --gpus all` (the host needs the NVIDIA driver and container toolkit)")
        dev = torch.device("cuda", index)
    if cfg.precision == "fp16" and dev.type != "cuda":
        raise ConfigError(f"device.precision=\"fp16\" needs a CUDA device but device.device={want!r} resolved "
                          f"to {dev}; use precision=\"bf16\" (works on CPU) or \"fp32\"")
    if cfg.precision == "bf16" and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"device.precision=\"bf16\" but {torch.cuda.get_device_name(dev)} has no bf16 "
                          "support; use precision=\"fp16\" (with its loss scaler) or \"fp32\"")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def _amp_dtype(precision: str) -> "torch.dtype | None":
    import torch

    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def autocast(device: "torch.device", precision: str) -> contextlib.AbstractContextManager:
    """Context for forward passes (not backward): bf16/fp16 autocast on CUDA, bf16 on CPU, and a
    no-op for fp32. Weights stay fp32; only the compute dtype changes."""
    import torch

    dtype = _amp_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    if device.type == "cpu" and dtype is not torch.bfloat16:
        raise ValueError(f"precision={precision!r} is not supported on the CPU; use bf16 or fp32")
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(device: "torch.device", precision: str) -> "torch.amp.GradScaler | None":
    """A :class:`torch.amp.GradScaler` for fp16 on CUDA (pass it to ``inner_step(scaler=...)``);
    ``None`` for fp32 and bf16, which need no loss scaling."""
    import torch

    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


# ---- host <-> device --------------------------------------------------------------------------
class PinnedPool:
    """Reusable host buffers for device->host copies of tensors to send, keyed by
    ``(name, shape, dtype)``: one allocation per tensor slot for the life of the role, not one
    per round. Buffers are page-locked when CUDA is available (``pin=None``: auto), so copies
    are asynchronous DMA; without CUDA they are plain host tensors.

    A buffer returned by :meth:`to_host` is overwritten by the next call with the same key: send
    (or copy) it before staging that slot again."""

    def __init__(self, pin: bool | None = None):
        import torch

        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[tuple[str, tuple[int, ...], Any], torch.Tensor] = {}
        self.allocations = 0

    def buffer(self, name: str, shape: tuple[int, ...], dtype: "torch.dtype") -> "torch.Tensor":
        import torch

        key = (name, tuple(shape), dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(key[1], dtype=dtype, device="cpu", pin_memory=self.pin)
            self._buffers[key] = buf
            self.allocations += 1
        return buf

    def to_host(self, name: str, tensor: "torch.Tensor", *, copy: bool = False) -> "torch.Tensor":
        """``tensor`` on the host. A device tensor is copied into this slot's buffer (waits for the
        copy, so the result is safe to read); a CPU tensor is returned as is unless ``copy``."""
        import torch

        tensor = tensor.detach()
        if tensor.device.type == "cpu" and not copy:
            return tensor
        buf = self.buffer(name, tuple(tensor.shape), tensor.dtype)
        buf.copy_(tensor, non_blocking=self.pin and tensor.device.type == "cuda")
        if tensor.device.type == "cuda":
            torch.cuda.current_stream(tensor.device).synchronize()
        return buf

    def to_host_all(self, named: Mapping[str, "torch.Tensor"], *, copy: bool = False) -> dict[str, "torch.Tensor"]:
        """:meth:`to_host` for each ``name -> tensor``; one synchronize for all device copies."""
        import torch

        out, cuda_devices = {}, set()
        for name, t in named.items():
            t = t.detach()
            if t.device.type == "cpu" and not copy:
                out[name] = t
                continue
            buf = self.buffer(name, tuple(t.shape), t.dtype)
            buf.copy_(t, non_blocking=self.pin and t.device.type == "cuda")
            if t.device.type == "cuda":
                cuda_devices.add(t.device)
            out[name] = buf
        for dev in cuda_devices:
            torch.cuda.current_stream(dev).synchronize()
        return out

    def __len__(self) -> int:
        return len(self._buffers)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def to_device(tensor: "torch.Tensor", device: "torch.device", dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """``tensor`` on ``device`` (and ``dtype``): the same object when it is already there (no
    copy), else one host->device copy (asynchronous from pinned memory)."""
    return tensor.to(device=device, dtype=dtype, non_blocking=tensor.is_pinned() if tensor.device.type == "cpu"
                     else False)


def load_to_device(host_tensors: Mapping[str, "torch.Tensor"], device: "torch.device",
                   dtype: "torch.dtype | None" = None) -> dict[str, "torch.Tensor"]:
    """Host tensors (decoded from a peer's bytes by ``protocol/codec.py``, or a checkpoint read with
    ``weights_only=True``) placed on ``device``; for checkpoints and state downloads. Refuses
    anything that is not a tensor, so a loader can never smuggle an object through."""
    import torch

    out = {}
    for name, t in host_tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"load_to_device: {name!r} is a {type(t).__name__}, not a tensor")
        out[name] = to_device(t, device, dtype)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the host buffers may be reused after return
    return out


# ---- metrics and card -------------------------------------------------------------------------
def device_details(device: "torch.device") -> dict[str, str | int]:
    """Card details for ``device`` (``NodeCard.details``, small scalars): kind, name and memory,
    so a coordinator can place pipeline stages by capacity. Also sets ``swarmnode_device_info``."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, capability, memory = props.name, f"{props.major}.{props.minor}", int(props.total_memory)
    else:
        name, capability = "cpu", ""
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            memory = 0
    DEVICE_INFO.clear()
    DEVICE_INFO.labels(device=str(device), name=name, capability=capability).set(1)
    return {"device_kind": device.type, "device_name": name[:64], "device_memory_bytes": int(memory)}


def record_memory(device: "torch.device") -> None:
    """Set the CUDA memory gauges (call once per outer round or scrape); a no-op off CUDA."""
    if device.type != "cuda":
        return
    import torch

    CUDA_MEMORY_ALLOCATED.set(torch.cuda.memory_allocated(device))
    CUDA_MEMORY_PEAK.set(torch.cuda.max_memory_allocated(device))


@contextlib.contextmanager
def cuda_calls_recorded() -> Iterator[list[str]]:
    """Test helper: record every ``torch.cuda`` probe (is_available, device_count, init) made
    inside the block, without changing results. Used to check the start-up order."""
    import torch

    calls: list[str] = []
    names = ("is_available", "device_count", "init", "_lazy_init", "set_device")
    saved = {n: getattr(torch.cuda, n) for n in names}

    def wrap(n: str, fn: Any) -> Any:
        def inner(*a: Any, **k: Any) -> Any:
            calls.append(n)
            return fn(*a, **k)
        return inner

    try:
        for n, fn in saved.items():
            setattr(torch.cuda, n, wrap(n, fn))
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(torch.cuda, n, fn)


def outer_state_device(placement: str, device: "torch.device") -> "torch.device":
    """Where NoLoCo/DiLoCo outer state (phi, m; fp32) lives for ``outer_state_device`` =
    "device" (next to the model) or "host" (CPU). Build the outer optimizer from parameters
    moved there, pass it theta on the same device (:meth:`PinnedPool.to_host` for "host") and
    copy the new phi back into the model (``copy_`` crosses devices)."""
    import torch

    if placement not in ("device", "host"):
        raise ValueError(f"outer_state_device={placement!r}: use \"device\" or \"host\"")
    return device if placement == "device" else torch.device("cpu")
