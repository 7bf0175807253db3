"""LoRA adapters in the engine: the prefix cache never shares a prefix across adapters, a bad
adapter is refused with a message and changes nothing, an adapter in use is not unloaded, one
unloaded is gone and its name can be loaded again; a file larger than the model's largest adapter
is refused unread, as are a GGUF file whose tensors share one block and a metadata bomb."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from compiled_engine.llm import LLM
from compiled_engine.lora.request import LoRARequest
from compiled_engine.lora.weights import AdapterError
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.scheduler.validation import RequestRejected
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.lora import gguf_adapter, llama_with_adapters, make_adapter, peft_greedy
from tests.lora.gguf_files import aliased, metadata_bomb

SHAPE = dict(hidden_size=128, intermediate_size=256, vocab_size=2000)
PROMPT = list(range(3, 60))  # long enough to fill cached pages
NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    base, paths = llama_with_adapters(root, **SHAPE)
    llm = LLM(base, dtype="float32", enforce_eager=True, enable_lora=True, max_loras=2,
              max_lora_rank=16, max_cpu_loras=4, page_size=4)
    return root, base, paths, llm


def _tokens(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> list[int]:
    return llm.generate([prompt], GREEDY, lora_request=lora)[0].outputs[0].token_ids


def test_the_prefix_cache_never_crosses_adapters(setup) -> None:
    _, base, paths, llm = setup
    stats = llm.engine.scheduler.stats
    a, b = LoRARequest("a", 1, paths["a"]), LoRARequest("b", 2, paths["b"])
    ref = {name: peft_greedy(base, paths.get(name), [PROMPT], NEW)[0] for name in ("a", "b", None)}
    hits = stats().prefix_cache_hits
    assert _tokens(llm, PROMPT, a) == ref["a"]
    assert _tokens(llm, PROMPT, b) == ref["b"]
    assert _tokens(llm, PROMPT, None) == ref[None]
    assert stats().prefix_cache_hits == hits, "a prompt hit another adapter's cached prefix"
    assert _tokens(llm, PROMPT, a) == ref["a"]  # its own prefix: a hit
    assert stats().prefix_cache_hits > hits


def _write_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def test_a_bad_adapter_is_refused_and_changes_nothing(setup, tmp_path) -> None:
    root, base, paths, llm = setup
    other = make_checkpoint(str(tmp_path / "other"), "LlamaForCausalLM", hidden_size=64,
                            intermediate_size=128, vocab_size=2000)
    wrong_shape = make_adapter(other, str(tmp_path / "wrong"), ["q_proj"], 4)
    big = make_adapter(base, str(tmp_path / "big"), ["q_proj"], 32)
    head = make_adapter(base, str(tmp_path / "head"), ["lm_head"], 4)
    dora = Path(make_adapter(base, str(tmp_path / "dora"), ["q_proj"], 4))
    _write_config(dora, use_dora=True)
    deep = Path(make_adapter(base, str(tmp_path / "deep"), ["q_proj"], 4))  # a layer it lacks
    tensors = load_file(deep / "adapter_model.safetensors")
    moved = {k.replace("layers.0.", "layers.99."): v.clone() for k, v in tensors.items()}
    save_file(tensors | moved, deep / "adapter_model.safetensors")
    huge = Path(make_adapter(base, str(tmp_path / "huge"), ["q_proj"], 4))
    os.truncate(huge / "adapter_model.safetensors", 1 << 40)  # sparse: refused unread
    huge_config = Path(make_adapter(base, str(tmp_path / "huge-config"), ["q_proj"], 4))
    os.truncate(huge_config / "adapter_config.json", 1 << 30)
    far = str(tmp_path / "far.gguf")  # a block far past the model's layers: refused, not walked to
    writer = gguf.GGUFWriter(far, "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_tensor("blk.2000000000.attn_q.weight.lora_a", np.zeros((4, 128), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    huge_gguf = tmp_path / "huge.gguf"
    huge_gguf.touch()
    os.truncate(huge_gguf, 1 << 40)
    cases = {
        wrong_shape: "maps 64 -> 64 features, the model's projection 128 -> 64",
        big: "rank 32, above the server's --max-lora-rank 16",
        head: "'base_model.model.lm_head.base_layer.weight' is not a LoRA A or B weight",
        str(deep): "targets 'model.layers.99.self_attn.q_proj', which this model does not have",
        str(dora): "use_dora=True is not served",
        str(tmp_path / "missing"): "no adapter at",
        str(root / "base"): "no adapter_config.json",
        str(huge): "has 1099511627776 bytes, more than an adapter of this model can",
        str(huge_config): "has 1073741824 bytes, more than an adapter of this model can",
        str(huge_gguf): "has 1099511627776 bytes, more than an adapter of this model can",
        "/dev/zero": "no adapter_config.json",
        far: "a tensor of block 2000000000, the model has 2 layers",
        aliased(tmp_path / "aliased.gguf"): "at offset 0 of the data, not 4194304 where the one "
                                            "before it ends",
        metadata_bomb(tmp_path / "bomb.gguf"): "metadata arrays of more than 65536 elements",
    }
    before = llm.engine.lora_paths()
    for path, message in cases.items():
        with pytest.raises(AdapterError, match=re.escape(message)):
            llm.engine.add_lora("bad", path)
        assert llm.engine.lora_paths() == before
    a = LoRARequest("a", 1, paths["a"])
    assert _tokens(llm, PROMPT, a) == peft_greedy(base, paths["a"], [PROMPT], NEW)[0]


def test_an_adapter_in_use_is_not_unloaded(setup) -> None:
    _, base, paths, llm = setup
    engine = llm.engine
    engine.add_lora("c", paths["c"])
    engine.add_request("uses-c", PROMPT, GREEDY, lora_name="c")
    engine.step()
    assert engine.remove_lora("c") is False  # a request runs with it
    while engine.has_work():
        engine.step()
    assert engine.remove_lora("c") is True
    assert "c" not in engine.lora_paths()
    with pytest.raises(RequestRejected, match="no LoRA adapter named 'c' is loaded"):
        engine.add_request("after", PROMPT, GREEDY, lora_name="c")
    with pytest.raises(KeyError):
        engine.remove_lora("c")
    # the name again, another adapter's files: its tokens
    engine.add_lora("c", paths["b"])
    got = _tokens(llm, PROMPT, LoRARequest("c", 3, paths["b"]))
    assert got == peft_greedy(base, paths["b"], [PROMPT], NEW)[0]
    engine.remove_lora("c")


def test_no_more_adapters_than_max_cpu_loras(setup) -> None:
    _, _, paths, llm = setup
    engine = llm.engine
    loaded = dict(engine.lora_paths())
    extra = [f"x{i}" for i in range(4 - len(loaded))]
    for name in extra:
        engine.add_lora(name, paths["a"])
    with pytest.raises(AdapterError, match="--max-cpu-loras 4"):
        engine.add_lora("one-more", paths["a"])
    for name in extra:
        assert engine.remove_lora(name)
    assert engine.lora_paths() == loaded


def test_a_gguf_adapter_as_llama_cpp_writes_it(setup, tmp_path) -> None:
    """The same adapter as a GGUF LoRA file (q's and k's B rows in llama.cpp's rotary order) gives
    PEFT's tokens; a GGUF file that is a model, not an adapter, is refused."""
    _, base, paths, llm = setup
    engine = llm.engine
    heads = {"q_proj": 4, "k_proj": 2}  # BASE: 4 heads over 2 KV heads
    for name in ("a", "c"):  # c: k_proj too
        path = gguf_adapter(paths[name], str(tmp_path / f"{name}.gguf"), heads)
        got = _tokens(llm, PROMPT, LoRARequest(f"{name}-gguf", 7, path))
        assert got == peft_greedy(base, paths[name], [PROMPT], NEW)[0], name
        assert engine.remove_lora(f"{name}-gguf")
    model = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(model), "llama")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file,
                  writer.write_tensors_to_file, writer.close):
        write()
    with pytest.raises(AdapterError, match="not a GGUF LoRA adapter"):
        engine.add_lora("model", str(model))
