"""The Batch API's state on disk (server/batch/store.py) and its runner without a server: a line cut
short while being written runs again, a batch stopped while its answers were being kept finishes
keeping them (nothing answered twice, nothing lost); objects belong to their owner; ids the store
never makes are 404s; an object cut short is left out; folders 0700 and files 0600; a folder of
another user's refused; one store a folder; a disk budget; a batch's `n` counted against its share
of the queue; a batch's answers bounded."""

import argparse
import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import uuid

import pytest

import server.app
from compiled_engine.private_dir import FolderBusy
from compiled_engine.ranks.launcher import StartupRefusal
from server.args import add_serve_args
from server.batch.runner import BatchRunner
from server.batch.store import MAX_UNFINISHED, BatchStore, owner_of
from server.request_errors import ProtocolError
from server.state import ServerConfig

ALICE, BOB = owner_of("alice-key"), owner_of("bob-key")
LONG_IDS = ("file-" + "é" * 200, "batch_" + "文" * 300, "file-" + "a" * 32 + "/..", "x" * 5000)


def new_id(kind: str) -> str:
    return f"{kind}{'-' if kind == 'file' else '_'}{uuid.uuid4().hex}"


def answer(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "response": {"status_code": 200}}).encode()


def upload(store: BatchStore, rows: list[dict], owner: str = ALICE, limit: int = 1 << 20) -> dict:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    return store.add_upload(io.BytesIO(data), "in.jsonl", owner, limit)


def batch_of(store: BatchStore, file_id: str, owner: str = ALICE) -> dict:
    return store.new_batch({"endpoint": "/v1/completions", "input_file_id": file_id,
                            "status": "validating", "created_at": 1, "expires_at": 2**40,
                            "request_counts": {"total": 0, "completed": 0, "failed": 0}}, owner)


def line(i: int, **body) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "x", **body}}


def test_a_line_cut_short_and_what_follows_it_run_again(tmp_path) -> None:
    store, bid = BatchStore(tmp_path), new_id("batch")
    store.append_answer(bid, "output", answer("x"))
    store.append_answer(bid, "output", answer("y"))
    path = store.answers_path(bid, "output")
    path.write_bytes(path.read_bytes() + answer("z")[:9])  # the process stopped mid-line
    assert store.answered(bid) == {"output": {"x", "y"}, "errors": set()}
    assert path.read_bytes().count(b"\n") == 2 and path.read_bytes().endswith(b"\n")
    store.append_answer(bid, "output", answer("z"))
    assert store.answered(bid)["output"] == {"x", "y", "z"}


def test_keeping_the_answers_again_after_a_stop_finishes_the_move(tmp_path) -> None:
    store, bid, out, err = BatchStore(tmp_path), new_id("batch"), new_id("file"), new_id("file")
    store.append_answer(bid, "output", answer("x"))
    assert store.keep_answers(bid, "output", out, ALICE) == out
    assert store.keep_answers(bid, "output", out, ALICE) == out  # resumed: kept
    assert store.keep_answers(bid, "errors", err, ALICE) is None  # none to keep
    assert store.file(out, ALICE)["purpose"] == "batch_output"
    assert store.file_path(out).read_bytes() == answer("x") + b"\n"


def test_a_files_content_is_a_404_once_deleted_and_whole_once_open(tmp_path) -> None:
    """Between its object read and its content opened, a delete made the content route a 500."""
    store = BatchStore(tmp_path)
    f, g = upload(store, [line(0)]), upload(store, [line(1)])
    store.file_path(f["id"]).unlink()  # deleted after its object was read
    with pytest.raises(ProtocolError) as e:
        store.open_content(f["id"], ALICE)
    assert (e.value.status, e.value.code) == (404, "not_found")
    with store.open_content(g["id"], ALICE) as content:
        store.delete_file(g["id"], ALICE)  # while it is being read
        assert json.loads(content.read())["custom_id"] == "r1"


def test_ids_the_store_never_makes_are_404s(tmp_path) -> None:
    """Over-long Unicode ids were 500s ("File name too long") on every route."""
    store = BatchStore(tmp_path)
    for bad in ("../x", "file-..", "a/b", "file-nope", *LONG_IDS):
        for call in (store.file, store.batch, store.delete_file):
            with pytest.raises(ProtocolError) as e:
                call(bad, ALICE)
            assert e.value.status == 404


