"""Runtime adapter updates are the operator's to turn on: with `--lora-modules` alone the four
load/unload routes answer vLLM's 404 (naming the flag) and the start-up adapters keep serving;
`--allow-runtime-lora-updating` or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING` turns them on (then,
as in vLLM, start-up adapters may be unloaded; without `--lora-dir` nothing loads);
`--lora-dir` must be a folder; a rank refuses a path that a link now takes out of the folder, or
whose files a link now takes out."""

from __future__ import annotations

import argparse
import os
import threading

import pytest

from compiled_engine.lora.folder import OUTSIDE, PEFT_FILES, confined
from compiled_engine.ranks.adapter_wait import AdapterWait
from compiled_engine.ranks.messages import LoadLora, LoraReply
from server.args import add_serve_args, runtime_lora_updating
from tests.helpers.checkpoints import add_demo_tokenizer, make_checkpoint
from tests.helpers.lora import make_adapter
from tests.helpers.servers import start_server

SHAPE = dict(hidden_size=128, intermediate_size=256, vocab_size=2000)
PROMPT = list(range(3, 30))
ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/load_lora_adapter",
          "/unload_lora_adapter")


@pytest.fixture(scope="module")
def modules_only(tmp_path_factory):
    """A server started with `--lora-modules a=...` and nothing else about LoRA."""
    root = tmp_path_factory.mktemp("lora-gate")
    base = add_demo_tokenizer(make_checkpoint(str(root / "base"), "LlamaForCausalLM", **SHAPE))
    a = make_adapter(base, str(root / "a"), ["q_proj", "v_proj"], 8, seed=1)
    b = make_adapter(base, str(root / "b"), ["k_proj"], 4, seed=2)
    server = start_server(engine=dict(model=base, dtype="float32", enforce_eager=True,
                                      enable_lora=True, max_loras=2, max_lora_rank=8,
                                      lora_modules=[("a", a)]))
    try:
        yield server, a, b
    finally:
        server.stop()


@pytest.fixture(scope="module")
def on_without_folder(tmp_path_factory):
    """Runtime updating on, no `--lora-dir`."""
    root = tmp_path_factory.mktemp("lora-on")
    base = add_demo_tokenizer(make_checkpoint(str(root / "base"), "LlamaForCausalLM", **SHAPE))
    a = make_adapter(base, str(root / "a"), ["q_proj"], 4, seed=1)
    server = start_server(engine=dict(model=base, dtype="float32", enforce_eager=True,
                                      enable_lora=True, max_loras=1, max_lora_rank=4,
                                      lora_modules=[("a", a)]),
                          allow_runtime_lora_updating=True)
    try:
        yield server, a
    finally:
        server.stop()


def _tokens(http, model: str) -> list[int]:
    r = http.post("/generate", json={"input_ids": PROMPT, "model": model, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_with_lora_modules_alone_clients_neither_load_nor_unload(modules_only) -> None:
    server, a, b = modules_only
    with server.http() as http:
        models, before = http.get("/v1/models").json(), _tokens(http, "a")
        bodies = [{"lora_name": "b", "lora_path": b}, {"lora_name": "a"},
                  {"lora_name": "b", "lora_path": b}, {"lora_name": "a"}]
        for route, body in zip(ROUTES, bodies, strict=True):
            r = http.post(route, json=body)
            assert r.status_code == 404, (route, r.text)
            message = r.json()["error"]["message"]
            assert "--allow-runtime-lora-updating" in message, message
            assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in message, message
        # what a probe of other paths is told is the same: nothing about the file system
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc/passwd"})
        assert r.status_code == 404 and r.json()["error"]["message"] == message
        assert http.get("/v1/models").json() == models
        assert _tokens(http, "a") == before
        assert http.post("/generate", json={"input_ids": PROMPT, "model": "b"}).status_code == 404


def test_on_without_a_folder_nothing_loads_and_clients_unload(on_without_folder) -> None:
    server, a = on_without_folder
    with server.http() as http:
        bodies = {r.content for r in (
            http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": path})
            for path in (a, "/etc/passwd", "/no/such", "a"))}
        assert len(bodies) == 1
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": a})
        assert r.status_code == 400 and "--lora-dir" in r.json()["error"]["message"]
        # as in vLLM: with the routes on, a client may unload an adapter given at start-up
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 200, r.text
        assert http.post("/generate", json={"input_ids": PROMPT, "model": "a"}).status_code == 404


def _serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), (" True ", True),
                                       ("0", False), ("false", False), ("yes", False),
                                       ("", False), (None, False)])
def test_vllms_variable_turns_runtime_updating_on_as_vllm_reads_it(monkeypatch, value, on) -> None:
    if value is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
    assert runtime_lora_updating(_serve_args()) is on
    assert runtime_lora_updating(_serve_args("--allow-runtime-lora-updating")) is True


def test_lora_dir_must_be_a_folder(tmp_path, capsys) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    assert _serve_args("--lora-dir", str(tmp_path / "via")).lora_dir == os.path.realpath(
        tmp_path / "real")
    assert _serve_args().lora_dir is None
    (tmp_path / "file").write_text("")
    for bad in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(SystemExit):
            _serve_args("--lora-dir", str(bad))
        assert "is not a directory" in capsys.readouterr().err


class Reader:
    """An engine whose reads succeed (the path checks are what is tested)."""

    def read_lora(self, name: str, path: str) -> str:
        return f"weights of {path}"

    def serve_lora(self, name: str, path: str, weights: str) -> None:
        pass


def test_a_rank_refuses_a_path_a_link_took_out_of_the_folder(tmp_path) -> None:
    root, outside = tmp_path / "loras", tmp_path / "outside"
    for folder in ("x", "w"):
        (root / folder).mkdir(parents=True)
        for file in PEFT_FILES:
            (root / folder / file).write_text("")
    outside.mkdir()
    (outside / PEFT_FILES[1]).write_text("")
    checked = [confined(str(root), name) for name in ("x", "y", "w")]  # the server's check
    assert checked == [str(root / "x"), str(root / "y"), str(root / "w")]
    (root / "y").symlink_to(outside)  # put in its way after the check
    (root / "w" / PEFT_FILES[1]).unlink()  # a file of the folder: now a link to one outside
    (root / "w" / PEFT_FILES[1]).symlink_to(outside / PEFT_FILES[1])
    wait = AdapterWait(Reader())
    try:
        wait.start(LoadLora(1, "x", checked[0], str(root)))
        wait.start(LoadLora(2, "y", checked[1], str(root)))
        wait.start(LoadLora(3, "z", str(outside)))  # the offline API's own path: not confined
        wait.start(LoadLora(4, "w", checked[2], str(root)))
        for _ in range(3000):
            if len(wait.ready()[0]) == 4:
                break
            threading.Event().wait(0.01)
        replies = wait.serve(*wait.ready(), control=None)
    finally:
        wait.close()
    assert replies == [LoraReply(1), LoraReply(2, OUTSIDE, 400), LoraReply(3),
                       LoraReply(4, OUTSIDE, 400)]
