"""The GGUF container: its metadata and its tensors' places, read from a memory map.

The gguf package's own reader builds a numpy view for every part of every field, which for a
vocabulary of 150k tokens and as many merges takes about 13 s (2-core Zen 5) before the first
tensor is read; this reads the same header in well under a second. The gguf package still
knows the types (``GGMLQuantizationType``, block sizes) and dequantizes them.

Layout (little-endian; GGUF versions 2 and 3): "GGUF", version u32, tensor count u64, field
count u64; fields: key (u64 length + UTF-8), value type u32, value (arrays: element type u32,
count u64, elements); tensor infos: name, dimension count u32, dimensions u64 (innermost first),
type u32, offset u64 from the data section, which starts at the next multiple of
``general.alignment`` (32) after the infos.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anna.model.config import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
         10: np.uint64, 11: np.int64, 12: np.float64}
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # GGMLQuantizationType's name: F32, F16, BF16, Q4_0, Q6_K, ...
    shape: tuple[int, ...]  # GGUF order: the innermost (contiguous) dimension first
    offset: int  # in the file
    nbytes: int
    file: "GGUFFile"

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def data(self) -> np.ndarray:
        """A read-only view, outermost dimension first: float types as their values, the others as
        bytes (each row of the innermost dimension its blocks' bytes)."""
        rows = tuple(reversed(self.shape[1:]))
        raw = np.frombuffer(self.file.map, dtype=np.uint8, count=self.nbytes, offset=self.offset)
        if self.type_name in FLOAT_DTYPES:
            return raw.view(FLOAT_DTYPES[self.type_name]).reshape(*rows, self.shape[0])
        return raw.reshape(*rows, -1)


class GGUFFile:
    def __init__(self, path: Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        try:
            with open(path, "rb") as fh:
                self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read the file ({exc})") from None
        self.buf = memoryview(self.map)
        try:
            if bytes(self.buf[:4]) != MAGIC:
                raise ModelLoadError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
            version, n_tensors, n_fields = struct.unpack_from("<IQQ", self.buf, 4)
            if version not in VERSIONS:
                raise ModelLoadError(f"{path}: GGUF version {version} (Anna reads versions 2 and 3)")
            pos = 24
            self.fields: dict[str, Any] = {}
            for _ in range(n_fields):
                key, pos = self._string(pos)
                (vtype,), pos = struct.unpack_from("<I", self.buf, pos), pos + 4
                self.fields[key], pos = self._value(vtype, pos)
            infos = []
            for _ in range(n_tensors):
                name, pos = self._string(pos)
                (dims,), pos = struct.unpack_from("<I", self.buf, pos), pos + 4
                shape = struct.unpack_from(f"<{dims}Q", self.buf, pos)
                pos += 8 * dims
                qtype, offset = struct.unpack_from("<IQ", self.buf, pos)
                pos += 12
                infos.append((name, qtype, shape, offset))
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ModelLoadError(f"{path}: a damaged GGUF header ({exc})") from None
        align = int(self.fields.get("general.alignment", 32))
        start = -(-pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, qtype, shape, offset in infos:
            try:
                kind = GGMLQuantizationType(qtype)
            except ValueError:
                raise ModelLoadError(f"{path}: tensor {name} has GGUF type {qtype}, unknown to the gguf package") \
                    from None
            block, size = GGML_QUANT_SIZES[kind]
            nbytes = int(np.prod(shape)) // block * size
            if start + offset + nbytes > len(self.map):
                raise ModelLoadError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors.append(GGUFTensor(name, kind.name, tuple(int(d) for d in shape), start + offset, nbytes, self))

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self.buf, pos)
        return str(self.buf[pos + 8:pos + 8 + n], "utf-8"), pos + 8 + n

    def _value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype == STRING:
            return self._string(pos)
        if vtype in SCALARS:
            fmt = SCALARS[vtype]
            return struct.unpack_from(fmt, self.buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype != ARRAY:
            raise ModelLoadError(f"{self.path}: GGUF value type {vtype} is unknown")
        sub, count = struct.unpack_from("<IQ", self.buf, pos)
        pos += 12
        if sub in NUMPY:
            values = np.frombuffer(self.map, dtype=NUMPY[sub], count=count, offset=pos)
            return values.tolist(), pos + values.nbytes
        out = []
        for _ in range(count):
            value, pos = self._value(sub, pos)
            out.append(value)
        return out, pos