def test_objects_belong_to_their_owner(tmp_path) -> None:
    store = BatchStore(tmp_path)
    f = upload(store, [line(0)])
    b = batch_of(store, f["id"])
    assert [o["id"] for o in store.list_files(None, ALICE)] == [f["id"]]
    assert [o["id"] for o in store.list_batches(ALICE)] == [b["id"]]
    assert store.list_files(None, BOB) == [] and store.list_batches(BOB) == []
    for call in (lambda: store.file(f["id"], BOB), lambda: store.batch(b["id"], BOB),
                 lambda: store.delete_file(f["id"], BOB)):
        with pytest.raises(ProtocolError) as e:
            call()
        assert e.value.status == 404
    assert store.file(f["id"], ALICE)["id"] == f["id"]  # Bob's delete did nothing
    assert "alice-key" not in "".join(p.read_text() for p in tmp_path.rglob("*.json"))


def test_an_object_cut_short_is_left_out_with_one_log_line(tmp_path, caplog) -> None:
    store = BatchStore(tmp_path)
    good = upload(store, [line(0)])
    batch = batch_of(store, good["id"])
    (store.files / f"{new_id('file')}.json").write_bytes(b"")  # power loss
    (store.batches / f"{new_id('batch')}.json").write_text('{"id": 3, "stat')
    (store.batches / f"{new_id('batch')}.json").write_text("[1, 2]")
    with caplog.at_level(logging.WARNING, logger="server.batch.store"):
        for _ in range(3):
            assert [o["id"] for o in store.list_files(None, ALICE)] == [good["id"]]
            assert [o["id"] for o in store.list_batches(None)] == [batch["id"]]
    assert len(caplog.records) == 3  # one line per damaged object, not per listing


def test_folders_are_0700_and_files_0600_whatever_the_umask(tmp_path) -> None:
    old = os.umask(0o022)
    try:
        store = BatchStore(tmp_path / "store")
        f = upload(store, [line(0)])
        bid = batch_of(store, f["id"])["id"]
        store.append_answer(bid, "output", answer("x"))
        store.append_answer(bid, "errors", answer("y"))
        store.keep_answers(bid, "errors", new_id("file"), ALICE)
    finally:
        os.umask(old)
    folders = [tmp_path / "store", store.files, store.batches]
    files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert len(files) == 7  # the lock, upload + object, batch, output answers, kept errors + object
    assert {oct(p.stat().st_mode & 0o777) for p in folders} == {"0o700"}
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o600"}


def test_an_existing_store_is_made_private(tmp_path) -> None:
    """A store an older server wrote with the umask: its folders and files tightened."""
    (tmp_path / "files").mkdir(mode=0o755)
    (tmp_path / "files" / f"{new_id('file')}.jsonl").write_text("{}\n")
    os.chmod(tmp_path / "files" / next(os.scandir(tmp_path / "files")).name, 0o644)
    store = BatchStore(tmp_path)
    assert oct(store.files.stat().st_mode & 0o777) == "0o700"
    assert {oct(p.stat().st_mode & 0o777) for p in store.files.iterdir()} == {"0o600"}


def test_temporary_files_a_stop_left_are_removed_at_open(tmp_path) -> None:
    """An upload or an object cut short by a crash (`.part`, `.tmp`): removed when the store
    opens (they were counted in its budget for good, and never removed)."""
    store = BatchStore(tmp_path, disk_budget=8192)
    kept = upload(store, [line(0)])
    store.close()
    (tmp_path / "files" / f"{new_id('file')}.part").write_bytes(b"x" * 5000)
    (tmp_path / "batches" / f"{new_id('batch')}.tmp").write_bytes(b"{}")
    store = BatchStore(tmp_path, disk_budget=8192)
    left = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted(["lock", f"{kept['id']}.json", f"{kept['id']}.jsonl"])
    upload(store, [line(i, padding="p" * 100) for i in range(30)])  # ~4 KB: fits again


@pytest.fixture
def foreign(tmp_path):
    """A folder owned by another user (uid 65534, "nobody"): only root can make one."""
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    try:
        os.chown(folder, 65534, 65534)
    except PermissionError:
        pytest.skip("making a folder of another user's needs root")
    return folder


