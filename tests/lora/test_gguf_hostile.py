"""GGUF LoRA files as a hostile client writes them are refused, naming the bound or rule broken,
before any tensor's data is read: tensors that share bytes (the loading process grows by no more
than a few times the file), metadata past its bounds (counts, string and array lengths, the
header's bytes), types the converters do not write, offsets not packed or past the file, shapes
that are not the model's projections', ranks above the limit; non-finite weights are refused in
GGUF and PEFT files. Valid files of every type the converter writes read as the gguf package
reads them."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from compiled_engine.lora.registry import read_adapter
from compiled_engine.lora.slots import LoRASlots
from compiled_engine.lora.weights import AdapterError
from compiled_engine.models.gguf_checkpoint import unpermute_rotary_rows
from compiled_engine.models.llama import LlamaForCausalLM
from tests.lora.gguf_files import (
    ADAPTER_KV,
    ARRAY,
    F32,
    INT8,
    Q4_K,
    STRING,
    aliased,
    kv_array,
    kv_string,
    kv_u32,
    metadata_bomb,
    string,
    write_gguf,
)

CONFIG = dict(hidden_size=128, intermediate_size=256, vocab_size=2000, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2)
MAX_RANK = 32
HEADS = {"q_proj": 4, "k_proj": 2}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def slots() -> LoRASlots:
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    return LoRASlots(model, 1, MAX_RANK, torch.float32, torch.device("cpu"))


def _refused(path: str, slots: LoRASlots, message: str) -> None:
    with pytest.raises(AdapterError, match=message):
        read_adapter(path, slots)


# the loading process: its growth in bytes (its peak RSS, reset before each load (Linux's
# clear_refs), less its RSS before) and what it raised
MEASURE = """
import json, re, sys
import torch
from transformers import LlamaConfig
from compiled_engine.lora.registry import read_adapter
from compiled_engine.lora.slots import LoRASlots
from compiled_engine.lora.weights import AdapterError
from compiled_engine.models.llama import LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(**json.loads(sys.argv[1])))
slots = LoRASlots(model, 1, int(sys.argv[2]), torch.float32, torch.device("cpu"))
def kib(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
out = []
for path in sys.argv[3:]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) back to the RSS now
    rss = kib("VmRSS")
    try:
        read_adapter(path, slots)
        error = None
    except AdapterError as e:
        error = str(e)
    out.append({"error": error, "growth": (kib("VmHWM") - rss) * 1024})
print(json.dumps(out))
"""


def test_aliased_tensors_and_a_metadata_bomb_are_refused_in_bounded_memory(tmp_path) -> None:
    """40 tensors on one 4 MiB block (a reader that dequantizes each holds 40 times it) and an
    array of 10M int8s in the metadata (a pure-Python reader walks each): refused, the loading
    process growing by less than 4 times the file and 64 MiB."""
    files = [aliased(tmp_path / "aliased.gguf"), metadata_bomb(tmp_path / "bomb.gguf")]
    done = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(CONFIG), str(MAX_RANK),
                           *files], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    aliased_run, bomb_run = json.loads(done.stdout)
    assert "at offset 0 of the data, not 4194304 where the one before it ends" in (
        aliased_run["error"] or ""), aliased_run
    assert "metadata arrays of more than 65536 elements in all ('general.tags' has 10000000)" in (
        bomb_run["error"] or ""), bomb_run
    for run, file in zip((aliased_run, bomb_run), files, strict=True):
        assert run["growth"] < 4 * Path(file).stat().st_size + (64 << 20), run


def _tensor(name: str, shape: tuple[int, ...], type_id: int = F32,
            offset: int = 0) -> tuple[str, tuple[int, ...], int, int]:
    return name, shape, type_id, offset


Q_A, Q_B = "blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b"
RANK = 8
A_BYTES = RANK * 128 * 4  # q's A [8, 128] in F32; B [128, 8] as many


def _truncated(path: str, size: int) -> str:
    os.truncate(path, size)
    return path


def _metadata_cases(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (file, what its refusal says)."""
    def gguf_file(name: str, kv: list[bytes], tensors: list = (), **counts) -> str:
        return write_gguf(tmp_path / f"{name}.gguf", kv, list(tensors), **counts)

    strings = b"".join(string("x") for _ in range(100_000))
    wide = [kv_string(f"general.k{i}", "x" * 60_000) for i in range(80)]
    return {
        "many strings": (gguf_file("strings", [*ADAPTER_KV, kv_array("general.tags", STRING,
                                                                     100_000, strings)]),
                         r"metadata arrays of more than 65536 elements in all \('general.tags' "
                         r"has 100000\)"),
        "a huge string": (gguf_file("string", [*ADAPTER_KV, string("general.name")
                                               + struct.pack("<IQ", STRING, 1 << 40)]),
                          "the value of 'general.name' of 1099511627776 bytes, more than 65536"),
        "a huge key": (gguf_file("key", [struct.pack("<Q", 1 << 62)]),
                       "a metadata key of 4611686018427387904 bytes, more than 256"),
        "a string in an array": (gguf_file("item", [*ADAPTER_KV, kv_array(
            "general.tags", STRING, 1, struct.pack("<Q", 1 << 40))]),
                                 "a string of 1099511627776 bytes in 'general.tags'"),
        "a nested array": (gguf_file("nested", [*ADAPTER_KV, kv_array(
            "general.tags", ARRAY, 1, struct.pack("<IQ", INT8, 0))]),
                           "is an array of value type 9 \\(arrays of arrays"),
        "many tensors": (gguf_file("tensors", ADAPTER_KV, n_tensors=1 << 40),
                         "1099511627776 tensors, more than the 4096 an adapter may have"),
        "many keys": (gguf_file("keys", ADAPTER_KV, n_kv=1 << 40),
                      "1099511627776 metadata keys, more than the 1024 an adapter may have"),
        "a long header": (gguf_file("wide", [*ADAPTER_KV, *wide]),
                          "GGUF header larger than 4194304 bytes"),
        "a truncated header": (_truncated(gguf_file("short", ADAPTER_KV), 40),
                               "GGUF header truncated"),
        "a duplicate key": (gguf_file("twice", [*ADAPTER_KV, ADAPTER_KV[0]]),
                            "metadata key 'general.architecture' appears twice"),
        "an odd alignment": (gguf_file("align", [*ADAPTER_KV, kv_u32("general.alignment", 48)]),
                             "general.alignment 48 is not a power of two"),
    }


