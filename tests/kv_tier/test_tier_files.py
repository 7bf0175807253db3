"""The KV tier's files on disk: only this user may read them (folders 0700, files 0600 whatever the
umask), a --kv-cache-dir or a store in it owned by another user is refused at start-up, and one
byte budget covers every store under the folder (a run's TP ranks share it; the stores of other
models are removed, least recently used first, when the folder would be past it)."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from compiled_engine.engine_args import add_engine_args, engine_config
from compiled_engine.kv_tier.folder import check_folder, open_store
from compiled_engine.kv_tier.store import HEADER
from compiled_engine.llm import LLM
from compiled_engine.private_dir import UnsafeFolder, ensure_private_dir
from compiled_engine.sampling_params import SamplingParams
from tests.helpers.checkpoints import add_demo_tokenizer, make_checkpoint

SHAPE = dict(hidden_size=128, intermediate_size=256, vocab_size=2000)
PAGE = 16
PROMPT = [(7 * i) % 1900 + 5 for i in range(200)]  # 12 whole pages before its last position
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ENGINE = dict(deterministic=True, page_size=PAGE, num_pages=64, max_running=4, enforce_eager=True)
NOBODY = 65534


def _checkpoint(path: Path, seed: int = 0) -> str:
    return add_demo_tokenizer(make_checkpoint(str(path), "LlamaForCausalLM", torch.bfloat16,
                                              seed=seed, **SHAPE))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory.mktemp("tier-files-model") / "base")


@pytest.fixture
def loose_umask():
    """The umask most systems run with (files 0644, folders 0755 unless the tier says otherwise)."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _serve(model: str, kv_dir: Path, **kw) -> list[int]:
    llm = LLM(model, kv_cache_dir=str(kv_dir), **ENGINE, **kw)
    try:
        out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.engine.tier.flush()
    finally:
        llm.engine.shutdown()
    return out


def _pages(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.kv"))


@pytest.mark.slow
def test_every_folder_is_0700_and_every_file_0600(base, tmp_path, loose_umask) -> None:
    kv_dir = tmp_path / "kv"
    _serve(base, kv_dir)
    _serve(base, kv_dir)  # a restart reads and keeps them
    entries = [kv_dir, *kv_dir.rglob("*")]
    assert len(_pages(kv_dir)) == 12
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.lstat().st_mode) for p in entries}
    wrong = {p: oct(m) for p, m in modes.items()
             if m != (0o700 if (tmp_path / p).is_dir() else 0o600)}
    assert not wrong, f"readable by other users: {wrong}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_a_folder_others_may_write_is_refused(base, tmp_path) -> None:
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    kv_dir.chmod(0o777)
    args = _parser().parse_args(["--kv-cache-dir", str(kv_dir)])
    with pytest.raises(ValueError, match=f"--kv-cache-dir: {kv_dir} is writable by other users"):
        engine_config(args)
    with pytest.raises(UnsafeFolder, match="writable by other users"):
        LLM(base, kv_cache_dir=str(kv_dir), **ENGINE)
    assert not list(kv_dir.iterdir())


