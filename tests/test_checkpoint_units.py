"""Checkpoint format and storage, in process: boxes, shard encoding, partial reads, retries, corruption."""

import errno
import itertools
import math

import pytest
import torch

from xla_shard.checkpoint import ChunkReader, Manifest, layout
from xla_shard.checkpoint.contract import StateTensor, region, unstack
from xla_shard.io.storage import Storage, StorageError, is_transient


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5), (2, 1, 3, 2)])
def test_range_to_boxes_covers_exactly_the_range(shape):
    numel = math.prod(shape)
    flat = torch.arange(numel).reshape(shape)
    for start, stop in itertools.combinations(range(numel + 1), 2):
        covered = []
        for offsets, sizes in layout.range_to_boxes(shape, start, stop):
            covered += flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1).tolist()
        assert covered == list(range(start, stop)), (shape, start, stop)


def _write(storage: Storage, chunks_by_writer: list[list[layout.Entry]]) -> Manifest:
    indexes = []
    for rank, entries in enumerate(chunks_by_writer):
        parts, index = layout.encode_shard(entries)
        layout.add_checksums(parts, index)
        index["file"] = layout.shard_file(rank, len(chunks_by_writer))
        storage.write(index["file"], parts)
        indexes.append(index)
    files, tensors = layout.merge_indexes(indexes)
    return Manifest(storage.url, {"files": files, "tensors": tensors})


@pytest.mark.parametrize("boxes", [
    [((0, 0, 0), (3, 2, 4)), ((0, 2, 0), (3, 3, 4))],  # split inside each layer (how a scanned stack is sharded)
    [((0, 0, 0), (2, 5, 4)), ((2, 0, 0), (1, 5, 4))],  # split across layers
])
def test_a_stacked_tensor_saves_and_loads_as_its_layers(boxes):
    """Chunks of a [layers, ...] tensor are handed out per layer under each layer's name, and a load that fills
    every layer fills the stacked tensor exactly once, with each box's values in place."""
    whole = torch.arange(3 * 5 * 4, dtype=torch.float32).reshape(3, 5, 4)
    target, fills = torch.zeros_like(whole), []

    def fill(values):
        fills.append(len(values))
        for box, value in zip(boxes, values):
            target[region(box, ((0, 0, 0), whole.shape))] = value

    state = StateTensor("w", (3, 5, 4), whole.dtype,
                        lambda: [(o, whole[region((o, s), ((0, 0, 0), whole.shape))].clone()) for o, s in boxes],
                        lambda: boxes, fill)
    layers = unstack(state, ["layers.0.w", "layers.1.w", "layers.2.w"])
    assert [t.name for t in layers] == ["layers.0.w", "layers.1.w", "layers.2.w"]
    for i, layer in enumerate(layers):
        assert layer.shape == (5, 4)
        for offsets, data in layer.chunks():
            assert torch.equal(data, whole[i][region((offsets, tuple(data.shape)), ((0, 0), (5, 4)))])
        assert sum(math.prod(data.shape) for _, data in layer.chunks()) == 20
    def values(i):
        return [whole[i][region(box, ((0, 0), (5, 4)))] for box in layers[i].boxes()]

    for i in (2, 1):  # in any order; nothing is filled before the last layer arrives
        layers[i].fill(values(i))
        assert not fills
    layers[0].fill(values(0))
    assert fills == [len(boxes)] and torch.equal(target, whole)


def test_boxes_written_by_one_layout_read_back_in_another():
    """Rows sharded over 2 writers (FSDP2-like), read as column shards of 4 (SPMD-like) and as one whole."""
    storage = Storage("memory://layout-test")
    full = torch.randn(6, 8)
    entries = [[layout.Entry("w", (6, 8), torch.float32, [((0, 0), full[:3].clone())])],
               [layout.Entry("w", (6, 8), torch.float32, [((3, 0), full[3:].clone())])]]
    reader = ChunkReader(storage, _write(storage, entries))
    columns = reader.read([("w", ((0, c), (6, 2))) for c in range(0, 8, 2)])
    assert torch.equal(torch.cat(columns, dim=1), full)
    (whole,) = reader.read([("w", ((0, 0), (6, 8)))])
    assert torch.equal(whole, full)


def test_a_flipped_byte_is_refused_naming_the_file():
    storage = Storage("memory://corrupt-test")
    full = torch.randn(4, 4)
    manifest = _write(storage, [[layout.Entry("w", (4, 4), torch.float32, [((0, 0), full)])]])
    name = layout.shard_file(0, 1)
    data = bytearray(storage.read_bytes(name))
    data[-3] ^= 0xFF
    storage.write(name, bytes(data))
    with pytest.raises(Exception, match=r"00000-of-00001\.safetensors is corrupt"):
        ChunkReader(storage, manifest).read([("w", ((0, 0), (4, 4)))])


@pytest.mark.e2e
def test_transient_errors_are_retried_until_they_pass():
    from gcsfs.retry import HttpError

    storage = Storage("memory://retry-test", retry_deadline_s=10)
    failures = iter([HttpError({"code": 503, "message": "backend unavailable"}),
                     HttpError({"code": 429, "message": "slow down"}),
                     ConnectionRefusedError(errno.ECONNREFUSED, "refused")])
    calls = []

    def flaky():
        calls.append(1)
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return "done"

    assert storage.retry("flaky op", flaky) == "done"
    assert len(calls) == 4


@pytest.mark.e2e
def test_an_outage_fails_at_the_deadline_and_a_real_error_at_once():
    from gcsfs.retry import HttpError

    storage = Storage("memory://outage-test", retry_deadline_s=1.0)
    with pytest.raises(StorageError, match="writing gs://b/x: gave up after retrying for 1s"):
        storage.retry("writing gs://b/x", lambda: (_ for _ in ()).throw(HttpError({"code": 503, "message": "down"})))
    calls = []

    def forbidden():
        calls.append(1)
        raise HttpError({"code": 403, "message": "forbidden"})

    with pytest.raises(StorageError, match="not retried"):
        storage.retry("writing gs://b/y", forbidden)
    assert len(calls) == 1
    assert not is_transient(FileNotFoundError("x")) and is_transient(TimeoutError())


def test_a_checkpoint_written_before_a_resume_key_existed_was_written_with_its_default(tmp_path):
    import types

    from xla_shard import config
    from xla_shard.checkpoint import Checkpointer
    from xla_shard.errors import ConfigError

    cfg = config.load(None, [f"checkpoint.dir={tmp_path}"])
    checkpointer = Checkpointer(cfg.checkpoint, types.SimpleNamespace(run_identity=cfg.run_identity))
    saved = cfg.model_dump(mode="json", by_alias=True)
    del saved["data"]["kind"], saved["model"]["lora"]  # as a checkpoint from before those keys were written
    checkpointer._check_identity(types.SimpleNamespace(data={"config": saved}, url="old"), None)  # resumes
    saved["data"]["kind"] = "chat"  # a checkpoint of chat rows does not continue a run of text rows
    with pytest.raises(ConfigError) as raised:
        checkpointer._check_identity(types.SimpleNamespace(data={"config": saved}, url="other"), None)
    assert raised.value.key == "data.kind" and "'chat'" in str(raised.value)
