"""OpenAI's Batch API through the official `openai` client (`files`, `batches`): a batch's answers
equal the same requests made directly, a bad line is an error line with its 400, a malformed file
fails its batch with the lines named, a cancelled batch keeps what it answered, a restarted server
resumes a batch from its last answer (`--batch-dir`), uploads are bounded; and `compiled-engine
run-batch` offline gives the same answers. On a server with two API keys: neither key sees the
other's files and batches, a store with damaged objects still lists and runs batches, its folders
are 0700 and files 0600, its disk budget refuses an upload past it, a batch's answers are bounded;
ids the store never made are 404s."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import openai
import pytest

from tests.helpers.servers import start_server

PROMPTS = ["Hello", "The capital of France is", "1, 2, 3,", "Once upon a time", "Why"]
WAIT_S = 180


def chat_line(i: int, prompt: str, max_tokens: int = 6, **extra) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "demo", "messages": [{"role": "user", "content": prompt}],
                     "max_tokens": max_tokens, "temperature": 0, **extra}}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def wait_for(client, batch_id: str, done=("completed", "failed", "cancelled", "expired")):
    deadline = time.monotonic() + WAIT_S
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in done:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)


def answers(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    rows = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    assert len({r["custom_id"] for r in rows}) == len(rows)  # each line answered once
    return {r["custom_id"]: r for r in rows}


def direct(client, line: dict) -> str:
    """The line's request made directly (vLLM's fields beside OpenAI's)."""
    body = dict(line["body"])
    extra = {k: body.pop(k) for k in ("ignore_eos",) if k in body}
    return client.chat.completions.create(**body, extra_body=extra).choices[0].message.content


