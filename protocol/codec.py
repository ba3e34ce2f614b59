"""The rules every tensor on the wire obeys: allowlisted dtypes, exact shapes, size caps checked
before allocating, finiteness. Pure (no grpc, no framing): ``protocol/stream_wire.py`` builds
and parses the frames that carry tensors (the pipeline, rollouts, the NoLoCo exchange and
state downloads all use that one framing) and applies these checks to every head it receives.

* payload = raw little-endian bytes of an allowlisted dtype with an exact shape; never
  pickle, never ``torch.load``;
* a receiver checks dtype, shape, ``total_bytes == numel * itemsize``, the size cap and (when it
  knows what the peer must send) the expected name, dtype and shape **before** allocating;
* digests are xxh3_128 (``CHECKSUM_ALG``; blake2b runs at ~0.6 GB/s here and would cap
  throughput, xxh3 at ~8 GB/s).

Public API::

    validate_header(name, dtype, shape, total_bytes, cap, cap_key, expected) -> (dtype, shape)
    normalise_expected(expected) -> {name: (wire dtype, shape | None)}
    dtype_name(dtype) -> wire name;  check_chunk_bytes(n) -> n
    payload_view(tensor) -> (owner, flat uint8 memoryview)
    tensor_from_buffer(flat uint8 ndarray, dtype, shape) -> tensor over the same memory
    check_finite(name, tensor)        # raises TensorRejected("nonfinite", ...);  all_finite(t) -> bool
    THREAD_BYTES                      # above it: hash / check / average in a worker thread
    TensorRejected(reason, message)   # reason in REJECT_REASONS
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping

import numpy as np
import torch

MiB = 1 << 20
MIN_CHUNK_BYTES = 1 * MiB
MAX_CHUNK_BYTES = 4 * MiB
DEFAULT_CHUNK_BYTES = 4 * MiB
CHECKSUM_ALG = "xxh3_128"
MAX_NAME_CHARS = 1024
MAX_DIMS = 32
#: Payloads at least this large are hashed, checked or averaged in a worker thread (xxhash and
#: numpy release the GIL) so the event loop keeps serving peers; smaller ones run inline, where
#: a thread hop would cost more than the work. The one threshold for every such decision.
THREAD_BYTES = 8 * MiB

#: Wire name -> torch dtype. Anything else is rejected before allocation.
ALLOWED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in ALLOWED_DTYPES.items()}

REJECT_REASONS = frozenset({"dtype", "shape", "size", "checksum", "truncated", "malformed", "nonfinite",
                            "norm", "distance",  # these two: optimizers.exchange_common.bound_violation
                            "compressed",  # optimizers.outer_codec: a compressed part that cannot be decoded
                            "robust_mean"})  # optimizers.robust: a DiLoCo root's mean outside the clip rule

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("protocol.codec assumes a little-endian host (payload is little-endian)")

Expected = Mapping[str, tuple["torch.dtype | str", "tuple[int, ...] | list[int] | torch.Size | None"]]


class TensorRejected(ValueError):
    """A received tensor failed a check. ``reason`` is a metric label
    (``swarmnode_tensors_rejected_total{reason}``); ``message`` says what to do."""

    def __init__(self, reason: str, message: str):
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; use one of {sorted(REJECT_REASONS)}")
        super().__init__(f"[{reason}] {message}")
        self.reason = reason
        self.message = message


# ----------------------------------------------------------------------------- helpers

def dtype_name(dtype: torch.dtype | str) -> str:
    """Wire name of an allowlisted dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in ALLOWED_DTYPES:
            return name
    elif dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype]
    raise ValueError(f"dtype {dtype!r} cannot travel as a tensor stream; allowed: "
                     f"{', '.join(ALLOWED_DTYPES)}. Cast the tensor first (e.g. .float()).")


def check_chunk_bytes(chunk_bytes: int) -> int:
    """Return ``chunk_bytes`` if it lies in 1-4 MiB, else raise ValueError naming the key."""
    if not isinstance(chunk_bytes, int) or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes={chunk_bytes!r} is outside 1-4 MiB "
                         f"({MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}); set `grpc.chunk_bytes` in that range "
                         "(it must also stay below `grpc.max_message_bytes`)")
    return chunk_bytes


#: torch dtype -> the numpy dtype that holds its bytes (numpy has no bfloat16: int16 carries it).
NUMPY_CARRIER: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(np.int16),
    torch.float64: np.dtype(np.float64), torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32),
    torch.int16: np.dtype(np.int16), torch.int8: np.dtype(np.int8), torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}


