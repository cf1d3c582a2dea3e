"""Safetensors files read and written with numpy alone (the test suite has no torch): F16, F32 and U8."""
import json
import struct

import numpy as np

DTYPES = {"F16": np.float16, "F32": np.float32, "U8": np.uint8}


def read_safetensors(path):
    """{name: array} of a safetensors file (its __metadata__ left out)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + b:8 + n + end], dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
    return out


def write_safetensors(path, tensors):
    """Writes {name: array} (F16, F32 or U8 arrays) in name order, the header padded to 8 bytes."""
    names = {np.dtype(v): k for k, v in DTYPES.items()}
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
