"""Tensors as stream frames: hidden states between stages, token ids, logits.

Layout, little-endian::

    u8 version (1) | u8 dtype code | u8 ndim | u8 zero | u32 dim * ndim | zero pad to 8
    raw row-major bytes of the tensor

The payload starts 8-byte aligned, so a receiver holding the frame in a writable buffer
(``bytearray``, writable ``memoryview``) gets a tensor that shares its memory: no copy.
An immutable ``bytes`` frame is copied once, since a tensor may be written to later.
Everything is checked: version, dtype code, ndim, the zero bytes, and that the payload
is exactly as long as the shape says. A malformed frame raises ``RemoteProtocolError``.
Dtype codes are append-only.
"""

from __future__ import annotations

import struct
import sys

import torch

from p2pswarm.errors import LocalProtocolError, RemoteProtocolError

FRAME_VERSION = 1
MAX_NDIM = 8
MAX_DIM = 2**31 - 1

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int64: 4,
    torch.int32: 5,
    torch.int8: 6,
    torch.uint8: 7,
}
_DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}

if sys.byteorder != "little":  # raw tensor bytes travel in the machine's order
    raise ImportError("tensor frames need a little-endian machine")


def _header_bytes(ndim: int) -> int:
    return (4 + 4 * ndim + 7) // 8 * 8


def encode_tensor(t: torch.Tensor) -> bytearray:
    """One frame holding ``t`` (any device; copied once, straight into the frame)."""
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        raise LocalProtocolError("bad-tensor-dtype", f"cannot send {t.dtype}")
    if t.dim() > MAX_NDIM or any(d > MAX_DIM for d in t.shape):
        raise LocalProtocolError("bad-tensor-shape", f"cannot send shape {tuple(t.shape)}")
    header = _header_bytes(t.dim())
    nbytes = t.numel() * t.element_size()
    frame = bytearray(header + nbytes)
    struct.pack_into(f"<BBBx{t.dim()}I", frame, 0, FRAME_VERSION, code, t.dim(), *t.shape)
    if nbytes:
        payload = torch.frombuffer(frame, dtype=torch.uint8, offset=header, count=nbytes)
        payload.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return frame


def decode_tensor(frame: bytes | bytearray | memoryview) -> torch.Tensor:
    """The tensor in ``frame``, on the CPU; shares memory with a writable frame."""
    view = memoryview(frame).cast("B")
    if len(view) < 4:
        raise RemoteProtocolError("bad-tensor-frame", f"{len(view)} bytes, no header")
    version, code, ndim, zero = struct.unpack_from("<BBBB", view, 0)
    if version != FRAME_VERSION:
        raise RemoteProtocolError("bad-tensor-frame", f"version {version}")
    dtype = _DTYPES_BY_CODE.get(code)
    if dtype is None:
        raise RemoteProtocolError("bad-tensor-dtype", f"dtype code {code}")
    if ndim > MAX_NDIM or zero:
        raise RemoteProtocolError("bad-tensor-shape", f"ndim {ndim}")
    header = _header_bytes(ndim)
    if len(view) < header:
        raise RemoteProtocolError("bad-tensor-frame", "header cut short")
    shape = struct.unpack_from(f"<{ndim}I", view, 4)
    if any(d > MAX_DIM for d in shape) or any(view[4 + 4 * ndim:header]):
        raise RemoteProtocolError("bad-tensor-shape", f"shape {shape}")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(view) - header != numel * itemsize:
        raise RemoteProtocolError(
            "bad-tensor-length",
            f"shape {shape} of {dtype} needs {numel * itemsize} bytes, got {len(view) - header}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    buffer = view if not view.readonly else bytearray(view[header:])
    offset = header if not view.readonly else 0
    return torch.frombuffer(buffer, dtype=dtype, count=numel, offset=offset).view(shape)
