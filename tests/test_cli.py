"""The console script as a user runs it."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from compiled_engine.engine_args import add_engine_args, engine_config
from compiled_engine.models.demo import demo_model_dir
from compiled_engine.speculative.config import SpeculativeConfig


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_model_prints_the_checkpoint_path() -> None:
    out = run_cli("demo-model")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(demo_model_dir())


def test_unknown_model_path_is_a_clear_error(tmp_path) -> None:
    out = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert out.returncode == 2
    assert "config.json" in out.stderr and "Traceback" not in out.stderr


def test_compile_mode_reaches_the_engine_config() -> None:
    import argparse

    from compiled_engine.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args([])).compile_mode == "default"
    chosen = parser.parse_args(["--compile-mode", "max-autotune-freezing"])
    assert engine_config(chosen).compile_mode == "max-autotune-freezing"


@pytest.mark.parametrize("bad, says", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram"}', "needs 'method' and 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown field"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "must be >= 1"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs 'model'"),
    ("not json", "not JSON"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "min_acceptance": "0.3"}', "a number"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 6, '
     '"prompt_lookup_max": 5}', "in [1, prompt"),
])
def test_a_bad_speculative_config_is_refused_at_start(bad: str, says: str, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", bad])
    assert says in capsys.readouterr().err


def test_speculative_config_with_vllm_names() -> None:
    """vLLM's usual ngram config (only prompt_lookup_max): the minimum follows it, as in vLLM; and
    the other way round."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for given, want in (('"prompt_lookup_max": 4', (4, 4)), ('"prompt_lookup_min": 6', (6, 6)),
                        ("", (5, 3))):
        text = '{"method": "ngram", "num_speculative_tokens": 5' + (", " + given if given else "")
        config = engine_config(parser.parse_args(["--speculative-config", text + "}"]))
        parsed = SpeculativeConfig.parse(config.speculative)
        assert (parsed.prompt_lookup_max, parsed.prompt_lookup_min) == want


def test_kv_events_and_compile_cache_flags_reach_the_engine_config(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    on = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5601"}'
    config = engine_config(parser.parse_args(["--kv-events-config", on,
                                              "--compile-cache-dir", "/tmp/cc"]))
    assert config.kv_events == {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:5601"}
    assert config.compile_cache_dir == "/tmp/cc"
    assert engine_config(parser.parse_args([])).kv_events is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": 1}'])
    assert "enable_kv_cache_events must be a boolean" in capsys.readouterr().err


def test_torchrun_placement_is_read_from_torchruns_environment() -> None:
    from compiled_engine.ranks.torchrun import TorchrunPlacement, torchrun_placement

    assert torchrun_placement({"RANK": "0", "WORLD_SIZE": "2"}) is None  # not under torchrun
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2"}
    assert torchrun_placement(env) == TorchrunPlacement(3, 4, 1, 2)


def test_lora_flags_with_vllm_and_sglang_names(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config(parser.parse_args([
        "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat.gguf"}',
        "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "5",
    ]))
    assert config.enable_lora  # adapters given: LoRA is on
    assert config.lora_modules == [("sql", "/a/sql"), ("chat", "/a/chat.gguf")]
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (2, 32, 5)
    sglang = engine_config(parser.parse_args(["--lora-paths", "x=/a/x",
                                              "--max-loras-per-batch", "8"]))
    assert sglang.lora_modules == [("x", "/a/x")] and sglang.max_loras == 8
    assert not engine_config(parser.parse_args([])).enable_lora
    for bad, says in (("sql", "takes name=path"), ('{"name": "x"}', "a string name and path"),
                      ('{"name": "x", "path": "/p", "rank": 4}', "a string name and path"),
                      ('{"name": "x", "path": "/p", "base_model_name": "m"}',
                       "base_model_name is not supported")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--lora-modules", bad])
        assert says in capsys.readouterr().err


def test_kv_tier_flags_with_sglang_name(tmp_path, monkeypatch) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config(parser.parse_args(["--kv-cache-dir", str(tmp_path),
                                              "--kv-cache-disk-gb", "2.5"]))
    assert (config.kv_cache_dir, config.kv_cache_disk_gb) == (str(tmp_path), 2.5)
    assert engine_config(parser.parse_args([])).kv_cache_dir is None
    monkeypatch.setenv("COMPILED_ENGINE_CACHE", str(tmp_path / "root"))
    sglang = engine_config(parser.parse_args(["--enable-hierarchical-cache"]))
    assert sglang.kv_cache_dir == str(tmp_path / "root" / "kv-tier")
    with pytest.raises(ValueError, match="--kv-cache-disk-gb must be > 0"):
        engine_config(parser.parse_args(["--kv-cache-dir", "x", "--kv-cache-disk-gb", "0"]))
    parser.parse_args(["--hicache-write-policy", "write_through"])  # what the tier does
    with pytest.raises(SystemExit):  # SGLang's other policies are not served
        parser.parse_args(["--hicache-write-policy", "write_back"])