def test_a_folder_of_another_user_is_refused(base, tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user takes root")
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir(mode=0o700)
    os.chown(kv_dir, NOBODY, NOBODY)
    parser = _parser()
    args = parser.parse_args(["--kv-cache-dir", str(kv_dir)])
    with pytest.raises(ValueError, match=f"--kv-cache-dir: {kv_dir} is owned by uid {NOBODY}"):
        engine_config(args)
    with pytest.raises(UnsafeFolder, match=f"owned by uid {NOBODY}"):
        LLM(base, kv_cache_dir=str(kv_dir), **ENGINE)
    assert not list(kv_dir.iterdir()), "something was written into another user's folder"
    # our folder, with a store folder in it of another user
    mine = tmp_path / "kv2"
    store = mine / "0123456789abcdef-0"
    store.mkdir(parents=True)
    os.chown(store, NOBODY, NOBODY)
    with pytest.raises(UnsafeFolder, match=f"{store} is not a folder of this user"):
        LLM(base, kv_cache_dir=str(mine), **ENGINE)
    args = parser.parse_args(["--kv-cache-dir", str(mine)])
    with pytest.raises(ValueError, match="is not a folder of this user"):
        engine_config(args)


@pytest.mark.slow
def test_one_budget_over_the_whole_folder_removes_another_models_store(base, tmp_path) -> None:
    """Two models on one folder whose budget holds 20 of their pages: the second model's 12 pages
    push the folder past it, so the first model's store (unused since) is removed whole, and the
    folder stays within the budget."""
    kv_dir = tmp_path / "kv"
    first = _serve(base, kv_dir)
    (old,) = [p for p in kv_dir.iterdir() if p.is_dir()]
    page_file = _pages(kv_dir)[0].stat().st_size
    budget = 20 * page_file
    other = _checkpoint(tmp_path / "other", seed=3)
    _serve(other, kv_dir, kv_cache_disk_gb=budget / 1e9)
    used = sum(p.stat().st_size for p in kv_dir.rglob("*") if p.is_file())
    assert used <= budget, f"{used} bytes on disk over the folder's budget of {budget}"
    assert not old.exists(), "the other model's store was kept past the budget"
    assert len(_pages(kv_dir)) == 12, "the model served now lost pages instead"
    # the first model served again: its pages are computed again (the same tokens), the second's go
    assert _serve(base, kv_dir, kv_cache_disk_gb=budget / 1e9) == first
    used = sum(p.stat().st_size for p in kv_dir.rglob("*") if p.is_file())
    assert used <= budget and len(_pages(kv_dir)) == 12


def test_tp_ranks_share_one_budget(tmp_path) -> None:
    """Each rank's store gets its share: two ranks filling theirs keep the folder within it."""
    kv_dir = tmp_path / "kv"
    payload = bytes(1000)
    budget = 10 * (HEADER.size + len(payload))
    key = hashlib.sha256(b"a run").digest()
    stores = [open_store(kv_dir, key, rank, 2, budget) for rank in (0, 1)]
    try:
        for i in range(30):
            for rank, store in enumerate(stores):
                assert store.put(hashlib.sha256(bytes([rank, i])).digest(), payload)
        for store in stores:
            store.check()
    finally:
        for store in stores:
            store.close()
    used = sum(p.stat().st_size for p in kv_dir.rglob("*") if p.is_file())
    assert used <= budget, f"{used} bytes on disk over the folder's budget of {budget}"
    assert [len(s) for s in stores] == [5, 5]


def _refused_at_start_up(kv_dir: Path, match: str) -> None:
    """`--kv-cache-dir kv_dir` refused by the start-up check and by the store, nothing made."""
    args = _parser().parse_args(["--kv-cache-dir", str(kv_dir)])
    with pytest.raises(ValueError, match=f"--kv-cache-dir: {re.escape(str(kv_dir))}: {match}"):
        engine_config(args)
    with pytest.raises(UnsafeFolder, match=match):
        ensure_private_dir(kv_dir)
    assert not kv_dir.exists(), "a folder was made under an unsafe one"


def test_a_folder_under_another_users_folder_is_refused(tmp_path) -> None:
    """Whoever owns a folder above ours could move ours aside and put theirs in its place."""
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user takes root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    refusal = re.escape(f"the folder above it, {theirs}, is owned by uid {NOBODY} (neither root "
                        "nor this user)")
    _refused_at_start_up(theirs / "kv", refusal)
    _refused_at_start_up(theirs / "deeper" / "kv", refusal)


def test_a_folder_under_one_others_may_write_is_refused_unless_it_is_sticky(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    _refused_at_start_up(shared / "kv", re.escape(f"the folder above it, {shared}, is writable "
                                                  "by other users and not sticky (mode 777)"))
    shared.chmod(0o1777)  # as /tmp: others may not move what is ours
    kv_dir = shared / "kv"
    check_folder(kv_dir)
    assert ensure_private_dir(kv_dir) == kv_dir
    assert stat.S_IMODE(kv_dir.stat().st_mode) == 0o700


def test_a_folder_under_tmp_or_pytests_tmp_path_is_accepted(tmp_path) -> None:
    if not os.stat("/tmp").st_mode & stat.S_ISVTX:
        pytest.skip("/tmp is not sticky here")
    with tempfile.TemporaryDirectory(dir="/tmp") as top:
        for kv_dir in (Path(top) / "kv", tmp_path / "a" / "kv"):
            check_folder(kv_dir)
            assert ensure_private_dir(kv_dir) == kv_dir.resolve()
            assert stat.S_IMODE(kv_dir.stat().st_mode) == 0o700


def test_an_existing_folder_tightened_is_one_warning(tmp_path, caplog) -> None:
    """An operator's 0750 folder (or --kv-cache-dir ~) is set to 0700, and the log says so once;
    a folder made here, or already 0700, says nothing."""
    theirs = tmp_path / "operators"
    theirs.mkdir()
    theirs.chmod(0o750)
    with caplog.at_level(logging.WARNING, logger="compiled_engine.private_dir"):
        ensure_private_dir(theirs)
        ensure_private_dir(theirs)
        ensure_private_dir(tmp_path / "new")
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o700
    assert [r.getMessage() for r in caplog.records] == [
        f"{theirs} had mode 750: set to 700 (only this user may read what is kept there)"]
