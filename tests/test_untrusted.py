"""Files from the hub, a bucket or another job are untrusted input, tested as an attacker would write them.

For each class of attack: hostile model directories (custom code, links out, damaged safetensors headers and
indexes), tampered checkpoints (paths out, wrong types, impossible sizes, overlapping bytes), hostile
tokenizers and data files. Each is refused in one line naming the file and the field, with nothing read from
outside, nothing executed, nothing allocated on its say-so, and nothing left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from xla_shard.checkpoint import layout
from xla_shard.cli import main

CONFIG = "scripts/configs/tiny_llama_cpu.yaml"


def refused(capsys, args, *words) -> str:
    """`xla-shard ARGS` in this process: exit 2, one line, no traceback, naming each of `words`."""
    code = main(list(args))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# ---- a checkpoint written by hand, exactly as the writer lays it out -------------------------------------
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def write_checkpoint(step_dir: Path, model, step: int = 3) -> Path:
    """A committed one-writer checkpoint of `model`'s parameters, with its hf_config (so it can be exported)."""
    from xla_shard.checkpoint import Storage

    storage = Storage(str(step_dir))
    entries = [layout.Entry(f"model/{name}", tuple(p.shape), p.dtype, [((0,) * p.dim(), p.detach().clone())])
               for name, p in model.named_parameters()]
    parts, index = layout.encode_shard(entries)
    layout.add_checksums(parts, index)
    index.update(file=layout.shard_file(0, 1), writer=0, writers=1, rng={})
    storage.write(index["file"], parts)
    files, tensors = layout.merge_indexes([index])
    hf = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    manifest = {"format": layout.FORMAT, "step": step, "writers": 1, "created": 0.0, "config": {}, "files": files,
                "rng": {"0": {}}, "tensors": tensors, "hf_config": hf, "run": {"id": "r1"}}
    storage.write(layout.MANIFEST, json.dumps(manifest).encode())
    return step_dir


@pytest.fixture
def checkpoint(tmp_path):
    model = tiny_llama()
    return write_checkpoint(tmp_path / "ckpt" / layout.step_dir(3), model), model


def edit_manifest(step_dir: Path, edit) -> None:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    edit(manifest)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def first_chunk(m: dict) -> dict:
    return m["tensors"]["model/model.embed_tokens.weight"]["chunks"][0]


# ---- 2. every path a checkpoint names stays inside it --------------------------------------------------
@pytest.mark.parametrize("outside", ["../../../secret.safetensors", "/etc/passwd", "file:///etc/passwd",
                                     "memory://elsewhere/x", "shards/../../secret", "shards//x", "~/x"])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, capsys, checkpoint, outside):
    step, _ = checkpoint
    secret = tmp_path / "secret.safetensors"
    shutil.copy(step / "shards" / "00000-of-00001.safetensors", secret)  # identical bytes: only the path tells

    def point_outside(m):
        real = layout.shard_file(0, 1)
        m["files"][outside] = m["files"].pop(real)
        for meta in m["tensors"].values():
            for chunk in meta["chunks"]:
                chunk["file"], chunk["crc32"] = outside, None

    edit_manifest(step, point_outside)
    for args in (["ckpt", "verify", str(step)], ["ckpt", "export", str(step), "--to", str(tmp_path / "out")]):
        refused(capsys, args, "manifest.json is damaged", repr(outside), "not a plain name inside the directory")
    assert not (tmp_path / "out").exists()


def test_a_committed_chunk_without_a_crc32_is_refused(capsys, checkpoint):
    step, _ = checkpoint
    edit_manifest(step, lambda m: first_chunk(m).update(crc32=None))
    refused(capsys, ["ckpt", "verify", str(step)], "tensors['model/model.embed_tokens.weight'].chunks[0].crc32",
            "every chunk of a committed checkpoint carries its checksum")


