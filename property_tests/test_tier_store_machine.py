"""Stateful test of the KV tier's page store against a model (what was stored last under each key):
store, read back, restart (with and without waiting for the index), corrupt or tear a file, a write
cut short, and a byte budget small enough that every run evicts. After each rule the store's own
check holds (its index is the directory, its byte count and budget hold) and it never returns bytes
that were not stored under the key asked."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from compiled_engine.kv_tier.store import HEADER, PageStore
from compiled_engine.private_dir import FolderBusy

KEYS = [hashlib.sha256(bytes([i])).digest() for i in range(6)]
keys = st.sampled_from(KEYS)
payloads = st.binary(min_size=1, max_size=64)


class PageStoreMachine(RuleBasedStateMachine):
    @initialize(pages=st.integers(1, 4))
    def setup(self, pages: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tier-machine-"))
        self.budget = pages * (HEADER.size + 64)
        self.store = PageStore(self.dir, self.budget)
        self.model: dict[bytes, bytes] = {}  # key -> the payload stored last under it

    @rule(key=keys, payload=payloads)
    def put(self, key: bytes, payload: bytes) -> None:
        was_there = key in self.store
        assert self.store.put(key, payload)
        assert key in self.store, "a page just stored is the most recently used: never evicted"
        if not was_there:  # a page already stored keeps its bytes (same key, same KV)
            self.model[key] = payload

    @rule(key=keys)
    def get(self, key: bytes) -> None:
        got = self.store.get(key)
        if got is None:
            assert key not in self.store
        else:
            assert got == self.model[key], "the store returned other bytes than were stored"

    @precondition(lambda self: len(self.store))
    @rule(data=st.data(), how=st.sampled_from(["flip header", "flip payload", "truncate", "swap",
                                               "empty"]))
    def corrupt(self, data, how: str) -> None:
        files = sorted(self.dir.glob("*/*.kv"))
        path = data.draw(st.sampled_from(files))
        raw = bytearray(path.read_bytes())
        if how == "flip header" or len(raw) == HEADER.size:
            raw[data.draw(st.integers(0, HEADER.size - 1))] ^= 0xFF
        elif how == "flip payload":
            raw[data.draw(st.integers(HEADER.size, len(raw) - 1))] ^= 0xFF
        elif how == "truncate":
            raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
        elif how == "swap":  # another page's file under this name
            other = data.draw(st.sampled_from(files))
            raw = bytearray(other.read_bytes())
        else:
            raw = bytearray()
        path.write_bytes(bytes(raw))
        key = bytes.fromhex(path.stem)
        got = self.store.get(key)
        assert got is None or got == self.model[key], "a damaged page was read as good"
        if got is None:
            assert key not in self.store and not path.exists(), "a damaged page was kept"
        self.restart()  # the index is rebuilt from the files as they are now

    @rule()
    def cut_write(self) -> None:
        """A process stopped mid-write: its temporary file stays behind until the next start."""
        sub = self.dir / "ab"
        sub.mkdir(exist_ok=True)
        (sub / f"{'ab' * 32}.999.1.tmp").write_bytes(b"partial")
        self.restart()

    @rule(wait=st.booleans())
    def restart(self, wait: bool = True) -> None:
        """Open the directory again; without waiting for the index, the rule's reads race its
        rebuild (a page not indexed yet is a miss)."""
        self.store.close()
        self.store = PageStore(self.dir, self.budget, rebuild_wait_s=2.0 if wait else 0.0)
        for key in KEYS:
            if key in self.store:
                assert self.store.get(key) in (None, self.model[key])

    @rule()
    def a_second_process_is_refused(self) -> None:
        with pytest.raises(FolderBusy):
            PageStore(self.dir, self.budget)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "store"):
            self.store.check()

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)


PageStoreMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30)
TestPageStore = PageStoreMachine.TestCase
