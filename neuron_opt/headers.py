"""Bounded reads of the files we take from others: GGUF and safetensors headers, small JSON files.

Design decisions
- A header is a list of counts and lengths that the file itself declares. Every one is checked against the bytes
  that remain in the file *before* anything is sized by it, so a crafted file fails in time and memory bounded by
  its own size, with an error naming the field. (gguf's reader allocates per declared element: a 103-byte file
  whose one metadata array declares 2^62 elements drove it to 3 GB in 29 s.)
- GGUF: `check_gguf` walks the header with `struct` reads over an mmap of the file (nothing is copied) and only
  then is the file handed to `gguf.GGUFReader`, which we do not rewrite. Strings are skipped, not decoded.
- safetensors: `safetensors_header` parses the JSON header itself (length against the file size and a cap;
  every tensor's dtype, shape and byte range consistent with each other and with the data section), so a bad
  file is refused before the safetensors library sees it, with the tensor named.
- JSON configs (config.json, the safetensors index) are read only below a size cap (`read_capped`).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

from neuron_opt.errors import CheckpointError, NeuronOptError

MAX_JSON_BYTES = 4 << 20  # config.json of the largest HF models is a few KB; the sharded index a few hundred KB
# ~100 bytes per tensor entry: 16 MiB describes ~150k tensors, far beyond any one checkpoint file (safetensors'
# own reader allows 100 MB)
MAX_SAFETENSORS_HEADER = 16 << 20

# safetensors dtype -> bits per element
_SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
                     "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
                     "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}

# GGUF metadata value types (gguf.GGUFValueType) -> fixed size in bytes; STRING (8) and ARRAY (9) are variable
_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS
_GGUF_MAX_NESTING = 4  # arrays of arrays: none in practice; a bound keeps the walk's recursion shallow


def read_capped(path: Path, cap: int, error: type[NeuronOptError], what: str) -> bytes:
    """The bytes of `path`, refused with `error` when it is larger than `cap` (checked before reading)."""
    size = os.stat(path).st_size
    if size > cap:
        raise error(f"{what}: {path} is {size} bytes, more than the {cap >> 20} MiB such a file may be; refusing "
                    "to read it (a crafted or wrong file?)")
    with open(path, "rb") as f:
        return f.read(cap + 1)[:cap]


def read_json_capped(path: Path, error: type[NeuronOptError], what: str, cap: int = MAX_JSON_BYTES) -> Any:
    try:
        return json.loads(read_capped(path, cap, error, what))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, nesting too deep
        raise error(f"{what}: {path} is not valid JSON ({str(e)[:200]})") from None


# ---------------------------------------------------------------------------------------------------------
# safetensors


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file (name -> {dtype, shape, data_offsets}), every one checked against
    the file's size; CheckpointError naming the file and tensor otherwise."""
    size = os.stat(path).st_size

    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"checkpoint: {path} is not a valid safetensors file: {msg}")

    with open(path, "rb") as f:
        if size < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise bad(f"header length {n} exceeds the file ({size} bytes)")
        if n > MAX_SAFETENSORS_HEADER:
            raise bad(f"header length {n} exceeds the {MAX_SAFETENSORS_HEADER >> 20} MiB cap")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"header is not JSON ({str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data_len = size - 8 - n
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, e in entries.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r}: expected dtype, shape and data_offsets, got {e!r:.200}")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in _SAFETENSORS_BITS:
            raise bad(f"tensor {name!r}: unknown dtype {dtype!r:.40}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"tensor {name!r}: shape {shape!r:.200} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_len):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r:.200} are not within the data section "
                      f"({data_len} bytes)")
        numel = 1
        for d in shape:
            numel *= d
        if numel * _SAFETENSORS_BITS[dtype] != 8 * (offsets[1] - offsets[0]):
            raise bad(f"tensor {name!r}: {dtype} {shape} needs {numel * _SAFETENSORS_BITS[dtype] / 8:g} bytes, "
                      f"data_offsets {offsets} give {offsets[1] - offsets[0]}")
    return entries


# ---------------------------------------------------------------------------------------------------------
# GGUF


class _Cursor:
    """Little- or big-endian reads over a buffer, each checked against its end before it is made."""

    def __init__(self, buf: Any, path: Path, order: str) -> None:
        self.buf, self.path, self.order, self.pos, self.end = buf, path, order, 0, len(buf)

    def fail(self, msg: str) -> CheckpointError:
        return CheckpointError(f"checkpoint: {self.path} is not a valid GGUF file: {msg}")

    def remaining(self) -> int:
        return self.end - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.remaining():
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, the file has {self.remaining()} left")

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        n = struct.calcsize(fmt)
        self.need(n, what)
        out = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return int(self.unpack("I", what)[0])

    def u64(self, what: str) -> int:
        return int(self.unpack("Q", what)[0])

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def string(self, what: str, keep: bool = False) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace") if keep else ""
        self.pos += n
        return text


