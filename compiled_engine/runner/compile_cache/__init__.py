"""Persistent torch.compile artifacts, one folder per key of everything that shapes generated
code."""

from compiled_engine.runner.compile_cache.entry import CacheEntry, clear_entries, list_entries
from compiled_engine.runner.compile_cache.key import CacheKey, cache_key
from compiled_engine.runner.compile_cache.session import (
    CompileReport,
    compile_with_cache,
    default_root,
)

__all__ = [
    "CacheEntry",
    "CacheKey",
    "CompileReport",
    "cache_key",
    "clear_entries",
    "compile_with_cache",
    "default_root",
    "list_entries",
]