def test_metadata_past_its_bounds_is_refused(slots, tmp_path) -> None:
    for path, message in _metadata_cases(tmp_path).values():
        _refused(path, slots, message)


def _layout_cases(tmp_path: Path) -> dict[str, tuple[str, str]]:
    def gguf_file(name: str, tensors: list, data_bytes: int = 2 * A_BYTES) -> str:
        return write_gguf(tmp_path / f"{name}.gguf", ADAPTER_KV, tensors, bytes(data_bytes))

    a, b = (RANK, 128), (128, RANK)
    return {
        "a type no converter writes": (
            gguf_file("q4k", [_tensor(Q_A, (RANK, 256), Q4_K)]),
            f"tensor '{Q_A}' has ggml type 12; an adapter's may be F32, F16, BF16, Q8_0"),
        "a gap": (gguf_file("gap", [_tensor(Q_A, a), _tensor(Q_B, b, offset=A_BYTES + 32)],
                            3 * A_BYTES),
                  f"tensor '{Q_B}' at offset {A_BYTES + 32} of the data, not {A_BYTES}"),
        "overlap": (gguf_file("overlap", [_tensor(Q_A, a), _tensor(Q_B, b, offset=A_BYTES // 2)]),
                    f"tensor '{Q_B}' at offset {A_BYTES // 2} of the data, not {A_BYTES}"),
        "out of order": (gguf_file("order", [_tensor(Q_B, b, offset=A_BYTES), _tensor(Q_A, a)]),
                         f"tensor '{Q_B}' at offset {A_BYTES} of the data, not 0"),
        "past the file": (gguf_file("past", [_tensor(Q_A, a), _tensor(Q_B, b, offset=A_BYTES)],
                                    A_BYTES + 100),
                          f"tensor '{Q_B}' ends at byte .*, past the end of the file"),
        "a huge dimension": (gguf_file("huge", [_tensor(Q_A, (RANK, 1 << 40))]),
                             rf"tensor '{Q_A}' has dimensions \[1099511627776, 8\]"),
        "a duplicate name": (gguf_file("dup", [_tensor(Q_A, a), _tensor(Q_A, a, offset=A_BYTES)]),
                             f"tensor '{Q_A}' appears twice"),
        "Q8_0 rows not of whole blocks": (gguf_file("q8", [_tensor(Q_A, (RANK, 100), 8)]),
                                          "has rows of 100, not a multiple of 32"),
    }


def test_a_layout_ggml_would_refuse_is_refused(slots, tmp_path) -> None:
    for path, message in _layout_cases(tmp_path).values():
        _refused(path, slots, message)


def test_shapes_and_ranks_are_checked_against_the_model_before_the_data(slots, tmp_path) -> None:
    def pair(name: str, a: tuple[int, int], b: tuple[int, int], module: str = "attn_q") -> str:
        nbytes = 4 * math.prod(a)
        tensors = [_tensor(f"blk.0.{module}.weight.lora_a", a),
                   _tensor(f"blk.0.{module}.weight.lora_b", b, offset=-(-nbytes // 32) * 32)]
        return write_gguf(tmp_path / f"{name}.gguf", ADAPTER_KV, tensors,
                          bytes(-(-nbytes // 32) * 32 + 4 * math.prod(b)))

    cases = {
        pair("narrow", (RANK, 64), (128, RANK)): "maps 64 -> 128 features, the model's "
                                                 "projection 128 -> 128",
        pair("k", (RANK, 128), (128, RANK), "attn_k"): "maps 128 -> 128 features, the model's "
                                                       "projection 128 -> 64",
        pair("rank", (64, 128), (128, 64)): "has rank 64, above the server's --max-lora-rank 32",
        pair("ranks", (RANK, 128), (128, 4)): r"has A \[8, 128\] and B \[128, 4\]",
        write_gguf(tmp_path / "3d.gguf", ADAPTER_KV, [_tensor(Q_A, (1, RANK, 128))],
                   bytes(A_BYTES)): r"has shape \[1, 8, 128\], not 2-D",
    }
    for path, message in cases.items():
        _refused(path, slots, message)


def _random_adapter(path: Path, qtype: gguf.GGMLQuantizationType, alpha: float = 16.0,
                    poison: float | None = None) -> dict[str, np.ndarray]:
    """A llama adapter of q, k and down of layers 0 and 3, written by gguf's GGUFWriter as the
    converter writes `qtype` (rank 32: Q8_0's rows are whole blocks); `poison` in one of q's A."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    written = {}
    shapes = {"attn_q": (128, 128), "attn_k": (128, 64), "ffn_down": (256, 128)}
    for layer in (0, 3):
        for module, (fan_in, fan_out) in shapes.items():
            for which, shape in (("lora_a", (MAX_RANK, fan_in)), ("lora_b", (fan_out, MAX_RANK))):
                w = rng.normal(0, 0.2, shape).astype(np.float32)
                if poison is not None and (layer, module, which) == (3, "attn_q", "lora_a"):
                    w[1, 2] = poison
                name = f"blk.{layer}.{module}.weight.{which}"
                writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
                written[name] = w
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file,
                  writer.write_tensors_to_file, writer.close):
        write()
    return written


HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "ffn_down": "mlp.down_proj"}


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0"])
def test_each_type_the_converter_writes_reads_as_the_gguf_package_does(slots, tmp_path,
                                                                      qtype) -> None:
    """Every tensor as gguf's own GGUFReader and dequantize read it: q's and k's B rows put back
    in Hugging Face's order, B scaled by alpha / rank."""
    path = tmp_path / f"{qtype}.gguf"
    _random_adapter(path, gguf.GGMLQuantizationType[qtype])
    weights = read_adapter(str(path), slots)
    assert weights.rank == MAX_RANK
    reader = gguf.GGUFReader(str(path))
    expected = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(values, np.float32)).reshape(tuple(reversed(t.shape)))
        block, module, _, which = t.name.split(".")[1:]
        if which == "lora_b":
            leaf = HF[module].rsplit(".", 1)[1]
            w = (unpermute_rotary_rows(w, HEADS[leaf]) if leaf in HEADS else w) * (16 / MAX_RANK)
        expected.setdefault(f"model.layers.{block}.{HF[module]}", {})[which] = w
    assert sorted(weights.modules) == sorted(expected)
    for module, (a, b) in weights.modules.items():
        assert torch.equal(a, expected[module]["lora_a"]), module
        assert torch.equal(b, expected[module]["lora_b"]), module
    slots.check(weights, qtype)


def test_non_finite_weights_are_refused(slots, tmp_path) -> None:
    for bad in (float("nan"), float("inf")):
        path = tmp_path / f"{bad}.gguf"
        _random_adapter(path, gguf.GGMLQuantizationType.F16, poison=bad)
        _refused(str(path), slots, "tensor 'blk.3.attn_q.weight.lora_a' holds NaN or infinite "
                                   "values")
    alpha = tmp_path / "alpha.gguf"
    _random_adapter(alpha, gguf.GGMLQuantizationType.F32, alpha=float("inf"))
    _refused(str(alpha), slots, "adapter.lora.alpha inf is not a finite number")
    folder = tmp_path / "peft"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    a = torch.zeros(4, 128)
    a[0, 0] = float("nan")
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{module}.lora_A.weight": a, f"{module}.lora_B.weight": torch.zeros(128, 4)},
              folder / "adapter_model.safetensors")
    _refused(str(folder), slots, "'model.layers.0.self_attn.q_proj' holds NaN or infinite values")

