"""A GCS server on localhost for the tests: gcp-storage-emulator, plus generation headers.

gcp-storage-emulator serves the GCS JSON API in pure Python, in memory. Its downloads lack
the ``x-goog-generation`` (and ``x-goog-metageneration``) response headers that real GCS
sends and TensorStore's gcs driver, which writes Orbax's checkpoint arrays, requires (it
fails with "Malformed StorageGeneration" once it reads an object back); this adds them from
the object's own metadata. It also lacks the ``moveTo`` object method gcsfs renames with
(a bootstrapped teacher is written to ``<path>.partial``, then renamed into place): answered
501, gcsfs retries it with backoff for about 35 s before falling back to copy and delete;
this serves it as a copy then a delete, answering the new object as GCS does. Not emulated:
``ifGenerationMatch`` preconditions (what keeps concurrent writers from overwriting each
other), which one writer never trips.

    python tests/gcs_emulator.py PORT BUCKET
"""

from __future__ import annotations

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


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
