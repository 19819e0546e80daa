"""Checkpoint format and storage, in process: boxes, shard encoding, partial reads, retries, corruption."""

import errno
import itertools
import json
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


def test_a_resume_names_its_files_any_way_that_reaches_them(tmp_path, monkeypatch):
    """data.path, data.tokenizer, model.name: the same file by a relative path, an absolute one or a link is the
    same run; another file is another run, named by key."""
    import types

    from xla_shard import config
    from xla_shard.checkpoint.run_record import changed_identity

    data = tmp_path / "corpus.txt"
    data.write_text("some text\n")
    (tmp_path / "link.txt").symlink_to(data)
    (tmp_path / "other.txt").write_text("other text\n")
    monkeypatch.chdir(tmp_path)

    def written_with(path):
        cfg = config.load(None, ["data.kind=text", f"data.path={path}"])
        return types.SimpleNamespace(data={"config": cfg.model_dump(mode="json", by_alias=True)}, url="ckpt/step-1")

    for first, now in (("corpus.txt", data), (data, "corpus.txt"), ("link.txt", "./corpus.txt")):
        assert changed_identity(written_with(first), config.load(None, ["data.kind=text", f"data.path={now}"])
                                .run_identity()) is None
    changed = changed_identity(written_with("corpus.txt"), config.load(None, ["data.kind=text",
                                                                               "data.path=other.txt"]).run_identity())
    assert changed is not None and changed[0] == "data.path"


@pytest.fixture
def transformers_imported():
    """A save reads the model's transformers config: transformers' first import (seconds) is not the subject."""
    import transformers.modeling_utils  # noqa: F401


@pytest.mark.usefixtures("transformers_imported")
def test_a_save_records_its_slowest_writer_and_the_estimate_reads_that_rate(tmp_path):
    """An emergency save of a host's state, against the window its capacity gives: the rate is the one this
    run's newest checkpoint measured (its manifest records its slowest writer), else the one given, else an
    assumed one that says so."""
    from conftest import in_process_checkpointer

    from xla_shard import config
    from xla_shard.checkpoint import window

    said = []
    model = torch.nn.Linear(256, 256)
    checkpointer = in_process_checkpointer(tmp_path / "ckpt", "checkpoint.preemption_grace_s=0.000001",
                                           log=said.append)
    checkpointer.save(1, model, None)
    written = json.loads((tmp_path / "ckpt" / layout.step_dir(1) / layout.MANIFEST).read_text())["write"]
    assert written["writers"] == 1 and written["seconds"] > 0
    shard = next((tmp_path / "ckpt" / layout.step_dir(1) / "shards").glob("*.safetensors"))
    assert written["bytes"] == shard.stat().st_size
    assert any("longer than checkpoint.preemption_grace_s" in line for line in said), said  # the run says it
    cfg = config.load(None, [f"checkpoint.dir={tmp_path / 'ckpt'}", "model.name=llama-7b"])
    measured = window.rate_for(cfg, None)
    assert measured.source.startswith("measured by the save of") and measured.mib_s == pytest.approx(
        written["bytes"] / written["seconds"] / 2**20)
    assert window.rate_for(cfg, 500.0).mib_s == 500.0
    unmeasured = config.load(None, [f"checkpoint.dir={tmp_path / 'none'}"])
    assert window.rate_for(unmeasured, None).source.startswith("assumed")

    # an 8B's full checkpoint with AdamW's moments: 12 bytes a parameter, ~96 GB over its writers
    assert window.state_bytes(8_000_000_000, None, "adamw") == 96_000_000_000
    assert window.state_bytes(8_000_000_000, 40_000_000, "adamw", frozen_saved=False) == 480_000_000  # LoRA
    rate = window.Rate(100.0, "given")
    spot = config.load(None, ["deploy.provisioning=spot"])
    fits, line = window.say(spot, "tpu-vm", 8_000_000_000, None, 4, 8, 2.0, rate)
    assert not fits and "against 30 s" in line and "loses the steps since the last checkpoint" in line
    fits, line = window.say(spot, "gke", 100_000_000, None, 4, 64, 0.0, rate)  # 18.75 MB a writer: 0.2 s
    assert fits and "against 15 s" in line
    on_demand = config.load(None, ["deploy.provisioning=on-demand", "checkpoint.preemption_grace_s=600"])
    fits, line = window.say(on_demand, "gke", 8_000_000_000, None, 4, 16, 0.0, rate)  # 6 GB a writer: 57 s
    assert fits and "against 600 s" in line


@pytest.mark.usefixtures("transformers_imported")
def test_a_processs_own_tensors_come_back_to_it_and_stay_out_of_the_model(tmp_path):
    """`save(own=)`: what one process made (a generation's examples), in its shard under its writer's index; a
    restore gives them back to the same writer, and neither the model's match nor an export sees them."""
    from conftest import in_process_checkpointer

    model = torch.nn.Linear(4, 4)
    own = {"generation": torch.tensor(3), "0/input_ids": torch.arange(12).view(2, 6),
           "0/old_logps": torch.randn(2, 3)}
    saver = in_process_checkpointer(tmp_path / "ckpt")
    saver.save(2, model, None, own=own)
    manifest = json.loads((tmp_path / "ckpt" / layout.step_dir(2) / layout.MANIFEST).read_text())
    assert {name for name in manifest["tensors"] if name.startswith("own/")} == {f"own/00000/{n}" for n in own}
    back: dict = {}
    restored = torch.nn.Linear(4, 4)
    assert in_process_checkpointer(tmp_path / "ckpt").restore(restored, None, own=back) == 2
    assert set(back) == set(own) and all(torch.equal(back[n], own[n]) for n in own)
    assert torch.equal(restored.weight, model.weight)
    plain = torch.nn.Linear(4, 4)  # a restore that asks for none reads the model alone
    assert in_process_checkpointer(tmp_path / "ckpt").restore(plain, None) == 2
