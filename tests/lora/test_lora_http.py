"""LoRA adapters through the server: a request picks its adapter by `model` (vLLM: the name;
SGLang: `base:name`) or `/generate`'s `lora_path`; `/v1/models` lists them with `root` and `parent`;
adapters are loaded, used, unloaded and loaded again live through vLLM's and SGLang's endpoints
(turned on, loads from the operator's folder), with the answers those servers give; a bad adapter
or one in use is a 400 that changes nothing; every path outside the folder gets the same refusal,
a folder inside whose files link out of it too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from tests.helpers.lora import llama_with_adapters, make_adapter, peft_greedy
from tests.helpers.servers import start_server, wait_idle

SHAPE = dict(hidden_size=128, intermediate_size=256, vocab_size=2000)
PROMPT = list(range(3, 30))
NEW = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-http")
    base, paths = llama_with_adapters(root, **SHAPE)
    refs = {name: peft_greedy(base, path, [PROMPT], NEW)[0] for name, path in paths.items()}
    refs[None] = peft_greedy(base, None, [PROMPT], NEW)[0]
    server = start_server(
        engine=dict(model=base, dtype="float32", enforce_eager=True, enable_lora=True,
                    max_loras=2, max_lora_rank=16, lora_modules=[("a", paths["a"])]),
        debug=True, allow_runtime_lora_updating=True, lora_dir=str(root),
    )
    try:
        yield server, base, paths, refs, root
    finally:
        server.stop()


def _tokens(http: httpx.Client, model: str, **extra) -> list[int]:
    r = http.post("/generate", json={"input_ids": PROMPT, "model": model, **extra,
                                     "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                         "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_requests_pick_their_adapter(served) -> None:
    server, base, paths, refs, _ = served
    with server.http() as http:
        models = http.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [base, "a"]
        assert (models[0]["root"], models[0]["parent"]) == (base, None)
        assert models[1]["root"] == paths["a"] and models[1]["parent"] == base
        assert _tokens(http, "a") == refs["a"]
        assert _tokens(http, f"{base}:a") == refs["a"]  # SGLang's base:adapter
        assert _tokens(http, base, lora_path="a") == refs["a"]  # SGLang's /generate field
        assert _tokens(http, base) == refs[None]
        completion = server.openai().completions.create(
            model="a", prompt=PROMPT, max_tokens=NEW, temperature=0,
            extra_body={"ignore_eos": True})
        assert completion.model == "a"
        r = http.post("/v1/completions", json={"model": "nope", "prompt": PROMPT})
        assert r.status_code == 404 and "'a'" in r.json()["error"]["message"]


def test_load_use_unload_and_load_again_live(served) -> None:
    server, base, paths, refs, root = served
    with server.http() as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": paths["b"]})
        assert r.status_code == 200, r.text
        assert r.text == "Success: LoRA adapter 'b' added successfully."
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [base, "a", "b"]
        assert _tokens(http, "b") == refs["b"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": paths["b"]})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "The lora adapter 'b' has already been loaded."
        # SGLang's endpoints and answers
        r = http.post("/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 200, r.text
        assert r.json() == {"success": True, "error_message": None,
                            "loaded_adapters": {"a": paths["a"]}}
        assert http.post("/generate", json={"input_ids": PROMPT, "model": "b"}).status_code == 404
        r = http.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": paths["c"]})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"a": paths["a"],
                                                                        "c": paths["c"]}
        assert _tokens(http, "c") == refs["c"]
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.text == "Success: LoRA adapter 'c' removed successfully."
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "The lora adapter 'c' cannot be found."
        # the name again, other files
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": paths["b"]})
        assert r.status_code == 200
        assert _tokens(http, "c") == refs["b"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
        assert wait_idle(http)["integrity_error"] is None


def test_a_bad_adapter_or_one_in_use_is_a_400_that_changes_nothing(served) -> None:
    server, base, paths, refs, root = served
    big = make_adapter(base, str(root / "big"), ["q_proj"], 32)
    with server.http() as http:
        before = http.get("/v1/models").json()
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": big})
        assert r.status_code == 400 and "--max-lora-rank 16" in r.json()["error"]["message"]
        r = http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "no/such"})
        assert r.status_code == 400 and r.json()["success"] is False
        assert "no adapter at" in r.json()["error_message"]  # inside the folder: the reason
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths["b"],
                                                     "load_inplace": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace"
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "path": paths["b"]})
        assert r.status_code == 400  # a field these endpoints do not have
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x" * 10_000,
                                                     "lora_path": paths["b"]})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "'lora_name' has 10000 characters, more than 256"
        broken = root / "broken"
        broken.mkdir()
        (broken / "adapter_config.json").write_text("[]")
        (broken / "adapter_model.safetensors").write_bytes(b"")
        for path, says in ((str(broken), "not a JSON object"),
                           ("x" * 300, "cannot read the adapter at")):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        r = http.post("/unload_lora_adapter", json={"lora_name": "never-loaded"})
        assert r.status_code == 400 and r.json()["success"] is False  # SGLang: every failure
        assert http.get("/v1/models").json() == before
        # in use: a long stream of `a` runs while the unload is asked
        body = {"model": "a", "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
            assert r.status_code == 400 and "in use" in r.json()["error"]["message"]
            rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2].replace(
                " ", ""), "the stream goes on to its end"
        assert http.get("/v1/models").json() == before
        assert _tokens(http, "a") == refs["a"]
        assert wait_idle(http)["integrity_error"] is None


def test_every_path_outside_the_folder_gets_one_refusal(served, tmp_path) -> None:
    server, base, paths, refs, root = served
    outside = shutil.copytree(paths["b"], tmp_path / "b")  # a good adapter, outside the folder
    huge = tmp_path / "huge.gguf"
    with open(huge, "wb") as f:
        f.truncate(1 << 30)  # larger than any adapter of this model
    (root / "link-out").symlink_to(outside)
    (root / "link-etc").symlink_to("/etc")
    (root / "alias").symlink_to(paths["b"])  # a link that stays inside is the operator's
    tried = [str(outside), "link-out", str(root / "link-out"), "link-etc/passwd", "/etc/passwd",
             "/etc", "/root", "/no/such/adapter", "../" + outside.parent.name + "/b", str(huge),
             str(tmp_path), "/proc/self/environ", "a\0b"]
    with server.http() as http:
        before = http.get("/v1/models").json()
        vllm = [http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
                for path in tried]
        sglang = [http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
                  for path in tried]
        assert {r.status_code for r in vllm + sglang} == {400}
        assert len({r.content for r in vllm}) == 1, [r.text for r in vllm]
        assert len({r.content for r in sglang}) == 1, [r.text for r in sglang]
        message = vllm[0].json()["error"]["message"]
        assert "--lora-dir" in message and "/" not in message
        assert sglang[0].json()["error_message"] == message
        assert http.get("/v1/models").json() == before
        # a folder inside whose files are links to another adapter's files outside: the one
        # refusal (the server's check, and each rank's before it reads); links to files that
        # stay inside, as the Hugging Face cache's snapshots to its blobs, are the operator's
        for name, target in (("linked-out", outside), ("linked-in", Path(paths["b"]))):
            (root / name).mkdir()
            shutil.copy(target / "adapter_config.json", root / name)
            (root / name / "adapter_model.safetensors").symlink_to(
                target / "adapter_model.safetensors")
        (root / "config-out").mkdir()
        (root / "config-out" / "adapter_config.json").symlink_to(outside / "adapter_config.json")
        shutil.copy(outside / "adapter_model.safetensors", root / "config-out")
        for path in ("linked-out", str(root / "config-out")):
            for route, answers in (("/v1/load_lora_adapter", vllm), ("/load_lora_adapter", sglang)):
                r = http.post(route, json={"lora_name": "x", "lora_path": path})
                assert (r.status_code, r.content) == (400, answers[0].content), r.text
        assert http.get("/v1/models").json() == before
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "in", "lora_path": "linked-in"})
        assert r.status_code == 200, r.text
        assert _tokens(http, "in") == refs["b"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "in"}).status_code == 200
        # inside the folder: relative, through a link that stays in it, served
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "alias", "lora_path": "alias"})
        assert r.status_code == 200, r.text
        assert _tokens(http, "alias") == refs["b"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "alias"}).status_code == 200
        assert http.get("/v1/models").json() == before
        assert wait_idle(http)["integrity_error"] is None


def test_hostile_adapter_files_are_refused_while_a_stream_goes_on(served) -> None:
    """An aliased GGUF (40 tensors on one block) and a metadata bomb (10M array elements) in the
    operator's folder: each a 400 naming its bound, read from the header alone, while a stream of
    the base model runs to its end with the tokens it has alone."""
    from tests.lora.gguf_files import aliased, metadata_bomb

    server, base, _, refs, root = served
    files = {"aliased": (aliased(root / "aliased.gguf"), "at offset 0 of the data"),
             "bomb": (metadata_bomb(root / "bomb.gguf"), "metadata arrays of more than")}
    body = {"model": base, "prompt": PROMPT, "max_tokens": 120, "temperature": 0,
            "ignore_eos": True}
    with server.http() as http:
        alone = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        before = http.get("/v1/models").json()
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as stream:
            lines = stream.iter_lines()
            chunks = [next(line for line in lines if line.startswith("data: "))]
            for name, (path, says) in files.items():
                r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
                assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
            chunks += [line for line in lines if line.startswith("data: ")]
        assert chunks[-1] == "data: [DONE]"
        text = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks[:-1]
                       if json.loads(c[6:])["choices"])
        assert text == alone
        assert http.get("/v1/models").json() == before
        assert _tokens(http, "a") == refs["a"]