def test_a_shard_that_is_a_link_out_of_the_checkpoint_is_not_read(tmp_path, capsys, checkpoint):
    step, _ = checkpoint
    shard = step / "shards" / "00000-of-00001.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)  # the same bytes, so every crc32 would match
    refused(capsys, ["ckpt", "export", str(step), "--to", str(tmp_path / "out")], "is a link to",
            str(outside), "outside the checkpoint")
    code = main(["ckpt", "verify", str(step)])
    assert code == 2 and "outside the checkpoint" in capsys.readouterr().err


def _not_a_file(path: Path, kind: str, tmp_path: Path) -> str:
    """Make `path` something a reader must not stream: what the refusal says of it."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # opened as a file, a read would block for ever
        return "is a FIFO"
    if kind == "device":
        path.symlink_to("/dev/zero")  # a read would never end
        return "is a link to /dev/zero"
    if kind == "directory":
        path.mkdir()
        return "directory"
    if kind == "loop":
        path.symlink_to(path.name)  # a link to itself: every open fails (ELOOP), as a missing file's does
        return "too many levels of symbolic links"
    outside = tmp_path / "elsewhere"
    outside.write_bytes(b"{}")
    path.symlink_to(outside)
    return "outside"


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "link out", "loop"])
@pytest.mark.parametrize("which", ["manifest.json", "shards/00000-of-00001.safetensors"])
def test_a_checkpoint_file_that_is_not_a_file_inside_it_is_never_read(tmp_path, capsys, checkpoint, which, kind):
    """FIFOs, devices, directories, links out and links to themselves in place of a manifest or a shard: one
    line each (a shard said once, not again for each tensor in it), no read that blocks or never ends (the
    sizes' claims included: a FIFO's or a device's says nothing)."""
    step, _ = checkpoint
    words = _not_a_file(step / which, kind, tmp_path)
    refused(capsys, ["ckpt", "export", str(step), "--to", str(tmp_path / "out")], which, words)
    code = main(["ckpt", "verify", str(step)])
    err = capsys.readouterr().err
    assert code == 2 and which in err and words in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


# ---- 3. manifests: one strict schema, before anything is allocated or read -----------------------------
def _emb(m):
    return m["tensors"]["model/model.embed_tokens.weight"]


@pytest.mark.parametrize("edit, words", [
    (lambda m: _emb(m).update(shape="32"), ["tensors['model/model.embed_tokens.weight'].shape",
                                            "expected a list of integers, got a string"]),
    (lambda m: _emb(m).update(shape=[64.0, 16]), ["shape[0]", "expected an integer"]),
    (lambda m: _emb(m).update(shape=[True, 16]), ["shape[0]", "got a boolean"]),
    (lambda m: _emb(m).update(shape=[-64, 16]), ["shape[0]", "below 0"]),
    (lambda m: _emb(m).pop("chunks"), ["chunks", "the field is missing"]),
    (lambda m: first_chunk(m).pop("crc32"), ["chunks[0].crc32", "the field is missing"]),
    (lambda m: first_chunk(m).update(start="64"), ["chunks[0].start", "got a string"]),
    # a chunk that claims 4 TB in a file the manifest says is small
    (lambda m: (_emb(m).update(shape=[2**30, 1024]), first_chunk(m).update(sizes=[2**30, 1024],
                                                                            end=first_chunk(m)["start"] + 2**42)),
     ["chunks[0]", "lie outside the data of"]),
    (lambda m: first_chunk(m).update(offsets=[60, 0]), ["chunks[0]", "reaches outside the shape"]),
    # two tensors sharing one byte range
    (lambda m: m["tensors"]["model/model.norm.weight"]["chunks"][0].update(
        start=m["tensors"]["model/lm_head.weight"]["chunks"][0]["start"],
        end=m["tensors"]["model/lm_head.weight"]["chunks"][0]["start"] + 64), ["overlaps"]),
    # one tensor stored twice over in two halves of the same rows, the volumes still adding up
    (lambda m: _emb(m).update(chunks=[{**first_chunk(m), "sizes": [32, 16], "end": first_chunk(m)["start"] + 2048},
                                      {**first_chunk(m), "sizes": [32, 16], "start": first_chunk(m)["start"] + 2048}]),
     ["chunks at [0, 0] and [0, 0] overlap"]),
    (lambda m: m.update(files={**m["files"], "shards/00000-of-00001.safetensors": {"bytes": 10, "header_bytes": 8,
                                                                                   "header_crc32": "00000000"}}),
     ["lie outside the data of"]),
    (lambda m: m.update(rng=[]), ["rng: expected a JSON object, got a list"]),
    (lambda m: m.update(writers=0), ["writers", "below 1"]),
    (lambda m: m.update(created="yesterday"), ["created", "a time in seconds"]),
    (lambda m: m["hf_config"].update(auto_map={"AutoConfig": "evil.Config"}), ["hf_config.auto_map"]),
    (lambda m: m.update(extra={"best": [1, 2]}), ["extra['best']: expected a JSON object, got a list"]),
])
def test_a_manifest_that_fails_the_schema_is_one_line(tmp_path, capsys, checkpoint, edit, words):
    step, _ = checkpoint
    edit_manifest(step, edit)
    refused(capsys, ["ckpt", "verify", str(step)], "manifest.json is damaged", *words)
    refused(capsys, ["ckpt", "export", str(step), "--to", str(tmp_path / "out")], *words)
    assert not (tmp_path / "out").exists()


def test_a_claim_of_4_tb_is_checked_against_the_bytes_stored_before_anything_is_allocated(tmp_path, capsys,
                                                                                         checkpoint):
    """Every number consistent with every other, the file's size in the manifest included: only the real file
    says the claim is false, and it is asked before a buffer is made."""
    step, _ = checkpoint

    def claim(m):  # the last tensor in the file grows to 4 TB, and so does the file's size
        meta = max(m["tensors"].values(), key=lambda t: t["chunks"][0]["start"])
        chunk, huge = meta["chunks"][0], 2**42
        meta["shape"] = chunk["sizes"] = [huge // 4 // 1024, 1024]
        chunk["offsets"] = [0, 0]
        chunk["end"] = chunk["start"] + huge
        m["files"][chunk["file"]]["bytes"] = chunk["end"]

    edit_manifest(step, claim)
    refused(capsys, ["ckpt", "export", str(step), "--to", str(tmp_path / "out")], "holds", "bytes, the manifest "
            "places chunks up to byte", "truncated or the manifest edited")
    assert main(["ckpt", "verify", str(step)]) == 2
    assert "the manifest says" in capsys.readouterr().err


@pytest.mark.parametrize("edit, words", [
    # a layer count transformers would spend minutes building, even on the meta device
    (lambda m: m["hf_config"].update(num_hidden_layers=10**8),
     ["hf_config.num_hidden_layers is 100000000", "its tensors hold 1 layer(s)"]),
    # the same count reached through a tensor's name
    (lambda m: m["tensors"].update({"model/model.layers.99999999.mlp.up_proj.weight":
                                    m["tensors"].pop("model/model.layers.0.mlp.up_proj.weight")}),
     ["tensor names reach index 99999999", "beyond the 4096 layers"]),
])
def test_a_layer_count_is_not_the_manifests_to_choose(tmp_path, capsys, checkpoint, edit, words):
    """The export builds the model the manifest's hf_config describes: a count there or in a name would
    otherwise decide how long that takes. A config claiming layers the checkpoint lacks would also load
    with those layers freshly initialised."""
    step, _ = checkpoint
    edit_manifest(step, edit)
    refused(capsys, ["ckpt", "export", str(step), "--to", str(tmp_path / "out")], str(step), *words)
    assert not (tmp_path / "out").exists()


def test_a_manifest_nested_without_end_is_refused(capsys, checkpoint):
    step, _ = checkpoint
    (step / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    refused(capsys, ["ckpt", "verify", str(step)], "manifest.json is damaged", "JSON")


def test_a_damaged_manifest_is_listed_as_damaged(capsys, checkpoint):
    step, _ = checkpoint
    edit_manifest(step, lambda m: m.update(files=7))
    assert main(["ckpt", "list", str(step.parent)]) == 0
    out = capsys.readouterr().out
    assert "damaged" in out and "files: expected a JSON object" in out


# ---- 3. safetensors headers of a model directory ------------------------------------------------------
def _header_file(directory: Path, header, data: bytes, raw: bytes | None = None) -> None:
    head = raw if raw is not None else json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + data)


@pytest.fixture
def hf_dir(tmp_path, model_dirs):
    directory = tmp_path / "model"
    shutil.copytree(model_dirs.llama_tied, directory)
    return directory


def _stored_header(directory: Path) -> tuple[dict, bytes]:
    raw = (directory / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _first(header: dict) -> str:
    return sorted(k for k in header if k != "__metadata__")[0]


def _shift(header: dict, key: str, by: int) -> dict:
    header[key]["data_offsets"] = [o + by for o in header[key]["data_offsets"]]
    return header


@pytest.mark.parametrize("damage, words", [
    (lambda h, d: (None, d, b"[1, 2, 3]"), ["expected a JSON object of tensors, got a list"]),
    (lambda h, d: (None, d, b'"weights"'), ["expected a JSON object of tensors, got a string"]),
    (lambda h, d: (None, d, b"[" * 200_000 + b"]" * 200_000), ["not valid JSON"]),
    (lambda h, d: (h | {_first(h): {**h[_first(h)], "data_offsets": ["0", "64"]}}, d, None),
     ["data_offsets[0]", "got a string"]),
    (lambda h, d: (h | {_first(h): {**h[_first(h)], "data_offsets": [0.0, 64.5]}}, d, None),
     ["data_offsets[0]", "expected an integer"]),
    (lambda h, d: (h | {_first(h): {**h[_first(h)], "shape": [2.5, 4]}}, d, None), ["shape[0]", "expected an integer"]),
    (lambda h, d: (_shift(h, _first(h), 8), d, None), ["data_offsets"]),  # overlaps the next, or a gap
    (lambda h, d: (h, d[:-100], None), ["data"]),  # offsets past the end of the file
    (lambda h, d: (h | {"extra": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, d, None), ["overlaps"]),
    (lambda h, d: (h | {_first(h): {"dtype": "F32", "shape": [4]}}, d, None), ["header[", "lacks 'data_offsets'"]),
])
def test_a_damaged_safetensors_header_is_refused_at_config_check(capsys, hf_dir, damage, words):
    from safetensors import safe_open

    header, data = _stored_header(hf_dir)
    header, data, raw = damage(header, data)
    _header_file(hf_dir, header, data, raw)
    with pytest.raises(Exception):  # noqa: B017 (its error types vary by damage) the safetensors library refuses each of these too
        with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    refused(capsys, ["config", "check", CONFIG, "--set", f"model.name={hf_dir}"], "model.safetensors", *words)


def test_a_header_length_past_the_end_of_the_file_is_refused(capsys, hf_dir):
    (hf_dir / "model.safetensors").write_bytes(struct.pack("<Q", 5000) + b"{}")
    refused(capsys, ["config", "check", CONFIG, "--set", f"model.name={hf_dir}"], "a header of 5000 bytes")


@pytest.mark.parametrize("target", ["../secret.safetensors", "/etc/passwd", "https://example.com/x.safetensors"])
def test_an_index_naming_a_file_outside_the_directory_is_refused(tmp_path, capsys, model_dirs, target):
    directory = tmp_path / "model"
    shutil.copytree(model_dirs.llama, directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = target
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(capsys, ["config", "check", CONFIG, "--set", f"model.name={directory}"], f"weight_map[{key!r}]",
            "not a plain name inside the directory")


def test_weights_that_link_out_of_the_model_directory_are_refused(tmp_path, capsys, hf_dir):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(hf_dir / "model.safetensors", outside)
    (hf_dir / "model.safetensors").symlink_to(outside)
    refused(capsys, ["config", "check", CONFIG, "--set", f"model.name={hf_dir}"], "is a link to", str(outside))


def test_a_hugging_face_cache_snapshot_links_into_its_blobs(tmp_path, capsys, model_dirs):
    """The hub's own cache layout: snapshots/<rev>/file -> ../../blobs/<hash>. That is inside the model."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, source in enumerate(sorted(Path(model_dirs.llama_tied).iterdir())):
        shutil.copy(source, blobs / f"blob{i}")
        (snapshot / source.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    assert main(["config", "check", CONFIG, "--set", f"model.name={snapshot}"]) == 0, capsys.readouterr().err


# ---- 1. no code from a model directory runs, nothing prompts ------------------------------------------
def _custom_code_dir(tmp_path: Path, hf_dir: Path, file: str) -> Path:
    marker = tmp_path / "code-ran"
    (hf_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                    "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
                                    "from transformers import LlamaConfig as EvilConfig\n")
    fields = json.loads((hf_dir / file).read_text())
    fields["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"],
                          "AutoConfig": "evil.EvilConfig"}
    (hf_dir / file).write_text(json.dumps(fields))
    return marker


@pytest.mark.e2e
@pytest.mark.parametrize("file", ["tokenizer_config.json", "config.json"])
def test_a_directory_that_needs_custom_code_is_refused_and_nothing_runs(tmp_path, hf_dir, file):
    marker = _custom_code_dir(tmp_path, hf_dir, file)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 200)
    import subprocess
    import sys

    from tests.conftest import REPO, _env

    done = subprocess.run([sys.executable, "-m", "xla_shard.cli", "config", "check", CONFIG, "--set",
                           f"model.name={hf_dir}", "--set", f"data.path={corpus}"], input="y\ny\n", text=True,
                          capture_output=True, env=_env(), cwd=REPO, timeout=300)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"{file} has 'auto_map'" in done.stderr and "model.name" in done.stderr
    assert "[y/N]" not in done.stdout + done.stderr  # nothing asked
    assert not marker.exists()


def test_a_tokenizer_directory_with_custom_code_is_refused(tmp_path, capsys, hf_dir, model_dirs):
    marker = _custom_code_dir(tmp_path, hf_dir, "tokenizer_config.json")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 200)
    refused(capsys, ["config", "check", CONFIG, "--set", f"model.name={model_dirs.llama_tied}",
                     "--set", f"data.path={corpus}", "--set", f"data.tokenizer={hf_dir}"],
            "data.tokenizer", "tokenizer_config.json has 'auto_map'")
    assert not marker.exists()


def test_a_tokenizer_file_that_links_out_is_refused(tmp_path, capsys, hf_dir):
    outside = tmp_path / "passwd.json"
    shutil.move(hf_dir / "tokenizer.json", outside)
    (hf_dir / "tokenizer.json").symlink_to(outside)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 200)
    refused(capsys, ["config", "check", CONFIG, "--set", f"model.name={hf_dir}", "--set", f"data.path={corpus}"],
            "tokenizer.json is a link to", "outside the model directory")


# ---- 8. tokens the model has no row for ---------------------------------------------------------------
def test_a_tokenizer_with_ids_beyond_the_embedding_is_refused(tmp_path, capsys, hf_dir):
    """A vocabulary with a gap: len(tokenizer) fits the embedding, its largest id does not."""
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    rows = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    vocab = tokenizer["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = rows + 80  # as many tokens as rows, but one id beyond them
    (hf_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 200)
    refused(capsys, ["config", "check", CONFIG, "--set", f"model.name={hf_dir}", "--set", f"data.path={corpus}"],
            "model.name", f"token ids up to {rows + 80} ({rows} tokens)", f"{rows} rows")


def test_a_tokenizer_json_without_added_tokens_is_one_line(tmp_path, capsys, hf_dir):
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    del tokenizer["added_tokens"]
    (hf_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 200)
    refused(capsys, ["config", "check", CONFIG, "--set", f"model.name={hf_dir}", "--set", f"data.path={corpus}"],
            "model.name", "no tokenizer could be loaded")


# ---- 5. exports are atomic, complete and where asked ----------------------------------------------------
def _weights_of(directory) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(str(directory)).state_dict().items()}


def test_export_refuses_a_used_destination_and_overwrite_replaces_it_whole(tmp_path, capsys, checkpoint):
    step, model = checkpoint
    out = tmp_path / "out"
    assert main(["ckpt", "export", str(step), "--to", str(out)]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    newer = tiny_llama()
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(1.0)
    step2 = write_checkpoint(tmp_path / "ckpt2" / layout.step_dir(3), newer)
    refused(capsys, ["ckpt", "export", str(step2), "--to", str(out), "--max-shard-size", "4KB"],
            "already holds 2 file(s)", "--overwrite")
    assert main(["ckpt", "export", str(step2), "--to", str(out), "--max-shard-size", "4KB", "--overwrite"]) == 0
    files = sorted(os.listdir(out))
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files  # no stale weights
    got = _weights_of(out)
    for name, value in newer.state_dict().items():
        assert torch.equal(got[name], value), name
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name or ".replaced-" in p.name]


@pytest.mark.e2e
def test_an_export_killed_before_it_finished_leaves_no_model_where_asked(tmp_path, checkpoint, model_dirs):
    """SIGKILL after the weights, before the tokenizer and config: nothing at --to loads as a model."""
    import subprocess
    import sys

    from tests.conftest import REPO, _env

    step, _ = checkpoint
    out = tmp_path / "out"
    script = ("import os, signal, sys\n"
              "import xla_shard.checkpoint.export as export\n"
              "export._copy_companions = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
              "export.export(sys.argv[1], sys.argv[2])\n")
    done = subprocess.run([sys.executable, "-c", script, str(step), str(out)], env=_env(), cwd=REPO, timeout=300)
    assert done.returncode == -9
    assert not out.exists()  # the weights went to a hidden sibling, never renamed into place
    assert [p.name.startswith(".out.partial-") for p in tmp_path.iterdir() if p.name != "ckpt"] == [True]


def test_a_failed_export_leaves_nothing(tmp_path, capsys, checkpoint):
    step, _ = checkpoint
    shard = step / "shards" / "00000-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-200])  # the last tensor cannot be read
    refused(capsys, ["ckpt", "export", str(step), "--to", str(tmp_path / "out")], "truncated")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .partial directory either


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of 16 KiB (tmpfs; mounting needs root, else the test is skipped): `mount(options)`."""
    import subprocess

    mounted = []

    def mount(options: str) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=16k,{options}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a small filesystem here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], capture_output=True)


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(capsys, checkpoint, small_disk):
    disk = small_disk("rw")
    refused(capsys, ["ckpt", "export", str(checkpoint[0]), "--to", str(disk / "out")], "No space left on device")
    assert os.listdir(disk) == []  # neither the export nor its hidden partial sibling


def test_export_onto_a_read_only_disk_is_one_line(capsys, checkpoint, small_disk):
    disk = small_disk("ro")
    refused(capsys, ["ckpt", "export", str(checkpoint[0]), "--to", str(disk / "out")], "cannot write next to it",
            "Read-only file system")


def test_a_manifest_without_model_tensors_exports_nothing(tmp_path, capsys, checkpoint):
    step, _ = checkpoint
    edit_manifest(step, lambda m: m.update(tensors={}))
    refused(capsys, ["ckpt", "export", str(step), "--to", str(tmp_path / "out")], "holds no model tensors")
    assert not (tmp_path / "out").exists()


def test_export_to_a_bucket_writes_there_and_loads(tmp_path, capsys, checkpoint, gcs, monkeypatch):
    step, model = checkpoint
    monkeypatch.chdir(tmp_path)
    url = gcs.url("exports/tiny")
    assert main(["ckpt", "export", str(step), "--to", url]) == 0, capsys.readouterr().err
    assert not Path("gs:").exists()  # not a local directory named after the scheme
    from xla_shard.checkpoint import Storage

    storage = Storage(url)
    local = tmp_path / "downloaded"
    local.mkdir()
    for name in storage.glob("*"):
        (local / name).write_bytes(storage.read_bytes(name))
    got = _weights_of(local)
    for name, value in model.state_dict().items():
        assert torch.equal(got[name], value), name
    capsys.readouterr()
    refused(capsys, ["ckpt", "export", str(step), "--to", url], "already holds")


# ---- 6. a user error in a worker is one line and exit 2 ------------------------------------------------
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.torch_version  # torchrun's and xmp.spawn's ends
@pytest.mark.parametrize("sets", [["backend=torch_fsdp", "cpu_devices=2"],   # torchrun, 2 workers
                                  pytest.param(["backend=xla_fsdp", "cpu_devices=1"], marks=pytest.mark.xla)])
def test_a_worker_error_under_each_launcher_is_one_line_and_exit_2(tmp_path, checkpoint, sets):
    step, _ = checkpoint
    edit_manifest(step, lambda m: _emb(m).update(shape="32"))
    done = run_cli("train", CONFIG, *[a for s in sets for a in ("--set", s)], "--set",
                   f"output_dir={tmp_path / 'run'}", "--set", f"checkpoint.dir={tmp_path / 'c2'}",
                   "--set", f"checkpoint.resume={step}", "--set", "train.steps=2")
    errors = [line for line in done.stderr.splitlines() if line.startswith("xla-shard: error:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr, done.stderr
    assert "manifest.json is damaged" in errors[0] and "shape" in errors[0]


# ---- 7. the remaining tracebacks --------------------------------------------------------------------------
@pytest.mark.parametrize("name, content, words", [
    ("rows.jsonl", '{"text": "a b c"}\n{"text": null}\n', ["data.text_field", "row 1 has no 'text' (null"]),
    ("rows.csv", "text,other\nhello,1\n,2\n", ["data.text_field", "row 1 has no 'text'"]),
    ("empty.jsonl", "", ["data.path", "holds no rows"]),
    ("header.csv", "text,label\n", ["data.path", "holds no rows"]),
])
def test_data_files_without_usable_rows_are_one_line(tmp_path, capsys, model_dirs, name, content, words):
    path = tmp_path / name
    path.write_text(content)
    refused(capsys, ["config", "check", CONFIG, "--set", f"model.name={model_dirs.llama_tied}",
                     "--set", f"data.path={path}"], *words)


@pytest.mark.parametrize("fraction, words", [(0.9999, "leaves no training rows")])  # an eval set < 1 batch is fine
def test_an_eval_fraction_that_leaves_nothing_is_one_line(tmp_path, capsys, model_dirs, fraction, words):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i} " * 20}) + "\n" for i in range(40)))
    refused(capsys, ["config", "check", CONFIG, "--set", f"model.name={model_dirs.llama_tied}",
                     "--set", f"data.path={path}", "--set", f"data.eval_fraction={fraction}"],
            "data.eval_fraction", words)


def test_deeply_nested_yaml_and_overrides_are_one_line(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text("train: " + "[" * 100_000 + "]" * 100_000 + "\n")
    refused(capsys, ["config", "check", str(path)], "not valid YAML", "nested deeper")
    refused(capsys, ["config", "check", CONFIG, "--set", "model.overrides=" + "{a: " * 5000 + "1" + "}" * 5000],
            "model.overrides", "nested deeper")


def test_outputs_that_cannot_be_written_are_one_line(tmp_path, capsys):
    refused(capsys, ["config", "import", "tests/fixtures/accelerate_fsdp_guide.yaml", "-o",
                     str(tmp_path / "missing" / "dir" / "out.yaml")], "-o", "No such file or directory")
    (tmp_path / "afile").write_text("")
    refused(capsys, ["gcp", "render", "scripts/configs/tpu_v4_spmd.yaml", "--target", "tpu-vm", "--set",
                     "deploy.project=my-project", "--out", str(tmp_path / "afile")], "--out", "is a file")


# ---- 8. nothing silently wrong ----------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["plan", "--devices", "8", "--accelerator", "h100", "--hosts", "0"], ["--hosts", "needs at least 1"]),
    (["plan", "--devices", "8", "--accelerator", "h100", "--hbm-gib", "0"], ["--hbm-gib", "above 0"]),
    (["plan", "--devices", "8", "--accelerator", "h100", "--hbm-gib", "-5"], ["--hbm-gib", "above 0"]),
    (["plan", "--devices", "8", "--accelerator", "h100", "--hbm-gib", "nan"], ["--hbm-gib", "finite"]),
    (["plan", "--devices", "8", "--accelerator", "h100", "--top", "-3"], ["--top", "needs at least 1"]),
    (["plan", "--devices", "16", "--accelerator", "h100", "--slices", "2"], ["--slices", "TPU pods"]),
    (["plan", "--devices", "16", "--accelerator", "v5p", "--hosts", "2"], ["--hosts", "counts GPU nodes"]),
    (["train", CONFIG, "--nproc-per-node", "0"], ["--nproc-per-node", "needs at least 1"]),
])
def test_command_line_numbers_are_range_checked(capsys, args, words):
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own usage error
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and all(w in err for w in words) and "Traceback" not in err, err


def test_ckpt_list_of_a_missing_path_or_a_file_says_so(tmp_path, capsys):
    refused(capsys, ["ckpt", "list", str(tmp_path / "nothing")], "no such directory")
    (tmp_path / "f").write_text("x")
    refused(capsys, ["ckpt", "list", str(tmp_path / "f")], "is a file")


def test_an_unexpected_error_never_prints_a_credential(capsys, monkeypatch):
    import xla_shard.cli as cli

    def boom(args):
        raise RuntimeError("GET https://user:hunter2@storage.example/o?token=abc123&x=1 failed")

    monkeypatch.setattr(cli, "_ckpt_list", boom)
    assert main(["ckpt", "list", "x"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError" in err  # a bug keeps its traceback ...
    assert "hunter2" not in err and "abc123" not in err  # ... without the secrets in it


@pytest.mark.e2e
def test_unreachable_storage_during_a_pretrained_load_says_so(capsys, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()
    import time

    start = time.monotonic()
    refused(capsys, ["config", "check", CONFIG, "--set", "model.name=gs://bucket/model",
                     "--set", "checkpoint.retry_deadline_s=2"], "model.name", "could not be read")
    assert time.monotonic() - start < 15  # the 2 s deadline, not gcsfs's own retries beneath it (33 s)
    gcsfs.GCSFileSystem.clear_instance_cache()


def test_http_data_urls_are_read(tmp_path, capsys, model_dirs):
    """An https:// corpus (here plain http on loopback) is read once into the cache, not as http://http://..."""
    import functools
    import http.server
    import threading

    served = tmp_path / "served"
    served.mkdir()
    (served / "corpus.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(20)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/corpus.jsonl"
        code = main(["config", "check", CONFIG, "--set", f"model.name={model_dirs.llama_tied}",
                     "--set", f"data.path={url}", "--set", f"data.tokenizer={model_dirs.llama_tied}"])
        assert code == 0, capsys.readouterr().err
    finally:
        server.shutdown()


def test_export_copies_a_tokenizer_only_from_the_model_the_checkpoint_holds(tmp_path, capsys, model_dirs):
    """The manifest names the directory the run started from; a tampered one could name any directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    own = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dirs.llama_tied)))
    step = write_checkpoint(tmp_path / "ckpt" / layout.step_dir(3), own)
    edit_manifest(step, lambda m: m.update(config={"model": {"name": str(model_dirs.llama_tied)}}))
    assert main(["ckpt", "export", str(step), "--to", str(tmp_path / "own")]) == 0
    assert "copied tokenizer.json" in capsys.readouterr().out and (tmp_path / "own" / "tokenizer.json").exists()

    other = write_checkpoint(tmp_path / "other" / layout.step_dir(3), tiny_llama())  # another vocabulary
    edit_manifest(other, lambda m: m.update(config={"model": {"name": str(model_dirs.llama_tied)}}))
    assert main(["ckpt", "export", str(other), "--to", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "is not the model this checkpoint holds (vocab_size 320, the checkpoint's 64)" in out
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