def _skip_value(c: _Cursor, vtype: int, what: str, depth: int = 0) -> None:
    if vtype in _GGUF_FIXED:
        c.skip(_GGUF_FIXED[vtype], what)
    elif vtype == _GGUF_STRING:
        c.string(what)
    elif vtype == _GGUF_ARRAY:
        if depth >= _GGUF_MAX_NESTING:
            raise c.fail(f"{what}: arrays nested deeper than {_GGUF_MAX_NESTING}")
        etype = c.u32(f"{what}: element type")
        count = c.u64(f"{what}: element count")
        # the smallest encoding of one element: its fixed size, a string's length, an array's type and count
        least = _GGUF_FIXED.get(etype, {_GGUF_STRING: 8, _GGUF_ARRAY: 12}.get(etype, 0))
        if least == 0:
            raise c.fail(f"{what}: unknown array element type {etype}")
        if count * least > c.remaining():
            raise c.fail(f"{what}: array declares {count} elements (at least {count * least} bytes), the file has "
                         f"{c.remaining()} bytes left")
        if etype in _GGUF_FIXED:
            c.skip(count * least, what)
        else:  # bounded: count <= remaining bytes / 8
            for i in range(count):
                _skip_value(c, etype, f"{what}[{i}]", depth + 1)
    else:
        raise c.fail(f"{what}: unknown metadata value type {vtype}")


def check_gguf(path: Path) -> None:
    """Walk a GGUF file's header (counts, metadata, tensor infos) and check every declared size and offset against
    the file, before gguf's reader allocates anything by them. CheckpointError naming the field otherwise."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # here: the CLI's parser imports this module

    if os.stat(path).st_size < 24:  # magic, version, two counts (and mmap refuses an empty file)
        raise CheckpointError(f"checkpoint: {path} is not a valid GGUF file: shorter than its 24-byte header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise CheckpointError(f"checkpoint: {path} is not a GGUF file (magic {buf[:4]!r})")
        # gguf's own rule: a version whose low 16 bits are zero was written in the other byte order
        (version,) = struct.unpack_from("<I", buf, 4)
        order = ">" if version & 0xFFFF == 0 else "<"
        c = _Cursor(buf, path, order)
        c.pos = 4
        version = c.u32("version")
        if version not in (2, 3):
            raise c.fail(f"version {version} (gguf reads versions 2 and 3)")
        n_tensors, n_kv = c.u64("tensor count"), c.u64("metadata count")
        if n_kv * 13 > c.remaining():  # key length (8), type (4), one byte of value at least
            raise c.fail(f"metadata count {n_kv} needs at least {n_kv * 13} bytes, the file has {c.remaining()}")
        alignment = 32  # GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}", keep=True)
            vtype = c.u32(f"metadata {key!r}: type")
            if key == "general.alignment" and vtype == _GGUF_UINT32:
                alignment = c.u32("general.alignment")
                if alignment == 0 or alignment & (alignment - 1):
                    raise c.fail(f"general.alignment {alignment} is not a power of two")
            else:
                _skip_value(c, vtype, f"metadata {key!r}")
        if n_tensors * 24 > c.remaining():  # name length (8), dims (4 + 8), type (4), offset (8) at least
            raise c.fail(f"tensor count {n_tensors} needs at least {n_tensors * 24} bytes of tensor infos, the "
                         f"file has {c.remaining()}")
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor #{i} name", keep=True)
            n_dims = c.u32(f"tensor {name!r}: dimension count")
            if not 1 <= n_dims <= _GGUF_MAX_DIMS:
                raise c.fail(f"tensor {name!r}: {n_dims} dimensions (1 to {_GGUF_MAX_DIMS})")
            dims = c.unpack("Q" * n_dims, f"tensor {name!r}: dimensions")
            ttype, offset = c.u32(f"tensor {name!r}: type"), c.u64(f"tensor {name!r}: offset")
            infos.append((name, dims, ttype, offset))
        data_start = c.pos + (-c.pos % alignment)
        data_len = len(buf) - data_start
        for name, dims, ttype, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise c.fail(f"tensor {name!r}: unknown tensor type {ttype}") from None
            if dims[0] % block:
                raise c.fail(f"tensor {name!r}: first dimension {dims[0]} is not a multiple of its type's block "
                             f"({block})")
            numel = 1
            for d in dims:
                numel *= d
            nbytes = numel // block * type_size
            if offset + nbytes > data_len:
                raise c.fail(f"tensor {name!r}: bytes [{offset}, {offset + nbytes}) lie beyond the data section "
                             f"({data_len} bytes)")
