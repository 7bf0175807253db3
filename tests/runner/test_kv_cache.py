"""The KV pool's CPU memory: reserved at start, resident only where requests write, zeros where
they have not."""

from __future__ import annotations

import torch

from compiled_engine.runner.kv_cache import kv_caches, zeroed

MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_a_gib_pool_is_not_resident_until_written() -> None:
    before = _rss()
    pool = zeroed((1 << 15, 8, 64, 32), torch.bfloat16, torch.device("cpu"))  # 1 GiB
    assert pool.numel() * pool.element_size() == 1 << 30
    allocated = _rss() - before
    assert allocated < 64 * MiB, f"allocating the pool made {allocated / MiB:.0f} MiB resident"
    pool[:1024].fill_(1.0)  # 32 MiB of slots written
    written = _rss() - before
    assert written - allocated >= 24 * MiB  # the written pages came in, and only about those
    assert written < 128 * MiB
    assert float(pool[:1024].sum()) == 1024 * 8 * 64 * 32
    assert not pool[1024:].any()  # the rest reads as zeros


def test_every_layer_gets_its_own_zeroed_k_and_v() -> None:
    k, v = kv_caches(3, (16, 2, 8), torch.float32, torch.device("cpu"))
    assert len(k) == len(v) == 3
    tensors = k + v
    assert len({t.data_ptr() for t in tensors}) == 6
    assert all(t.shape == (16, 2, 8) and t.dtype == torch.float32 and not t.any() for t in tensors)
    assert all(t.data_ptr() % 64 == 0 for t in tensors)  # the native kernels' alignment
    k[0][3] = 1.0
    assert not k[1].any() and not v[0].any()
