"""GGUF files written byte by byte, as a hostile client would (any count, length, type or offset,
whatever the data holds), and the hostile adapters the tests try: tensors that share one data
block, and a metadata bomb."""

from __future__ import annotations

import struct
from pathlib import Path

F32, F16, Q8_0, Q4_K, BF16 = 0, 1, 8, 12, 30
UINT32, INT8, FLOAT32, STRING, ARRAY = 4, 1, 6, 8, 9
# the tensors of a 4-layer llama a test adapter may target (GGUF names)
MODULES = [f"blk.{i}.{m}.weight" for i in range(4)
           for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up")]


def string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def kv_string(key: str, value: str) -> bytes:
    return string(key) + struct.pack("<I", STRING) + string(value)


def kv_f32(key: str, value: float) -> bytes:
    return string(key) + struct.pack("<If", FLOAT32, value)


def kv_u32(key: str, value: int) -> bytes:
    return string(key) + struct.pack("<II", UINT32, value)


def kv_array(key: str, item_type: int, count: int, items: bytes) -> bytes:
    return string(key) + struct.pack("<IIQ", ARRAY, item_type, count) + items


ADAPTER_KV = [kv_string("general.architecture", "llama"), kv_string("general.type", "adapter"),
              kv_string("adapter.type", "lora"), kv_f32("adapter.lora.alpha", 16.0)]


def write_gguf(path: Path, kv: list[bytes], tensors: list[tuple[str, tuple[int, ...], int, int]],
               data: bytes = b"", n_tensors: int | None = None, n_kv: int | None = None) -> str:
    """A GGUF v3 file: `kv` (encoded pairs), `tensors` (name, shape in torch's order, ggml type,
    offset), then `data` at the next 32-byte boundary; the counts as declared when given."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kv) if n_kv is None else n_kv)
    infos = b"".join(string(name) + struct.pack(f"<I{len(shape)}Q", len(shape), *shape[::-1])
                     + struct.pack("<IQ", type_id, offset)
                     for name, shape, type_id, offset in tensors)
    header = head + b"".join(kv) + infos
    path.write_bytes(header + bytes(-len(header) % 32) + data)
    return str(path)


def aliased(path: Path, data_bytes: int = 4 << 20) -> str:
    """A 4-layer llama adapter of 40 F16 tensors all at offset 0 of one `data_bytes` block: a
    reader that dequantizes each holds 40 times the block in fp32."""
    elements = data_bytes // 2
    shape = (elements // 1024, 1024)
    tensors = [(f"{m}.{which}", shape, F16, 0) for m in MODULES for which in ("lora_a", "lora_b")]
    return write_gguf(path, ADAPTER_KV, tensors, bytes(data_bytes))


def metadata_bomb(path: Path, elements: int = 10_000_000) -> str:
    """An adapter whose metadata holds an array of `elements` int8s (and no tensors)."""
    bomb = kv_array("general.tags", INT8, elements, bytes(elements))
    return write_gguf(path, [*ADAPTER_KV, bomb], [])
