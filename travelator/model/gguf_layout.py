"""Walk a GGUF file's header, metadata and tensor infos before gguf's GGUFReader does.

The reader trusts the counts and lengths it reads: past the end of the file its memory-mapped
views come back empty instead of failing, so a truncated file or an array of 2**60 numbers
sends it looping without end, and a tensor's dimensions multiply in wrapping uint64. This walk
checks every count, length and tensor extent against the bytes the file has (Python integers,
no allocation beyond one name at a time) and names the key or tensor at fault.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from travelator.model.model_file_error import ModelFileError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # the reader's
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32
_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
# The fewest bytes one entry can take: a bound on how many the rest of the file can hold.
_MIN_KV = 8 + 4 + 1  # empty key, type, a one-byte value
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # empty name, no dimensions, type, offset
_MIN_STRING = 8


class _Cursor:
    """Reads from the mapped file, each read checked against its end."""

    def __init__(self, buf: mmap.mmap, path: Path, order: str) -> None:
        self.buf, self.path, self.order, self.pos = buf, path, order, 0

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left:
            raise ModelFileError(self.path, what, f"needs {n} bytes at offset {self.pos}, the file has "
                                                  f"{self.left} left (truncated?)")

    def u32(self, what: str) -> int:
        return self._unpack("I", 4, what)

    def u64(self, what: str) -> int:
        return self._unpack("Q", 8, what)

    def _unpack(self, code: str, size: int, what: str) -> int:
        self.need(size, what)
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += size
        return value

    def count(self, what: str, each: int) -> int:
        """A count of entries of at least ``each`` bytes, at most what the rest of the file holds."""
        n = self.u64(what)
        if n * each > self.left:
            raise ModelFileError(self.path, what, f"claims {n} entries; the {self.left} bytes left hold "
                                                  f"at most {self.left // each} (truncated?)")
        return n

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(self.path, what, "is not valid UTF-8") from None


def check_gguf_layout(path: Path) -> None:
    """Raise ModelFileError unless every part of the GGUF file at ``path`` lies inside it."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            raise ModelFileError(path, None, "is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _walk(_Cursor(buf, path, "<"))


def _walk(cur: _Cursor) -> None:
    cur.need(8, "header")
    if cur.buf[:4] != _MAGIC:
        raise ModelFileError(cur.path, "header", f"magic is {bytes(cur.buf[:4])!r}, not {_MAGIC!r}")
    cur.pos = 4
    version = cur.u32("version")
    if version & 0xFFFF == 0:  # written on a big-endian machine (the reader swaps too)
        cur.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in _VERSIONS:
        raise ModelFileError(cur.path, "version", f"is {version}; supported: {list(_VERSIONS)}")
    n_tensors = cur.u64("tensor_count")
    n_kv = cur.count("kv_count", _MIN_KV)
    if n_tensors * _MIN_TENSOR_INFO > cur.left:
        raise ModelFileError(cur.path, "tensor_count", f"claims {n_tensors} tensors; the file cannot hold "
                                                       f"their infos")
    alignment = _DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        kind = _value_type(cur, key)
        if key == "general.alignment" and kind == GGUFValueType.UINT32:
            alignment = cur.u32(key)
            if alignment == 0 or alignment & (alignment - 1):
                raise ModelFileError(cur.path, key, f"is {alignment}, not a power of two")
        else:
            _skip_value(cur, key, kind)
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    data_bytes = len(cur.buf) - data_start
    for name, offset, nbytes in infos:
        if offset % alignment:
            raise ModelFileError(cur.path, f"tensor {name}", f"offset {offset} is not a multiple of the "
                                                             f"alignment {alignment}")
        if offset + nbytes > data_bytes:
            raise ModelFileError(cur.path, f"tensor {name}", f"needs {nbytes} bytes at offset {offset}; "
                                                             f"the data section has {data_bytes} (truncated?)")


def _value_type(cur: _Cursor, key: str) -> GGUFValueType:
    raw = cur.u32(key)
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ModelFileError(cur.path, key, f"has unknown value type {raw}") from None


def _skip_value(cur: _Cursor, key: str, kind: GGUFValueType) -> None:
    if kind in _SCALAR_SIZES:
        cur.skip(_SCALAR_SIZES[kind], key)
    elif kind == GGUFValueType.STRING:
        cur.skip(cur.u64(key), key)
    else:  # an array: its item type, its length, its items
        item = _value_type(cur, key)
        n = cur.count(key, _SCALAR_SIZES.get(item, _MIN_STRING))
        if item in _SCALAR_SIZES:
            cur.skip(n * _SCALAR_SIZES[item], key)
        elif item == GGUFValueType.STRING:
            for _ in range(n):
                cur.skip(cur.u64(key), key)
        else:
            raise ModelFileError(cur.path, key, "is an array of arrays")


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, int, int]:
    """One tensor's name, offset in the data section and size in bytes."""
    name = cur.string(f"tensor #{i} name")
    what = f"tensor {name}"
    n_dims = cur.u32(what)
    if not 1 <= n_dims <= _MAX_DIMS:
        raise ModelFileError(cur.path, what, f"has {n_dims} dimensions; GGUF allows 1 to {_MAX_DIMS}")
    dims = [cur.u64(what) for _ in range(n_dims)]
    raw_type = cur.u32(what)
    offset = cur.u64(what)
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
    except (ValueError, KeyError):
        raise ModelFileError(cur.path, what, f"has unknown type {raw_type}") from None
    if dims[0] % block:
        raise ModelFileError(cur.path, what, f"rows of {dims[0]} are not whole blocks of {block}")
    elements = 1
    for d in dims:
        elements *= d
    return name, offset, elements // block * type_size
