"""A GGUF file's header read within fixed bounds, before any of its data: the metadata (counts,
string and array lengths, the whole header's bytes bounded), the tensor infos, and their layout as
ggml's own `gguf.cpp` requires it (each tensor's offset the previous one's end rounded up to the
alignment, the first at 0) with each size computed from its shape and type, only the types
llama.cpp's `convert_lora_to_gguf.py` writes (F32, F16, BF16, Q8_0), and the data inside the file.
Nothing here costs more than the bounds allow, whatever the file declares."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import BinaryIO

from compiled_engine.lora.weights import AdapterError

MAX_HEADER_BYTES = 4 << 20  # metadata and tensor infos together
MAX_TENSORS = 4096
MAX_KV = 1024
MAX_NAME_BYTES = 256  # a key or a tensor's name
MAX_STRING_BYTES = 64 << 10  # a string value (one in an array included)
MAX_ARRAY_ELEMENTS = 1 << 16  # over all the arrays of the metadata
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_DIM = 1 << 20  # one dimension of a tensor
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml type id -> (name, elements per block, bytes per block)
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 8: ("Q8_0", 32, 34)}

_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_UINT32 = 4
_FIRST_READ = 64 << 10


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # in torch's order (ggml's `ne` reversed)
    type_id: int  # a key of TYPES
    offset: int  # of its data in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """`metadata`: each key's value; strings and numbers as read, an array as None (skipped)."""

    metadata: dict[str, object]
    tensors: list[TensorInfo]


