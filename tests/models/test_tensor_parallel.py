"""TP=2 over two gloo CPU processes gives the TP=1 logits and greedy tokens."""

import torch
import torch.multiprocessing as mp

from compiled_engine.models.loader import load_model
from compiled_engine.parallel import parallel_state as ps
from tests.helpers.checkpoints import PagedKV, greedy, init_gloo, make_checkpoint, step

PROMPTS = [list(range(3, 30)), [400, 401, 499, 250, 251, 9, 8, 7]]
NEW_TOKENS = 16


def _run(path: str) -> tuple[torch.Tensor, list[list[int]]]:
    model, _ = load_model(path)
    kv = PagedKV(model, 4, 64, len(PROMPTS))
    logits = step(model, kv, PROMPTS, [0] * len(PROMPTS))
    return logits, greedy(model, PROMPTS, NEW_TOKENS, page_size=4)


def _worker(rank: int, store: str, paths: list[str], out: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, 2, store)
    ps.init_tensor_parallel()
    assert (ps.get_tp_rank(), ps.get_tp_size()) == (rank, 2)
    results = [_run(p) for p in paths]
    if rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


def test_tp2_matches_tp1(tmp_path) -> None:
    paths = [
        # odd vocab (padded on rank 1), 1 KV head replicated on both ranks, q/k/v biases
        make_checkpoint(
            str(tmp_path / "qwen2"), "Qwen2ForCausalLM", vocab_size=501, num_key_value_heads=1
        ),
        # tied embeddings, 2 KV heads split over the ranks, q/k norms
        make_checkpoint(str(tmp_path / "qwen3"), "Qwen3ForCausalLM", tie_word_embeddings=True),
    ]
    out = str(tmp_path / "tp2.pt")
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), paths, out), nprocs=2, join=True)
    for (tp2_logits, tp2_tokens), path in zip(torch.load(out), paths, strict=True):
        tp1_logits, tp1_tokens = _run(path)
        assert tp2_logits.shape == tp1_logits.shape
        torch.testing.assert_close(tp2_logits, tp1_logits, rtol=1e-4, atol=1e-4)
        assert tp2_tokens == tp1_tokens
