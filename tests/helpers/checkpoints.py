"""Shared by the model tests: tiny random HF checkpoints and a minimal paged-KV driver of our
models."""

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from compiled_engine.layers.attention import AttentionMetadata
from compiled_engine.models.demo import DEMO_CONFIG, demo_model_dir

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=500,
    max_position_embeddings=256,
    initializer_range=0.1,  # peaked logits, so greedy argmax is not decided by rounding noise
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
# Mixture of experts: 4 experts of which each token takes 2, layer 0 dense, layer 1 sparse
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
           mlp_only_layers=[0])
# The packed-weights (GGUF) tests' shape: K-quants need rows of 256: hidden 256, intermediate 512; 4
# heads of 64 over 2 KV heads (TP=2 splits both); the demo tokenizer's vocabulary, which the GGUF
# files carry
PACKED_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=DEMO_CONFIG["vocab_size"],
    num_hidden_layers=2,
)


def make_checkpoint(
    path: str,
    arch: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: object,
) -> str:
    """Save a tiny random `arch` model (HF layout) to `path` and return `path`."""
    config = AutoConfig.for_model(MODEL_TYPES[arch], architectures=[arch], **{**BASE, **overrides})
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # HF starts biases at 0 and norms at 1: make them matter
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(path, **kwargs)
    return path


def add_demo_tokenizer(path: str) -> str:
    """Give a checkpoint folder the demo tokenizer's files (its vocabulary must cover it)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(demo_model_dir()) / name, Path(path) / name)
    return path


def hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()


@dataclass
class PagedKV:
    """A KV pool with a scattered page assignment per row (pages handed out in reverse order)."""

    model: torch.nn.Module
    page_size: int
    max_len: int
    rows: int

    def __post_init__(self) -> None:
        pages_per_row = -(-self.max_len // self.page_size)
        num_pages = self.rows * pages_per_row + 1
        shape = (num_pages * self.page_size, self.model.num_kv_heads, self.model.head_dim)
        dt = self.model.dtype
        self.model.attach_kv_cache(
            [torch.zeros(shape, dtype=dt) for _ in range(self.model.num_layers)],
            [torch.zeros(shape, dtype=dt) for _ in range(self.model.num_layers)],
        )
        pages = torch.arange(num_pages - 1, 0, -1).view(self.rows, pages_per_row)  # page 0 unused
        pos = torch.arange(self.max_len)
        self.page_table = (
            pages[:, pos // self.page_size] * self.page_size + pos % self.page_size
        ).to(torch.int32)


@torch.inference_mode()
def step(
    model: torch.nn.Module, kv: PagedKV, chunks: list[list[int]], starts: list[int]
) -> torch.Tensor:
    """Run rows 0..B-1: row b adds tokens `chunks[b]` at positions starts[b]...; returns logits [T,
    V]."""
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
    positions = torch.cat(
        [torch.arange(s, s + len(c)) for c, s in zip(chunks, starts, strict=True)]
    )
    rows = torch.cat([torch.full((len(c),), b) for b, c in enumerate(chunks)])
    q_lens = torch.tensor([len(c) for c in chunks])
    meta = AttentionMetadata(
        out_slots=kv.page_table[rows, positions].long(),
        page_table=kv.page_table[: len(chunks)].contiguous(),
        seq_lens=(torch.tensor(starts) + q_lens).to(torch.int32),
        cu_q_lens=torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32),
        is_decode=all(len(c) == 1 for c in chunks),
    )
    return model.compute_logits(model(ids, positions, meta)).float()


def greedy(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, page_size: int
) -> list[list[int]]:
    """Batched greedy decoding through our model: one prefill step, then one decode step per
    token."""
    kv = PagedKV(model, page_size, max(map(len, prompts)) + new_tokens, len(prompts))
    logits = step(model, kv, prompts, [0] * len(prompts))
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    out = [[t] for t in logits[last].argmax(-1).tolist()]
    for i in range(new_tokens - 1):
        logits = step(model, kv, [[o[-1]] for o in out], [len(p) + i for p in prompts])
        for o, t in zip(out, logits.argmax(-1).tolist(), strict=True):
            o.append(t)
    return out


@torch.inference_mode()
def hf_greedy(hf: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, store: str) -> None:
    """Join a gloo group that meets in the file `store` (no port to race for)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
