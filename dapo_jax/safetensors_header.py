"""The header of a safetensors file, read as untrusted input before any tensor data.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON mapping each tensor
name to its dtype, shape and byte range in the data that follows, then the data. Every number is
checked against the file's size before it is trusted, so a garbled, truncated or empty file is a
one-line `ModelFolderError` naming it, not a reader's traceback. Nothing is executed or unpickled.
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

from dapo_jax.errors import ModelFolderError

REDO = "re-download or re-export it"


class TensorInfo(NamedTuple):
    """A tensor as its safetensors header describes it."""

    file: str
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]


_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound on a header


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_safetensors_header(path: str) -> dict[str, TensorInfo]:
    """The tensors of a safetensors file, from its header alone: the header's length is checked
    against the file's size before the header is read, and every tensor's bytes against its dtype
    and shape and against the data the file holds (a truncated file is named as one)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ModelFolderError(path, f"holds {size} bytes, no safetensors header; {REDO}")
            n = int.from_bytes(f.read(8), "little")
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise ModelFolderError(
                    path,
                    f"is not a safetensors file or is truncated: its "
                    f"header would take {n} bytes of the file's {size}; {REDO}",
                )
            raw = f.read(n)
    except OSError as e:
        raise ModelFolderError(path, f"cannot be read ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise ModelFolderError(path, f"is not a safetensors file: its header is not a JSON object; {REDO}")
    data_bytes, tensors = size - 8 - n, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entry = entry if isinstance(entry, dict) else {}
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if (
            dtype not in _ITEMSIZE
            or not isinstance(shape, list)
            or not all(map(_is_count, shape))
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(map(_is_count, offsets))
            or offsets[1] - offsets[0] != math.prod(shape) * _ITEMSIZE[dtype]
        ):
            raise ModelFolderError(path, f"tensor {name}: malformed header entry {entry!r:.200}; {REDO}")
        if offsets[1] > data_bytes:
            raise ModelFolderError(
                path,
                f"is truncated: tensor {name} ends at byte {offsets[1]} "
                f"of the data, which holds {data_bytes}; {REDO}",
            )
        tensors[name] = TensorInfo(path, dtype, tuple(shape))
    return tensors
