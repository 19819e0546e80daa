"""Helpers for tests and benchmarks: a real GCS server on loopback.

`gcp-storage-emulator` (the `test` extra) implements the GCS JSON API; gcsfs talks to it when
STORAGE_EMULATOR_HOST points at it (xla_shard's storage then uses anonymous credentials). Nothing here is
used in training.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path


class GcsEmulator:
    """`gcp-storage-emulator` on a free loopback port, storing under `workdir`, so a restart keeps the objects."""

    def __init__(self, workdir: Path | str, bucket: str = "xla-shard-test"):
        self.workdir, self.bucket = Path(workdir), bucket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.host = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> GcsEmulator:
        exe = Path(sys.executable).parent / "gcp-storage-emulator"
        self.process = subprocess.Popen([str(exe), "start", "--host", "127.0.0.1", "--port", str(self.port),
                                         "--default-bucket", self.bucket, "-q"], cwd=self.workdir,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gcp-storage-emulator did not start within {timeout_s:g}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server through gs:// URLs."""
        return {"STORAGE_EMULATOR_HOST": self.host, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def url(self, prefix: str) -> str:
        return f"gs://{self.bucket}/{prefix}"
