"""The Files and Batch API against what a client may get wrong or leave unfinished: malformed multipart
uploads and their part headers (a NUL, an overlong line, bytes that are not UTF-8, an unknown charset, a
part with no name), a body that never finishes, HEAD on a file's content, lone UTF-16 surrogates in
the JSON of a batch or of its lines. Each is a 4xx naming what was wrong, or works; never a 500, never a
connection held for good. In-process, with the fake line executor of `test_batches`."""

from __future__ import annotations

import asyncio
import json
import re
import tempfile

import pytest

from gateway import handlers
from gateway.batch import endpoints
from pools.store import batch_files, batch_store
from tests.gateway.test_batches import CHAT, _client, _FakeExecutor, _jsonl, _jsonl_file, _line, _upload, _wait

BOUNDARY = b"cgBoundary"
MULTIPART = {"Content-Type": "multipart/form-data; boundary=" + BOUNDARY.decode()}
PURPOSE = b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch'


def _file_part(filename: bytes = b"in.jsonl", content: bytes = b"{}\n") -> bytes:
    return b'Content-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n\r\n' + content


def _multipart(*parts: bytes) -> bytes:
    """A multipart/form-data body of `parts` (each its header lines, a blank line and its content)."""
    return b"".join(b"--" + BOUNDARY + b"\r\n" + part + b"\r\n" for part in parts) + b"--" + BOUNDARY + b"--\r\n"


async def _post_upload(client, body: bytes):
    r = await client.post("/v1/files", data=body, headers=MULTIPART)
    return r.status, await r.json()


async def _raw_answers(client, request: bytes, *, bodies: tuple[bool, ...]) -> list[tuple[bytes, bytes]]:
    """Send `request` on a connection of its own and read an answer per item of `bodies`, one right after the
    other: (its head, and its body of Content-Length bytes when that item is true). A test that hangs fails."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    answers = []
    try:
        writer.write(request)
        async with asyncio.timeout(10):
            for with_body in bodies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"Content-Length: (\d+)", head)[1]) if with_body else 0
                answers.append((head, await reader.readexactly(length)))
    finally:
        writer.close()
    return answers


async def test_malformed_multipart_uploads_are_400s_naming_the_part(aiohttp_client, tmp_path, tiny_model):
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor())
    nested = b'Content-Type: multipart/mixed; boundary=inner\r\n\r\n--inner\r\n\r\nx\r\n--inner--'
    cases = [
        (_multipart(PURPOSE, _file_part(b"a\x00b.jsonl")), "body"),                       # a NUL in a header
        (_multipart(PURPOSE, _file_part(b"x" * 100_000)), "body"),                        # a header line over 8190
        (_multipart(b'Content-Disposition: form-data; name="purpose"\r\nContent-Type: text/plain; '
                    b'charset=bogus-charset\r\n\r\nbatch', _file_part()), "purpose"),     # an unknown charset
        (_multipart(b'Content-Disposition: form-data; name="purpose"\r\n\r\n\xff\xfe', _file_part()), "purpose"),
        (_multipart(b'Content-Disposition: form-data; name="purpose"\r\nContent-Transfer-Encoding: bogus\r\n\r\n'
                    b'batch', _file_part()), "purpose"),
        (_multipart(b'Content-Disposition: form-data; name="_charset_"\r\n\r\n' + b"x" * 40, _file_part()), "body"),
        (_multipart(PURPOSE, b"Content-Disposition: form-data\r\n\r\nx"), "body"),         # a part with no name
        (_multipart(PURPOSE, b"Content-Type: text/plain\r\n\r\nx"), "body"),               # no Content-Disposition
        (_multipart(PURPOSE, nested), "body"),                                             # a nested multipart
        (b"--" + BOUNDARY + b"\r\nContent-Disposition: form-da", "body"),                  # cut off mid-headers
    ]
    for body, param in cases:
        status, answer = await _post_upload(client, body)
        assert (status, answer["error"]["param"]) == (400, param), (body[:120], answer)
        assert answer["error"]["message"].startswith(param + ": ") and "None" not in answer["error"]["message"]
    status, answer = await _post_upload(client, _multipart(PURPOSE, b"Content-Disposition: form-data\r\n\r\nx"))
    assert "no name" in answer["error"]["message"], answer


async def test_a_filename_is_stored_cleaned_of_control_characters_and_undecodable_bytes(aiohttp_client, tmp_path,
                                                                                        tiny_model):
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor())
    cases = [(b"\xff\xfe.jsonl", "\ufffd\ufffd.jsonl"),
             (b"r\xc3\xa9sum\xc3\xa9.jsonl", "r\u00e9sum\u00e9.jsonl"),          # UTF-8 kept as it is
             (b"x" * 5000, "x" * 255)]
    for filename, stored in cases:
        status, answer = await _post_upload(client, _multipart(PURPOSE, _file_part(filename)))
        assert (status, answer.get("filename")) == (200, stored), answer
    encoded = b'Content-Disposition: form-data; name="file"; filename*=utf-8\'\'a%00b%1b%7f.jsonl\r\n\r\n{}\n'
    status, answer = await _post_upload(client, _multipart(PURPOSE, encoded))
    assert (status, answer.get("filename")) == (200, "ab.jsonl"), answer
    file = await (await client.get(f"/v1/files/{answer['id']}")).json()
    assert file["filename"] == "ab.jsonl"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_an_upload_whose_body_never_finishes_is_a_408(aiohttp_client, tmp_path, tiny_model, monkeypatch,
                                                            framing):
    monkeypatch.setattr(handlers, "BODY_READ_SECONDS", 0.5)
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor())
    sent = b"--" + BOUNDARY + b"\r\n" + _file_part(content=b'{"custom_id": ')
    framed = (b"Content-Length: 100000\r\n\r\n" + sent if framing == "content-length" else
              b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(sent) + sent + b"\r\n")   # no last chunk
    request = (b"POST /v1/files HTTP/1.1\r\nHost: localhost\r\nContent-Type: " + MULTIPART["Content-Type"].encode()
               + b"\r\n" + framed)
    [(head, body)] = await _raw_answers(client, request, bodies=(True,))
    assert head.startswith(b"HTTP/1.1 408 ") and json.loads(body)["error"]["param"] == "body", (head, body)


async def test_an_upload_goes_to_disk_past_its_first_bytes_and_is_stored_whole(aiohttp_client, tmp_path, tiny_model,
                                                                               monkeypatch):
    """Uploads at once hold no more memory than SPOOL_BYTES each: the rest is spooled to a temporary file, closed
    once stored (or refused: a file past MAX_FILE_BYTES is a 413 naming `file`), written off the event loop (a
    slow disk's writes may block); the stored file is the upload."""
    import threading

    spools: list = []
    writers: set[str] = set()

    class Spool(tempfile.SpooledTemporaryFile):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            spools.append(self)
            assert kwargs["dir"] == tmp_path   # the data dir's disk (a temporary directory may be in memory)

        def write(self, data):
            writers.add(threading.current_thread().name)
            return super().write(data)

    monkeypatch.setattr(endpoints, "SPOOL_BYTES", 1000)
    monkeypatch.setattr(endpoints.tempfile, "SpooledTemporaryFile", Spool)
    monkeypatch.setattr(batch_files, "CHUNK_BYTES", 4096)   # stored in pieces too
    monkeypatch.setattr(batch_store, "CHUNK_BYTES", 4096)
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor())
    content = _jsonl(*(_line(f"line-{i}", "x" * 200) for i in range(100)))    # about 28 KB
    r = await _upload(client, content)
    assert r.status == 200, await r.text()
    stored = await r.json()
    assert stored["bytes"] == len(content)
    assert await (await client.get(f"/v1/files/{stored['id']}/content")).read() == content
    assert [(s._rolled, s.closed) for s in spools] == [(True, True)] and threading.current_thread().name not in writers
    monkeypatch.setattr(endpoints, "MAX_FILE_BYTES", 10_000)
    r = await _upload(client, content)
    assert r.status == 413 and (await r.json())["error"]["param"] == "file"
    assert len(spools) == 2 and spools[1].closed