def payload_view(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A CPU, contiguous copy-free (where possible) byte view of ``tensor``.
    Returns the tensor that owns the bytes (keep it alive) and a flat uint8 memoryview.
    (Through numpy, not ``reshape(-1).view(uint8)``: a third of the per-tensor cost, which
    matters for many 1 MiB tensors on an open stream.)"""
    t = tensor.detach()
    if not t.is_cpu:
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype not in NUMPY_CARRIER:
        dtype_name(t.dtype)  # raises: the dtype cannot travel
    a = (t.view(torch.int16) if t.dtype is torch.bfloat16 else t).numpy()
    return t, memoryview(a.reshape(-1)).cast("B")


def tensor_from_buffer(buf: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``dtype`` and ``shape`` over ``buf`` (a flat uint8 array of exactly its
    bytes), without a copy: the receiver's last step after every check passed."""
    t = torch.from_numpy(buf.view(NUMPY_CARRIER[dtype]).reshape(shape))
    return t.view(torch.bfloat16) if dtype is torch.bfloat16 else t


# ----------------------------------------------------------------------------- checks

def validate_header(name: str, dtype: str, shape, total_bytes: int, max_tensor_bytes: int,
                    cap_key: str = "limits.max_state_bytes",
                    expected: Mapping[str, tuple[str, tuple[int, ...]]] | None = None) -> tuple[torch.dtype, tuple[int, ...]]:
    """Every check on a tensor's declared name, dtype, shape and size, made before allocating;
    returns ``(torch dtype, shape)`` or raises TensorRejected. ``expected`` maps name ->
    (wire dtype name, shape or None: any 1-D length) as ``normalise_expected`` makes it."""
    if not name or len(name) > MAX_NAME_CHARS:
        raise TensorRejected("malformed", f"tensor name must be 1..{MAX_NAME_CHARS} characters, "
                             f"got {len(name)}")
    if dtype not in ALLOWED_DTYPES:
        raise TensorRejected("dtype", f"tensor {name!r} has dtype {dtype[:40]!r}, not in the "
                             f"allowlist ({', '.join(ALLOWED_DTYPES)}); the sender must cast it")
    shape = tuple(shape)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise TensorRejected("shape", f"tensor {name!r} has invalid shape {list(shape)[:MAX_DIMS + 1]} "
                             f"(need <= {MAX_DIMS} non-negative dims)")
    tdtype = ALLOWED_DTYPES[dtype]
    nonzero = math.prod(d for d in shape if d != 0)
    if nonzero > max(max_tensor_bytes, 1):
        raise TensorRejected("size", f"tensor {name!r} shape {list(shape)} is larger than the "
                             f"{max_tensor_bytes}-byte cap; raise `{cap_key}` if this "
                             "tensor is legitimate")
    need = math.prod(shape) * tdtype.itemsize
    if total_bytes != need:
        raise TensorRejected("size", f"tensor {name!r}: total_bytes={total_bytes} but shape "
                             f"{list(shape)} x {dtype} needs {need}; the sender is "
                             "broken or hostile: drop the stream")
    if total_bytes > max_tensor_bytes:
        raise TensorRejected("size", f"tensor {name!r} is {total_bytes} bytes, above the cap of "
                             f"{max_tensor_bytes}; raise `{cap_key}` if this tensor "
                             "is legitimate")
    if expected is not None:
        if name not in expected:
            raise TensorRejected("shape", f"unexpected tensor {name!r}; expected one of "
                                 f"{sorted(expected)[:8]}: peers disagree on the model config")
        want_dtype, want_shape = expected[name]
        if dtype != want_dtype:
            raise TensorRejected("dtype", f"tensor {name!r} is {dtype}, expected {want_dtype}: "
                                 "peers disagree on the model config")
        if want_shape is None and len(shape) != 1:
            raise TensorRejected("shape", f"tensor {name!r} has shape {list(shape)}, expected one dimension")
        if want_shape is not None and shape != want_shape:
            raise TensorRejected("shape", f"tensor {name!r} has shape {list(shape)}, expected "
                                 f"{list(want_shape)}: peers disagree on the model config")
    return tdtype, shape


def normalise_expected(expected: Expected | None) -> dict[str, tuple[str, tuple[int, ...] | None]] | None:
    """``expected`` as ``validate_header`` takes it: wire dtype names and int tuples (None kept:
    a 1-D tensor of any length under the cap)."""
    if expected is None:
        return None
    return {n: (dtype_name(d), None if s is None else tuple(int(x) for x in s)) for n, (d, s) in expected.items()}


_BLOCK = 1 << 18  # elements per cache-sized block; torch's isfinite made several passes with temporaries


def flat_numpy(t: torch.Tensor) -> np.ndarray | None:
    """A flat numpy view of a CPU tensor's elements, or None for dtypes numpy lacks (bfloat16)."""
    try:
        return t.detach().cpu().contiguous().reshape(-1).numpy()
    except (TypeError, RuntimeError):
        return None


def all_finite(t: torch.Tensor) -> bool:
    """True if a tensor holds no NaN/inf: one blockwise numpy pass, no big temporaries (torch's
    ``isfinite(t).all()`` was 5-10x slower here). Non-floating tensors are always finite."""
    if not t.is_floating_point():
        return True
    a = flat_numpy(t)
    if a is None:
        return bool(torch.isfinite(t).all())
    return all(np.isfinite(a[s:s + _BLOCK]).all() for s in range(0, a.size, _BLOCK))


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise ``TensorRejected("nonfinite")`` if a floating tensor holds NaN or inf."""
    if tensor.numel() and not all_finite(tensor):
        raise TensorRejected("nonfinite", f"tensor {name!r} contains NaN or inf; drop it and charge "
                             "the sender")
