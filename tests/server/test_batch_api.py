"""OpenAI's Batch API through the official `openai` client (`files`, `batches`): a batch's answers
equal the same requests made directly, a bad line is an error line with its 400, a malformed file
fails its batch with the lines named, a cancelled batch keeps what it answered, a restarted server
resumes a batch from its last answer (`--batch-dir`), uploads are bounded; and `compiled-engine
run-batch` offline gives the same answers."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

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
        while client.batches.retrieve(again.id).request_counts.completed < 2:
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
