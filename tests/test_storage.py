"""`Storage` against a GCS server that is down or stalls: the caller's retry deadline bounds every call."""

import socket
import threading
import time

import pytest

from xla_shard.io.storage import Storage, StorageError


def _gave_up_within(storage: Storage, seconds: float) -> float:
    started = time.monotonic()
    with pytest.raises(StorageError, match=f"gave up after retrying for {storage.retry_deadline_s:g}s"):
        storage.exists("step-00000001/manifest.json")
    took = time.monotonic() - started
    assert took < seconds, f"{took:.1f}s past a {storage.retry_deadline_s:g}s deadline"
    return took


@pytest.mark.e2e
def test_a_server_that_went_away_fails_at_the_deadline_not_after_gcsfs_retries(gcs):
    """gcsfs's own six attempts (31 s of backoff) used to run beneath each of our retries."""
    Storage(gcs.url("run")).write("x", b"x")  # a connection is open and pooled
    gcs.outage()
    _gave_up_within(Storage(gcs.url("run"), retry_deadline_s=1), seconds=10)


def test_a_server_that_accepts_and_never_answers_times_out_per_read(monkeypatch):
    from xla_shard.io import gcs
    from xla_shard.io.gcs import SingleAttemptGCSFileSystem

    held = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        threading.Thread(target=lambda: held.extend(server.accept() for _ in range(100)), daemon=True).start()
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setattr(gcs, "READ_TIMEOUT_S", 0.3)
        SingleAttemptGCSFileSystem.clear_instance_cache()
        try:
            _gave_up_within(Storage("gs://bucket/run", retry_deadline_s=1), seconds=4)
        finally:
            SingleAttemptGCSFileSystem.clear_instance_cache()
    assert held, "the client never connected"


def test_what_gcsfs_used_to_retry_itself_is_transient_and_a_refusal_is_not():
    from gcsfs.retry import ChecksumError, HttpError
    from google.auth.exceptions import RefreshError

    from xla_shard.io.storage import is_transient

    assert is_transient(RefreshError("metadata server: timed out")) and is_transient(ChecksumError("md5"))
    assert is_transient(HttpError({"code": 401, "message": "Invalid Credentials"}))
    assert not is_transient(HttpError({"code": 403, "message": "forbidden"}))
    assert not is_transient(HttpError({"code": 401, "message": "Anonymous caller does not have access"}))


@pytest.mark.e2e
def test_a_staged_output_dir_goes_up_whole_and_an_outage_loses_nothing(gcs):
    """Files staged locally go up whole, at most every `every_s` unless forced; in an outage the sync says so
    once and fails, the run goes on, and closing keeps the staging folder when the last upload fails too."""
    from xla_shard.io.staged import StagedDir

    said = []
    staged = StagedDir(gcs.url("out"), retry_deadline_s=1, every_s=3600, warn=said.append)
    (staged.local / "metrics.jsonl").write_text('{"step": 1}\n')
    assert staged.sync(force=True) and Storage(gcs.url("out")).read_bytes("metrics.jsonl") == b'{"step": 1}\n'
    (staged.local / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert staged.sync()  # within every_s: nothing sent
    assert Storage(gcs.url("out")).read_bytes("metrics.jsonl") == b'{"step": 1}\n'
    gcs.outage()
    assert not staged.sync(force=True) and not staged.sync(force=True)
    assert len(said) == 1 and "uploading to" in said[0] and f"the records stay in {staged.local}" in said[0]
    staged.close()
    assert "stay in" in said[-1] and (staged.local / "metrics.jsonl").read_text().count("step") == 2
    gcs.restore()
    again = StagedDir(gcs.url("out"), warn=said.append)
    assert again.fetch("metrics.jsonl").read_text() == '{"step": 1}\n'  # what the bucket holds
    again.close()


@pytest.mark.e2e
def test_a_bucket_output_dir_that_does_not_exist_is_said_once_and_the_records_stay_local(gcs):
    """The run's record, not its master: a missing (or deleted) bucket neither raises nor goes unsaid."""
    from xla_shard.io.staged import StagedDir

    said = []
    staged = StagedDir("gs://no-such-bucket/out", retry_deadline_s=1, warn=said.append)
    assert not staged.fetch("metrics.jsonl").exists() and not said  # it holds nothing yet
    (staged.local / "metrics.jsonl").write_text('{"step": 1}\n')
    assert not staged.sync(force=True) and not staged.sync(force=True)
    assert len(said) == 1 and "uploading to gs://no-such-bucket/out failed" in said[0] and str(staged.local) in said[0]
    staged.close()
    assert str(staged.local) in said[-1] and (staged.local / "metrics.jsonl").exists()