def read_header(f: BinaryIO, where: str) -> GGUFHeader:
    """The header of the GGUF file open as `f` (read from its start), its layout checked against
    the file's size; AdapterError naming the bound or the rule a file breaks (`where` names it)."""
    size = f.seek(0, 2)
    f.seek(0)
    cursor = _Cursor(f, size, where)
    if cursor.take(4) != b"GGUF":
        raise AdapterError(f"{where}: not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = cursor.unpack("<IQQ")
    if version not in VERSIONS:
        raise AdapterError(f"{where}: GGUF version {version} (read: {VERSIONS}, little-endian)")
    _check_count(n_tensors, MAX_TENSORS, "tensors", where)
    _check_count(n_kv, MAX_KV, "metadata keys", where)
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = cursor.string(MAX_NAME_BYTES, "a metadata key")
        if key in metadata:
            raise AdapterError(f"{where}: metadata key {key!r} appears twice")
        (value_type,) = cursor.unpack("<I")
        metadata[key] = cursor.value(value_type, key)
        if key == "general.alignment" and value_type != _UINT32:
            raise AdapterError(f"{where}: general.alignment is not a u32")
    alignment = _alignment(metadata, where)
    infos = [_tensor_info(cursor) for _ in range(n_tensors)]
    data_start = -(-cursor.pos // alignment) * alignment
    return GGUFHeader(metadata, _layout(infos, data_start, alignment, size, where))


def _check_count(count: int, limit: int, what: str, where: str) -> None:
    if count > limit:
        raise AdapterError(f"{where}: {count} {what}, more than the {limit} an adapter may have")


def _alignment(metadata: dict[str, object], where: str) -> int:
    """`general.alignment` (a power of two, gguf.cpp's rule) or the default."""
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))  # a u32 (as read)
    if alignment == 0 or alignment & (alignment - 1):
        raise AdapterError(f"{where}: general.alignment {alignment} is not a power of two")
    return alignment


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string(MAX_NAME_BYTES, "a tensor name")
    (n_dims,) = cursor.unpack("<I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise AdapterError(f"{cursor.where}: tensor {name!r} has {n_dims} dimensions (1 to "
                           f"{MAX_DIMS})")
    ne = cursor.unpack(f"<{n_dims}Q")
    if not all(1 <= n <= MAX_DIM for n in ne):
        raise AdapterError(f"{cursor.where}: tensor {name!r} has dimensions {list(ne)} (each 1 "
                           f"to {MAX_DIM})")
    type_id, offset = cursor.unpack("<IQ")
    return name, tuple(reversed(ne)), type_id, offset


def _layout(infos: list[tuple[str, tuple[int, ...], int, int]], data_start: int, alignment: int,
            size: int, where: str) -> list[TensorInfo]:
    """The tensors, each of a served type, at the next packed offset (gguf.cpp's rule: no two
    share bytes), and all of them inside the file."""
    tensors, names, expected = [], set(), 0
    for name, shape, type_id, offset in infos:
        if name in names:
            raise AdapterError(f"{where}: tensor {name!r} appears twice")
        names.add(name)
        if type_id not in TYPES:
            raise AdapterError(f"{where}: tensor {name!r} has ggml type {type_id}; an adapter's "
                               f"may be {', '.join(t[0] for t in TYPES.values())}")
        type_name, block, block_bytes = TYPES[type_id]
        if shape[-1] % block:
            raise AdapterError(f"{where}: tensor {name!r} of type {type_name} has rows of "
                               f"{shape[-1]}, not a multiple of {block}")
        nbytes = math.prod(shape) // block * block_bytes
        if offset != expected:
            raise AdapterError(f"{where}: tensor {name!r} at offset {offset} of the data, not "
                               f"{expected} where the one before it ends (tensors must be packed "
                               "in order, each once)")
        end = data_start + offset + nbytes
        if end > size:
            raise AdapterError(f"{where}: tensor {name!r} ends at byte {end}, past the end of the "
                               f"file ({size} bytes)")
        tensors.append(TensorInfo(name, shape, type_id, data_start + offset, nbytes))
        expected = -(-(offset + nbytes) // alignment) * alignment
    return tensors


class _Cursor:
    """Reads a header's fields from the file's first bytes, read as they are needed (at most
    MAX_HEADER_BYTES of them); counts the metadata arrays' elements."""

    def __init__(self, f: BinaryIO, size: int, where: str) -> None:
        self.f, self.size, self.where, self.pos = f, size, where, 0
        self.data = bytearray()
        self.array_elements = 0

    def take(self, n: int) -> bytes:
        start = self.skip(n)
        return bytes(self.data[start:self.pos])

    def skip(self, n: int) -> int:
        """Past `n` bytes; where they start."""
        start, end = self.pos, self.pos + n
        if end > MAX_HEADER_BYTES:
            raise AdapterError(f"{self.where}: GGUF header larger than {MAX_HEADER_BYTES} bytes")
        if end > self.size:
            raise AdapterError(f"{self.where}: GGUF header truncated")
        if end > len(self.data):
            want = min(max(end, 2 * len(self.data), _FIRST_READ), MAX_HEADER_BYTES, self.size)
            self.data += self.f.read(want - len(self.data))
            if end > len(self.data):
                raise AdapterError(f"{self.where}: GGUF header truncated (the file changed?)")
        self.pos = end
        return start

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def string(self, limit: int, what: str) -> str:
        (n,) = self.unpack("<Q")
        if n > limit:
            raise AdapterError(f"{self.where}: {what} of {n} bytes, more than {limit}")
        try:
            return self.take(n).decode()
        except UnicodeDecodeError:
            raise AdapterError(f"{self.where}: {what} is not UTF-8") from None

    def value(self, value_type: int, key: str) -> object:
        """A metadata value; an array is skipped (None), its elements counted."""
        if value_type == _STRING:
            return self.string(MAX_STRING_BYTES, f"the value of {key!r}")
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])[0]
        if value_type != _ARRAY:
            raise AdapterError(f"{self.where}: metadata key {key!r} has value type {value_type}")
        item_type, count = self.unpack("<IQ")
        self.array_elements += count
        if self.array_elements > MAX_ARRAY_ELEMENTS:
            raise AdapterError(f"{self.where}: metadata arrays of more than {MAX_ARRAY_ELEMENTS} "
                               f"elements in all ({key!r} has {count})")
        if item_type in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[item_type]))
        elif item_type == _STRING:
            for _ in range(count):
                (n,) = self.unpack("<Q")
                if n > MAX_STRING_BYTES:
                    raise AdapterError(f"{self.where}: a string of {n} bytes in {key!r}, more "
                                       f"than {MAX_STRING_BYTES}")
                self.skip(n)
        else:
            raise AdapterError(f"{self.where}: metadata key {key!r} is an array of value type "
                               f"{item_type} (arrays of arrays or of unknown types are not read)")
        return None

