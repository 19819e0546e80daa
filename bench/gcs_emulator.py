"""Helpers for tests and benchmarks: a real GCS server on loopback.

`gcp-storage-emulator` (the `test` extra) implements the GCS JSON API; gcsfs talks to it when
STORAGE_EMULATOR_HOST points at it (xla_shard's storage then uses anonymous credentials). Nothing here is
used in training.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Link:
    """TCP forwarding from a loopback port to the emulator's, which an outage cuts: nothing listens and every
    open connection drops, while the emulator lives on. (Killing the emulator instead could interrupt its own
    index file mid-write, and it would then not start again.)"""

    def __init__(self, port: int, target: int):
        self.port, self.target = port, target
        self.listener: socket.socket | None = None
        self.open_sockets: set[socket.socket] = set()
        self.lock = threading.Lock()

    def up(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR: the port again at once
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def down(self) -> None:
        listener, self.listener = self.listener, None
        with self.lock:
            sockets, self.open_sockets = self.open_sockets, set()
        for sock in [listener, *sockets] if listener else sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # cut
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                if self.listener is not listener:  # cut meanwhile
                    client.close(), upstream.close()
                    return
                self.open_sockets |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self.lock:
                self.open_sockets -= {source, sink}


class GcsEmulator:
    """`gcp-storage-emulator` storing under `workdir`, reached on a free loopback port through a link that
    `outage` cuts and `restore` mends, as a network outage would."""

    def __init__(self, workdir: Path | str, bucket: str = "xla-shard-test"):
        self.workdir, self.bucket = Path(workdir), bucket
        self.port, self.emulator_port = _free_port(), _free_port()
        self.host = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.link = _Link(self.port, self.emulator_port)

    def start(self, timeout_s: float = 90.0) -> GcsEmulator:
        """`timeout_s`: its first start in a fresh environment compiles its dependencies' bytecode (on Dec 7 this
        2-core machine passed 30 s doing so, beside a test suite)."""
        exe = Path(sys.executable).parent / "gcp-storage-emulator"
        log = self.workdir / f"gcs-emulator-{self.emulator_port}.log"
        with open(log, "ab") as out:
            self.process = subprocess.Popen([str(exe), "start", "--host", "127.0.0.1", "--port",
                                             str(self.emulator_port), "--default-bucket", self.bucket, "-q"],
                                            cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.emulator_port), timeout=0.2).close()
                self.link.up()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gcp-storage-emulator did not start within {timeout_s:g}s (exit "
                           f"{self.process.returncode}): {log.read_text()[-2000:]}")

    def outage(self) -> None:
        """Nothing answers on the port any more, and open connections drop; the stored objects stay."""
        self.link.down()

    def restore(self) -> None:
        self.link.up()

    def stop(self) -> None:
        self.link.down()
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server through gs:// URLs."""
        return {"STORAGE_EMULATOR_HOST": self.host, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def url(self, prefix: str) -> str:
        return f"gs://{self.bucket}/{prefix}"