def test_one_store_a_folder_until_it_is_closed(tmp_path) -> None:
    """Two servers on one folder would both run its batches: a second store is refused with a
    line saying what to do, and opens once the first is closed."""
    first = BatchStore(tmp_path)
    f = upload(first, [line(0)])
    with pytest.raises(FolderBusy, match="give each server its own --batch-dir"):
        BatchStore(tmp_path)
    first.close()
    assert BatchStore(tmp_path).file(f["id"], ALICE)["id"] == f["id"]


def test_a_server_whose_engine_fails_to_start_lets_go_of_its_store(tmp_path, monkeypatch) -> None:
    """The store is opened (and its folder locked) before the engine starts: a start that fails
    let go of it (it kept the lock: the next server on the folder was refused as busy)."""
    def refused(config: ServerConfig):
        raise StartupRefusal("no engine today")

    monkeypatch.setattr(server.app, "_start_engine", refused)
    app = server.app.create_app(ServerConfig(batch_dir=str(tmp_path)))

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(StartupRefusal):
        asyncio.run(start())
    BatchStore(tmp_path).close()


def test_a_folder_of_another_users_is_refused(foreign) -> None:
    with pytest.raises(OSError, match="owned by uid 65534"):
        BatchStore(foreign)


def test_the_server_refuses_a_batch_dir_of_another_users_in_one_line(foreign) -> None:
    run = subprocess.run([sys.executable, "-m", "server", "--model", "demo", "--batch-dir",
                          str(foreign)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"compiled-engine serve: error: --batch-dir: {foreign} is owned by uid 65534, not by "
        f"this user (uid {os.geteuid()}): refusing to keep private data there"]


@pytest.mark.parametrize("flag", ["--batch-disk-gb", "--max-batch-output-mb",
                                  "--max-batch-file-mb", "--grammar-compile-memory"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_size_flag_not_above_0_is_refused_in_one_line(flag: str, value: str, capsys) -> None:
    """0 and below were taken (a budget of 0 refused every upload, a compile memory of 0 every
    constraint), an infinite --batch-disk-gb crashed the start."""
    parser = argparse.ArgumentParser(prog="compiled-engine serve")
    add_serve_args(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args([f"{flag}={value}"])
    unit = "GiB" if flag == "--batch-disk-gb" else "MiB"
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"compiled-engine serve: error: argument {flag}: a size in {unit} is "
        f"{'a number' if unit == 'GiB' else 'a whole number'} above 0, not {value!r}")


def test_the_disk_budget_refuses_an_upload_past_it(tmp_path) -> None:
    store = BatchStore(tmp_path, disk_budget=4096)
    upload(store, [line(0)])
    used = store.used
    with pytest.raises(ProtocolError) as e:
        upload(store, [line(i, padding="p" * 100) for i in range(40)])  # ~5 KB
    assert (e.value.status, e.value.code) == (413, "batch_store_full")
    assert store.used == used and len(store.list_files(None, ALICE)) == 1
    assert not list(store.files.glob("*.part"))


def on_disk(store: BatchStore) -> int:
    """The bytes of every file the store keeps (its lock left out)."""
    return sum(p.stat().st_size for folder in (store.files, store.batches)
               for p in folder.iterdir())


def test_every_write_counts_against_the_disk_budget_and_a_batch_past_it_is_refused(
        tmp_path) -> None:
    """Answers were appended and batches created past the budget: repeated batches on one file
    filled the disk."""
    store = BatchStore(tmp_path, disk_budget=4096)
    f = upload(store, [line(0)])
    bid = batch_of(store, f["id"])["id"]
    kept = [store.append_answer(bid, "errors", answer(f"r{i}")) for i in range(80)]
    assert False in kept and kept == sorted(kept, reverse=True)  # kept until full, then none
    assert store.used == on_disk(store) <= 4096
    for call in (lambda: batch_of(store, f["id"]), lambda: upload(store, [line(1)])):
        with pytest.raises(ProtocolError) as e:
            call()
        assert (e.value.status, e.value.code) == (413, "batch_store_full")
    assert store.used == on_disk(store) and len(store.list_batches(None)) == 1


def test_an_owners_unfinished_batches_are_bounded(tmp_path) -> None:
    store = BatchStore(tmp_path)
    f, g = upload(store, [line(0)]), upload(store, [line(0)], owner=BOB)
    batches = [batch_of(store, f["id"]) for _ in range(MAX_UNFINISHED)]
    with pytest.raises(ProtocolError) as e:
        batch_of(store, f["id"])
    assert (e.value.status, e.value.code) == (429, "too_many_unfinished_batches")
    assert "at most 64 of your batches" in e.value.message
    batch_of(store, g["id"], owner=BOB)  # another owner's are its own
    store.put_batch(batches[0] | {"status": "completed"})
    batch_of(store, f["id"])  # one ended: room for one more


@pytest.mark.parametrize("bound", ["answers", "disk"])
def test_a_batch_the_disk_budget_stops_ends_with_one_error_not_a_line_each(tmp_path,
                                                                           bound: str) -> None:
    """Past --max-batch-output-mb (`answers`) or with long answers (`disk`), the lines left were
    error lines written whatever the budget: a 50,000-line file wrote ~12 MB a batch."""
    store = BatchStore(tmp_path, disk_budget=1 << 30)
    batch_of(store, upload(store, [line(i) for i in range(200)])["id"])
    store.disk_budget = store.used + 4096
    ran = []

    async def execute(url: str, body: dict) -> tuple[int, bytes]:
        ran.append(body)
        return 200, json.dumps({"text": "t" * 600}).encode()

    done = run_batch(store, execute, concurrency=1,
                     max_output_bytes=1500 if bound == "answers" else 1 << 30)
    counts = done["request_counts"]
    assert done["status"] == "completed" and counts["total"] == 200
    assert counts["completed"] + counts["failed"] == 200 and counts["completed"] >= 1
    assert on_disk(store) <= store.disk_budget + 2048  # the batch's own objects past it
    assert len(ran) <= 8
    assert [e["code"] for e in done["errors"]["data"]] == ["batch_store_full"]
    assert f"{200 - counts['completed'] - lines_in(store, done['error_file_id'])} requests were " \
        "not answered" in done["errors"]["data"][0]["message"]


def lines_in(store: BatchStore, file_id: str | None) -> int:
    return 0 if file_id is None else len(store.file_path(file_id).read_bytes().splitlines())


def run_batch(store: BatchStore, execute, **runner) -> dict:
    """A batch of the store's (its one batch) run to its end by a runner over `execute`."""
    async def go() -> None:
        r = BatchRunner(store, execute, max_line_bytes=1 << 16, priority=None, **runner)
        await r.run_batch(store.list_batches(None)[0])
    asyncio.run(asyncio.wait_for(go(), 60))
    return store.list_batches(None)[0]


def test_a_lines_n_counts_against_the_batchs_share_of_the_queue(tmp_path) -> None:
    """16 sequences in flight: lines asking for n=8 run two at a time (were 16 lines: 128)."""
    store = BatchStore(tmp_path)
    batch_of(store, upload(store, [line(i, n=8) for i in range(6)])["id"])
    flight, peak, asked = [0], [0], []

    async def execute(url: str, body: dict) -> tuple[int, bytes]:
        flight[0] += body["n"]
        peak[0] = max(peak[0], flight[0])
        await asyncio.sleep(0.05)
        flight[0] -= body["n"]
        return 200, b"{}"

    done = run_batch(store, execute, concurrency=16, room=lambda n: asked.append(n) or True)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 6
    assert peak[0] <= 16 and set(asked) == {8}


def test_a_batchs_answers_are_bounded(tmp_path) -> None:
    """Past --max-batch-output-mb each line left is an error line saying so, unrun."""
    store = BatchStore(tmp_path)
    batch_of(store, upload(store, [line(i) for i in range(10)])["id"])
    ran = []

    async def execute(url: str, body: dict) -> tuple[int, bytes]:
        ran.append(body)
        return 200, json.dumps({"text": "t" * 900}).encode()

    done = run_batch(store, execute, concurrency=1, max_output_bytes=3000)
    counts = done["request_counts"]
    assert done["status"] == "completed" and (counts["completed"], counts["failed"]) == (2, 8)
    errors = map(json.loads, store.file_path(done["error_file_id"]).read_text().splitlines())
    assert {e["error"]["code"] for e in errors} == {"batch_output_too_large"}
    assert store.file_path(done["output_file_id"]).stat().st_size <= 3000
    assert len(ran) == 3  # the one that did not fit, and none after it