def test_a_batch_answers_as_the_requests_would_directly(server, tmp_path) -> None:
    client = server.openai()
    rows = [chat_line(i, p) for i, p in enumerate(PROMPTS)]
    rows.append(chat_line(99, "Hi", nonsense=True))  # a field we do not implement: its 400
    upload = client.files.create(file=write_jsonl(tmp_path / "in.jsonl", rows), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == (tmp_path / "in.jsonl").stat().st_size
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    batch = wait_for(client, batch.id)
    assert batch.status == "completed" and batch.metadata == {"job": "nightly"}
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (6, 5, 1)
    out, errors = answers(client, batch.output_file_id), answers(client, batch.error_file_id)
    for row in rows[:-1]:
        got = out[row["custom_id"]]["response"]
        assert got["status_code"] == 200
        assert got["body"]["choices"][0]["message"]["content"] == direct(client, row)
    bad = errors["req-99"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "nonsense"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    assert upload.id in [f.id for f in client.files.list(purpose="batch").data]
    client.files.delete(upload.id)
    with pytest.raises(Exception, match="404"):
        client.files.retrieve(upload.id)


def test_a_malformed_file_fails_its_batch_naming_the_lines(server, tmp_path) -> None:
    client = server.openai()
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(chat_line(0, "a")) + "\n{not json\n"
                    + json.dumps(chat_line(0, "dup")) + "\n"
                    + json.dumps(chat_line(3, "b") | {"url": "/v1/completions"}) + "\n"
                    + json.dumps(chat_line(4, "c", stream=True)) + "\n")
    upload = client.files.create(file=path, purpose="batch")
    batch = wait_for(client, client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "failed" and batch.output_file_id is None
    found = [(e.line, e.code) for e in batch.errors.data]
    assert found == [(2, "invalid_json_line"), (3, "duplicate_custom_id"),
                     (4, "mismatched_endpoint"), (5, "invalid_request")]


def test_bad_batch_and_file_requests_are_refused(server, http) -> None:
    for body, param in (({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions",
                          "completion_window": "24h"}, "input_file_id"),
                        ({"input_file_id": "x", "endpoint": "/v1/models",
                          "completion_window": "24h"}, "endpoint"),
                        ({"input_file_id": "x", "endpoint": "/v1/completions",
                          "completion_window": "1h"}, "completion_window"),
                        ({"input_file_id": "x", "endpoint": "/v1/completions",
                          "completion_window": "24h", "extra": 1}, "extra")):
        r = http.post("/v1/batches", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert http.get("/v1/batches/batch_nope").status_code == 404
    r = http.get("/v1/files/file-..passwd")  # an id that would leave the store's folder
    assert r.status_code == 404 and "No such file" in r.json()["error"]["message"]
    r = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "fine-tune"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    r = http.post("/v1/files", json={"file": "x"})
    assert r.status_code == 415
    r = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"},
                  headers={"Origin": "https://evil.example"})
    assert r.status_code == 403


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batches")


def start_batch_server(folder: Path):
    """Priority scheduling (a batch runs at the lowest), two lines at a time, small uploads."""
    return start_server(engine={"scheduling_policy": "priority"}, batch_dir=str(folder),
                        batch_concurrency=2, max_batch_file_bytes=64 << 10)


def test_a_restarted_server_resumes_a_batch_and_cancel_keeps_answers(batch_dir, tmp_path) -> None:
    rows = [chat_line(i, f"Count to {i}:", max_tokens=24, ignore_eos=True) for i in range(24)]
    first = start_batch_server(batch_dir)
    try:
        client = first.openai()
        upload = client.files.create(file=write_jsonl(tmp_path / "in.jsonl", rows),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=upload.id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + WAIT_S
        while client.batches.retrieve(batch.id).request_counts.completed < 4:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with first.http() as http:  # uploads past --max-batch-file-mb: 413
            r = http.post("/v1/files", files={"file": ("big.jsonl", b"x" * (200 << 10))},
                          data={"purpose": "batch"})
            assert r.status_code == 413
    finally:
        first.stop()
    second = start_batch_server(batch_dir)
    try:
        client = second.openai()
        assert client.batches.retrieve(batch.id).request_counts.completed >= 4
        done = wait_for(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 24
        out = answers(client, done.output_file_id)
        assert sorted(out) == sorted(r["custom_id"] for r in rows)
        for row in rows[::6]:
            body = out[row["custom_id"]]["response"]["body"]
            assert body["choices"][0]["message"]["content"] == direct(client, row)
        many = [chat_line(i, f"Tell me about {i}", max_tokens=32, ignore_eos=True)
                for i in range(200)]
        longer = client.files.create(file=write_jsonl(tmp_path / "many.jsonl", many),
                                     purpose="batch")
        again = client.batches.create(input_file_id=longer.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + WAIT_S
        while client.batches.retrieve(again.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert client.batches.cancel(again.id).status == "cancelling"
        cancelled = wait_for(client, again.id)
        assert cancelled.status == "cancelled"
        kept = answers(client, cancelled.output_file_id)
        assert 2 <= len(kept) < 200 and len(kept) == cancelled.request_counts.completed
        with pytest.raises(Exception, match="409"):
            client.batches.cancel(again.id)
    finally:
        second.stop()


def test_run_batch_offline_answers_as_the_server(server, tmp_path) -> None:
    rows = [chat_line(i, p) for i, p in enumerate(PROMPTS[:3])]
    rows.append({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                 "body": {"model": "demo", "prompt": "Hello", "max_tokens": 4, "temperature": 0}})
    source, target = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    cli = Path(sys.executable).with_name("compiled-engine")
    run = subprocess.run([str(cli), "run-batch", "-i", str(source), "-o", str(target),
                          "--model", "demo", "--num-pages", "512"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = {r["custom_id"]: r["response"] for r in map(json.loads, target.read_text().splitlines())}
    client = server.openai()
    for row in rows[:3]:
        assert out[row["custom_id"]]["body"]["choices"][0]["message"]["content"] == direct(client,
                                                                                          row)
    text = client.completions.create(**rows[3]["body"]).choices[0].text
    assert out["c"]["body"]["choices"][0]["text"] == text
    bad = subprocess.run([str(cli), "run-batch", "-i", str(tmp_path / "out.jsonl"), "-o",
                          str(tmp_path / "x.jsonl"), "--model", "demo"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "line 1" in bad.stderr


def test_a_file_past_the_upload_limit_declared_is_refused_unread(server) -> None:
    """A Content-Length past the limit is answered 413 before a byte of the body is read."""
    limit = server.state.config.max_batch_file_bytes
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                     f"multipart/form-data; boundary=x\r\nContent-Length: {limit + (2 << 20)}"
                     "\r\n\r\n".encode())
        head = sock.recv(4096).decode("latin-1")
    assert head.startswith("HTTP/1.1 413"), head[:200]


KEYS = ("key-of-ann", "key-of-bo")
OUTPUT_BOUND = 4096  # a batch's answers on the keyed server


@pytest.fixture(scope="module")
def keyed_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("keyed-batches")


@pytest.fixture(scope="module")
def keyed(keyed_dir):
    """Two API keys; its store in `keyed_dir`, with small bounds (256 KiB on disk, 4 KiB of
    answers a batch); eager (its answers are not what these tests compare)."""
    running = start_server(engine={"enforce_eager": True, "num_pages": 512}, api_keys=KEYS,
                           batch_dir=str(keyed_dir), batch_disk_bytes=256 << 10,
                           max_batch_output_bytes=OUTPUT_BOUND)
    yield running
    running.stop()


def as_key(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def run_one(client, tmp_path: Path, rows: list[dict]):
    """`rows` uploaded and run as a batch to its end."""
    upload = client.files.create(file=write_jsonl(tmp_path / f"{uuid.uuid4().hex}.jsonl", rows),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    return upload, wait_for(client, batch.id)


def test_two_api_keys_cannot_see_each_others_files_and_batches(keyed, tmp_path) -> None:
    ann = as_key(keyed, KEYS[0])
    upload = ann.files.create(file=write_jsonl(tmp_path / "in.jsonl", [chat_line(0, "Hi", 2)]),
                              purpose="batch")
    batch = ann.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    with keyed.http(headers={"Authorization": f"Bearer {KEYS[1]}"}) as bo:
        for method, path in (("GET", f"/v1/files/{upload.id}"),
                             ("GET", f"/v1/files/{upload.id}/content"),
                             ("DELETE", f"/v1/files/{upload.id}"),
                             ("GET", f"/v1/batches/{batch.id}"),
                             ("POST", f"/v1/batches/{batch.id}/cancel")):
            r = bo.request(method, path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
        r = bo.post("/v1/batches", json={"input_file_id": upload.id, "completion_window": "24h",
                                         "endpoint": "/v1/chat/completions"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id"
        assert upload.id not in [f["id"] for f in bo.get("/v1/files").json()["data"]]
        assert batch.id not in [b["id"] for b in bo.get("/v1/batches").json()["data"]]
        done = wait_for(ann, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 1
        assert bo.get(f"/v1/files/{done.output_file_id}/content").status_code == 404
        assert bo.get("/v1/files").json()["data"] == []
    assert ann.files.retrieve(upload.id).id == upload.id  # bo's delete did nothing
    assert done.output_file_id in [f.id for f in ann.files.list().data]
    with keyed.http(headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:  # no owner shown
        assert "owner" not in http.get(f"/v1/batches/{batch.id}").json()


LONG_IDS = ("file-" + "é" * 200, "batch_" + "文" * 120, "x" * 3000)


def test_long_unicode_ids_are_404s_on_every_route(server, http) -> None:
    """They were 500s ("File name too long")."""
    for bad in LONG_IDS:
        for method, path in (("GET", f"/v1/files/{bad}"), ("GET", f"/v1/files/{bad}/content"),
                             ("DELETE", f"/v1/files/{bad}"), ("GET", f"/v1/batches/{bad}"),
                             ("POST", f"/v1/batches/{bad}/cancel")):
            r = http.request(method, path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path,
                                                                                     r.text)
        r = http.post("/v1/batches", json={"input_file_id": bad, "completion_window": "24h",
                                           "endpoint": "/v1/chat/completions"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id", r.text


def test_a_store_with_damaged_objects_still_lists_and_runs_batches(keyed, keyed_dir,
                                                                   tmp_path) -> None:
    """A zero-byte object (a power loss) and garbage JSON: left out of the lists (were 500s), and
    the runner runs the next batch (it had stopped for good)."""
    damaged = [keyed_dir / "files" / f"file-{uuid.uuid4().hex}.json",
               keyed_dir / "batches" / f"batch_{uuid.uuid4().hex}.json",
               keyed_dir / "batches" / f"batch_{uuid.uuid4().hex}.json"]
    for path, text in zip(damaged, ("", '{"id": "x", ', '"a string"'), strict=True):
        path.write_text(text)
    try:
        ann = as_key(keyed, KEYS[0])
        ann.files.list()
        ann.batches.list()
        _, done = run_one(ann, tmp_path, [chat_line(0, "Hello", 2)])
        assert done.status == "completed" and done.request_counts.completed == 1
        assert done.id in [b.id for b in ann.batches.list().data]
    finally:
        for path in damaged:
            path.unlink()


def test_a_files_content_deleted_under_the_route_is_a_404(keyed, keyed_dir) -> None:
    """The content route found the object, then the file was gone (a DELETE in between): a
    500."""
    with keyed.http(headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:
        r = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"})
        file_id = r.json()["id"]
        (keyed_dir / "files" / f"{file_id}.jsonl").unlink()  # as the DELETE's first step does
        r = http.get(f"/v1/files/{file_id}/content")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        http.delete(f"/v1/files/{file_id}")


def test_the_store_is_private(keyed, keyed_dir, tmp_path) -> None:
    """Folders 0700, files 0600 (uploads, objects, answers): were the umask's."""
    run_one(as_key(keyed, KEYS[1]), tmp_path, [chat_line(0, "Why", 2)])
    folders = [keyed_dir, *(p for p in keyed_dir.rglob("*") if p.is_dir())]
    files = [p for p in keyed_dir.rglob("*") if p.is_file()]
    assert len(folders) == 3 and len(files) >= 4
    assert {oct(os.stat(p).st_mode & 0o777) for p in folders} == {"0o700"}
    assert {oct(os.stat(p).st_mode & 0o777) for p in files} == {"0o600"}


def test_the_disk_budget_refuses_an_upload_past_it(keyed, tmp_path) -> None:
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps(chat_line(0, "x" * (300 << 10))) + "\n")  # past 256 KiB
    with keyed.http(headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:
        r = http.post("/v1/files", files={"file": ("big.jsonl", big.read_bytes())},
                      data={"purpose": "batch"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "batch_store_full", r.text
        r = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"})
        assert r.status_code == 200  # what fits is still taken


def test_a_batchs_answers_are_bounded(keyed, tmp_path) -> None:
    """Past --max-batch-output-mb the lines left are error lines saying so (OpenAI's shape: no
    response), not run; the batch completes."""
    rows = [chat_line(i, f"Count to {i}:", max_tokens=16, ignore_eos=True) for i in range(12)]
    client = as_key(keyed, KEYS[0])
    _, done = run_one(client, tmp_path, rows)
    counts = done.request_counts
    assert done.status == "completed" and counts.completed + counts.failed == 12
    assert counts.completed >= 1 and counts.failed >= 1
    assert len(client.files.content(done.output_file_id).content) <= OUTPUT_BOUND
    errors = answers(client, done.error_file_id).values()
    assert len(errors) == counts.failed
    assert {(e["response"], e["error"]["code"]) for e in errors} == {
        (None, "batch_output_too_large")}
