"""A server restarted on the same --kv-cache-dir serves a cached prompt prefix without prefilling
it: /metrics counts its prompt tokens as KV-tier hits (vLLM's external prefix-cache hits), none as
pool hits, the answer is the first server's, and the answer's `cached_tokens` (SGLang's /generate,
OpenAI's `usage.prompt_tokens_details`) count the tokens from either tier."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.checkpoints import add_demo_tokenizer, make_checkpoint
from tests.helpers.servers import start_server, wait_idle

PROMPT = [(5 * i) % 1900 + 7 for i in range(300)]  # 18 whole pages of 16 before its last position
BODY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                 "ignore_eos": True}}


def _counter(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def _serve_once(model: str, kv_dir: str) -> tuple[list[int], float, float, int]:
    server = start_server(engine=dict(model=model, enforce_eager=True, page_size=16,
                                      kv_cache_dir=kv_dir), debug=True)
    try:
        with server.http() as http:
            r = http.post("/generate", json=BODY)
            assert r.status_code == 200, r.text
            assert wait_idle(http)["integrity_error"] is None
            metrics = http.get("/metrics").text
            # the same prompt again: its prefix from the pool now
            usage = server.openai().completions.create(
                model=model, prompt=PROMPT, max_tokens=1).usage
            assert usage.prompt_tokens_details.cached_tokens == 18 * 16
    finally:
        server.stop()
    return (r.json()["output_ids"], _counter(metrics, "vllm:external_prefix_cache_hits_total"),
            _counter(metrics, "vllm:prefix_cache_hits_total"), r.json()["cached_tokens"])


@pytest.mark.slow
def test_a_restarted_server_serves_a_cached_prefix_from_the_tier(tmp_path) -> None:
    model = add_demo_tokenizer(make_checkpoint(str(tmp_path / "base"), "LlamaForCausalLM",
                                               torch.bfloat16, hidden_size=128,
                                               intermediate_size=256, vocab_size=2000,
                                               max_position_embeddings=1024))
    kv_dir = str(tmp_path / "kv")
    first, tier_hits, pool_hits, cached = _serve_once(model, kv_dir)
    assert (tier_hits, pool_hits, cached) == (0, 0, 0)
    again, tier_hits, pool_hits, cached = _serve_once(model, kv_dir)
    assert (tier_hits, pool_hits, cached) == (18 * 16, 0, 18 * 16), "prefilled again"
    assert again == first
