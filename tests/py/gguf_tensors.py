"""The tensors of a GGUF file (name, type, shape, bytes) without parsing its metadata values.

The gguf package's GGUFReader builds a numpy view for every element of every metadata array: about 9 s
for a Qwen file's 151,646-token vocabulary and 12 s for Gemma 3's 262,144, each time a file is opened.
Tests that only need tensor bytes (their hashes, or dequantizing them with the gguf package) read them
here: the metadata is stepped over by its declared sizes (GGUF v2/v3 as the format's specification gives
it; written from the spec, not from Serval's reader), and only the tensor table is decoded. The tests
that check metadata keep GGUFReader, so every file format is still read by the gguf package somewhere.
"""
import dataclasses
import hashlib
import mmap
import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Sizes of the fixed-size metadata value types (GGUF value type ids 0-12; 8 is a string, 9 an array).
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclasses.dataclass
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple  # GGUF order: the row length first
    data: np.ndarray  # uint8, [rows, row bytes]

    def sha256(self) -> str:
        return hashlib.sha256(self.data.tobytes()).hexdigest()


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string(self):
        n = self.take("<Q")
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s.decode("utf-8")

    def skip_value(self, vtype):
        if vtype in _SCALAR:
            self.pos += _SCALAR[vtype]
        elif vtype == 8:
            n = self.take("<Q")  # a string: its length, then its bytes
            self.pos += n
        elif vtype == 9:
            etype, count = self.take("<IQ")
            if etype in _SCALAR:
                self.pos += count * _SCALAR[etype]
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")


def read_tensors(path) -> list[Tensor]:
    """Every tensor of the GGUF file at `path`, in file order (the data are views of a read-only map)."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(buf)
    magic, version = c.take("<4sI")
    assert magic == b"GGUF" and version in (2, 3), (path, magic, version)
    n_tensors, n_kv = c.take("<QQ")
    alignment = 32
    for _ in range(n_kv):
        key = c.string()
        vtype = c.take("<I")
        if key == "general.alignment":
            assert vtype == 4, vtype
            alignment = c.take("<I")
        else:
            c.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.take("<I")
        shape = tuple(c.take("<Q") for _ in range(n_dims))
        ttype, offset = c.take("<IQ")
        infos.append((name, GGMLQuantizationType(ttype), shape, offset))
    data_start = (c.pos + alignment - 1) // alignment * alignment
    whole = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, ttype, shape, offset in infos:
        block_elems, block_bytes = GGML_QUANT_SIZES[ttype]
        row_bytes = shape[0] // block_elems * block_bytes
        rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        start = data_start + offset
        data = whole[start:start + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(Tensor(name, ttype, shape, data))
    return tensors