async def test_head_on_a_files_content_sends_its_headers_and_no_body(aiohttp_client, tmp_path, tiny_model):
    client = await _client(aiohttp_client, tmp_path, tiny_model, _FakeExecutor())
    content = _jsonl(_line("a"), _line("b"))
    file_id = (await (await _upload(client, content)).json())["id"]
    r = await client.head(f"/v1/files/{file_id}/content")
    assert r.status == 200 and r.content_length == len(content)
    # on one keep-alive connection, the answer after a HEAD starts right after the HEAD's headers
    path = f"/v1/files/{file_id}".encode()
    (head, _), (after, body) = await _raw_answers(
        client, b"HEAD " + path + b"/content HTTP/1.1\r\nHost: localhost\r\n\r\n"
        b"GET " + path + b" HTTP/1.1\r\nHost: localhost\r\n\r\n", bodies=(False, True))
    assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: %d\r\n" % len(content) in head, head
    assert after.startswith(b"HTTP/1.1 200 ") and json.loads(body)["id"] == file_id, after


async def test_lone_surrogates_in_a_batch_or_its_lines_are_never_a_500(aiohttp_client, tmp_path, tiny_model):
    fake = _FakeExecutor()
    client = await _client(aiohttp_client, tmp_path, tiny_model, fake)
    json_headers = {"Content-Type": "application/json"}
    create = '{"input_file_id": "%s", "endpoint": "' + CHAT + '", "completion_window": "24h"%s}'
    r = await client.post("/v1/batches", data=create % ("\\ud800", ""), headers=json_headers)
    unknown = await client.post("/v1/batches", data=create % ("file-nope", ""), headers=json_headers)
    assert (r.status, (await r.json())["error"]["param"]) == (400, "input_file_id")
    assert (await r.json())["error"]["message"].replace("'\\ud800'", "<id>") == \
        (await unknown.json())["error"]["message"].replace("'file-nope'", "<id>")
    lines = [b'{"custom_id": "\\ud800", "method": "POST", "url": "' + CHAT.encode() + b'", "body": {}}',
             b'{"custom_id": "x\\udfff", "method": "GET", "url": "' + CHAT.encode() + b'", "body": {}}',
             _line("ok")]
    file_id = (await (await _upload(client, _jsonl(*lines))).json())["id"]
    metadata = ', "metadata": {"k": "\\ud800", "\\udc00": "v"}'
    r = await client.post("/v1/batches", data=create % (file_id, metadata), headers=json_headers)
    assert r.status == 200, await r.text()
    batch = await r.json()
    assert batch["metadata"] == {"k": "\ud800", "\udc00": "v"}
    done = await _wait(client, batch["id"])
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2} and set(fake.calls) == {"ok"}
    errors = await _jsonl_file(client, done["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == \
        [(None, "invalid_custom_id", 1), (None, "invalid_custom_id", 2)]
