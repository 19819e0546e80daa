"""gcsfs as `Storage` drives it: one attempt per call, and a request that stalls times out.

gcsfs retries each HTTP request itself, six attempts with about 31 s of backoff between them, beneath
`Storage.retry`. A save during an outage then took half a minute per storage call whatever
`checkpoint.retry_deadline_s` said, and the error still claimed the deadline. Here gcsfs tries once and
`Storage.retry` alone retries, with its own backoff, up to its deadline. aiohttp's default gives a request five
minutes in all, which a multi-gigabyte shard can need and a stalled server wastes: a connection gets 30 s to
open and a read 60 s without a byte (the GCS client libraries' request timeout), however long the transfer.
"""

from __future__ import annotations

import aiohttp
from gcsfs.core import GCSFileSystem

CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 60.0

# gcsfs's methods that wrap one request in its retry loop (`gcsfs.retry.retry_request`); `__wrapped__` is the
# single request inside. A gcsfs that no longer has one keeps its own retries (tests/test_storage.py notices).
_RETRYING = ("_request", "_get_file_request", "_get_file_concurrent")


class SingleAttemptGCSFileSystem(GCSFileSystem):
    def __init__(self, *args, requests_timeout=None, **kwargs):
        timeout = requests_timeout or aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                                            sock_read=READ_TIMEOUT_S)
        super().__init__(*args, requests_timeout=timeout, **kwargs)


for _name in _RETRYING:
    _method = getattr(GCSFileSystem, _name, None)
    if _method is not None and hasattr(_method, "__wrapped__"):
        setattr(SingleAttemptGCSFileSystem, _name, _method.__wrapped__)
