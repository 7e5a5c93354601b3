"""A GCS server on localhost for the tests: gcp-storage-emulator, plus generation headers.

gcp-storage-emulator serves the GCS JSON API in pure Python, in memory. Its downloads lack
the ``x-goog-generation`` (and ``x-goog-metageneration``) response headers that real GCS
sends and TensorStore's gcs driver, which writes Orbax's checkpoint arrays, requires (it
fails with "Malformed StorageGeneration" once it reads an object back); this adds them from
the object's own metadata. It also lacks the ``moveTo`` object method gcsfs renames with
(a bootstrapped teacher is written to ``<path>.partial``, then renamed into place): answered
501, gcsfs retries it with backoff for about 35 s before falling back to copy and delete;
this serves it as a copy then a delete, answering the new object as GCS does. Its multipart
uploads (what gcsfs sends a small file as) are parsed with the ``email`` package, which drops
a content's last byte when that byte is ``\r`` (one upload in 256 of random bytes, such as
an event file ending in a CRC): this splits them on the boundary itself. Not emulated:
``ifGenerationMatch`` preconditions (what keeps concurrent writers from overwriting each
other), which one writer never trips.

    python tests/gcs_emulator.py PORT BUCKET
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from http import HTTPStatus


def main(port: int, bucket: str) -> None:
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    plain_download = objects.download

    def download(request, response, storage, *args, **kwargs):
        plain_download(request, response, storage, *args, **kwargs)
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except NotFound:
            return
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])

    def move(request, response, storage, *args, **kwargs):
        bucket, src = request.params["bucket_name"], request.params["object_id"]
        try:
            moved = objects._copy(
                request.base_url, storage, bucket, src, bucket, request.params["dest_object_id"]
            )
        except NotFound:
            response.status = HTTPStatus.NOT_FOUND
            return
        objects._delete(storage, bucket, src)
        response.json(moved)

    objects.download = download  # before `server` builds its routing table from it
    from gcp_storage_emulator import server as emulator

    emulator._read_data = _exact_multipart(emulator)
    from gcp_storage_emulator.server import create_server

    # matched before the generic object path, which has no POST (the 501 above)
    move_route = (
        rf"^{re.escape(emulator.settings.API_ENDPOINT)}/b/(?P<bucket_name>[-.\w]+)/o/"
        r"(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$",
        {"POST": move},
    )
    emulator.HANDLERS = (move_route, *emulator.HANDLERS)

    logging.basicConfig(level=logging.CRITICAL)  # it logs every 404 as an error
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    print(f"gcs emulator on 127.0.0.1:{port}, bucket {bucket}", flush=True)
    while True:
        time.sleep(3600)


def _exact_multipart(emulator):
    """The emulator's body reader, with multipart/related uploads split byte for byte."""
    plain_read = emulator._read_data

    def read_data(handler, query):
        content_type = handler.headers.get("Content-Type") or ""
        if not content_type.startswith("multipart/related"):
            return plain_read(handler, query)
        boundary = re.search(r'boundary="?([^";]+)"?', content_type).group(1).encode()
        raw = emulator._decode_raw_data(emulator._read_raw_data(handler), handler)
        # --B NL headers NL NL body NL --B ... NL --B--, NL being CRLF or (gcsfs) LF
        nl = b"\r\n" if raw.startswith(b"--" + boundary + b"\r\n") else b"\n"
        _, *parts, _ = (nl + raw).split(nl + b"--" + boundary)
        (_, meta), (data_head, data) = (p.removeprefix(nl).split(nl + nl, 1) for p in parts)
        kind = re.search(rb"(?im)^content-type:\s*([^;\r\n]+)", data_head)
        return {
            "meta": json.loads(meta),
            "content": data,
            "content-type": kind.group(1).decode().strip() if kind else "text/plain",
        }

    return read_data


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
