"""What every rendered deployment shares: the Rendering, shell quoting of each argv, the scripts' common
header and templates, and the checks every target makes before it writes anything."""

from __future__ import annotations

import shlex
import string
from dataclasses import dataclass, field
from pathlib import Path

from xla_shard.capabilities import Capabilities
from xla_shard.config.presets import PRESETS
from xla_shard.config.schema import ShardConfig
from xla_shard.errors import ConfigError, Problems, UserError

# GPUs per VM for the machine types whose GPUs come built in (the gpu-vm target's VMs, the gke target's nodes).
GPU_MACHINES = {"a3-highgpu-8g": 8, "a3-megagpu-8g": 8, "a3-ultragpu-8g": 8, "a2-highgpu-1g": 1,
                "a2-highgpu-8g": 8, "a2-ultragpu-8g": 8, "g2-standard-4": 1, "g2-standard-48": 4}
# The repository's gcp/ folder, linked into the package (and copied into the wheel by package-data).
TEMPLATES = Path(__file__).resolve().parent / "templates"


@dataclass
class Rendering:
    target: str
    commands: list[list[str]] = field(default_factory=list)  # every gcloud argv, "gcloud" first
    xpk: list[list[str]] = field(default_factory=list)  # every xpk argv (gke), "xpk" first
    files: dict[str, str] = field(default_factory=dict)  # name -> text


HERE = "@HERE@"  # in an argv: the folder of the rendered scripts, expanded by the script as "$HERE"


def _word(arg: str) -> str:
    """One argv element as a shell word: quoted literally, except each @HERE@, which becomes "$HERE"."""
    return '"$HERE"'.join(shlex.quote(part) if part else "" for part in arg.split(HERE))


def shell_line(argv: list[str], tool: str = "GCLOUD") -> str:
    """`run "$GCLOUD" ...`: the tool (gcloud, kubectl, xpk) through the script's variable for it."""
    return "run " + " ".join([f'"${tool}"'] + [_word(a) for a in argv[1:]])


def messages(name: str, follow: list[str]) -> dict[str, str]:
    """The lines deploy.sh prints at the end, as single shell words."""
    return dict(name=shlex.quote(name), started=shlex.quote(f"training started on {name}; follow the log with:"),
                follow=shlex.quote(f"  {shlex.join(follow)}"),
                dry=shlex.quote(f"DRY_RUN=1: the commands above were printed, not run; nothing was created or "
                                f"started for {name}"))


# What the example configs in scripts/configs/ hold where a user's own project and bucket go.
PLACEHOLDER_PROJECT, PLACEHOLDER_BUCKET = "my-project", "my-bucket"


def placeholders(cfg: ShardConfig) -> list[str]:
    """The config keys that still hold an example's placeholder project or bucket."""
    found = [f"deploy.project={cfg.deploy.project}"] if cfg.deploy.project == PLACEHOLDER_PROJECT else []
    for key, value in (("checkpoint.dir", cfg.checkpoint.dir), ("output_dir", cfg.output_dir),
                       ("model.name", cfg.model.name),
                       ("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path),
                       ("data.tokenizer", cfg.data.tokenizer)):
        if value and value.split("://", 1)[-1].split("/", 1)[0] == PLACEHOLDER_BUCKET and "://" in value:
            found.append(f"{key}={value}")
    return found


def common_header(cfg: ShardConfig, target: str, config_name: str) -> str:
    found = placeholders(cfg)
    message = f"{', '.join(found)} still hold the example's placeholders" if found else ""
    return template("common.sh.tmpl").substitute(target=target, config_name=config_name,
                                                  placeholders=shlex.quote(message))


def template(name: str) -> string.Template:
    path = TEMPLATES / name
    if not path.is_file():
        raise UserError(f"template {path} not found: this xla_shard install lacks its gcp templates (reinstall it)")
    return string.Template(path.read_text())


def check_common(cfg: ShardConfig, hosts: int) -> None:
    """What every target needs of a config; all of it said at once (`Problems`), not one mistake a run."""
    found = []
    ckpt = cfg.checkpoint.dir
    if ckpt and hosts > 1 and "://" not in ckpt:
        found.append(ConfigError("checkpoint.dir", f"{ckpt!r} is a local path, but this job runs on {hosts} hosts: "
                                                   "each would write its shards to its own disk. Use a gs:// URL"))
    if ckpt and ckpt.startswith("memory://"):
        found.append(ConfigError("checkpoint.dir", "memory:// does not outlive the process; use a gs:// URL"))
    if not cfg.deploy.project:
        found.append(ConfigError("deploy.project", "set the Google Cloud project to deploy into"))
    # The workers get the code and the config, not files of this machine.
    for key, value in (("model.name", cfg.model.name), ("data.path", cfg.data.path),
                       ("data.eval_path", cfg.data.eval_path), ("data.tokenizer", cfg.data.tokenizer)):
        if value and value not in PRESETS and value != "synthetic" and "://" not in value:
            found.append(ConfigError(key, f"{value!r} is a path on this machine, which the workers do not have: copy "
                                          "it to a bucket and name its gs:// URL"
                                          + (f" (or a preset: {', '.join(PRESETS)})" if key == "model.name" else "")))
    if found:
        raise found[0] if len(found) == 1 else Problems(found)


PLATFORM_NAMES = {"tpu": "a TPU", "cuda": "GPUs"}
OTHER_TARGET = {"tpu": "--target gpu-vm", "cuda": "--target tpu-vm"}


def check_backend(cfg: ShardConfig, platform: str) -> Capabilities:
    """What the backend can do on `platform` ("tpu": a slice; "cuda": GPU VMs), `auto` resolved as it would be
    there, refused if it cannot run there. (torch_tpu on a multi-host slice: each host learns the others and its
    own index from its GKE pod's environment or its TPU VM's metadata, as TorchTPU's launch contract reads them.)"""
    from xla_shard import backends

    name = backends.resolve_name(cfg, on=platform)
    capabilities = backends.capabilities(name)
    if platform not in capabilities.platforms:
        there = [n for n, cls in backends.BACKENDS.items() if platform in cls.capabilities.platforms]
        raise ConfigError("backend", f"{name} does not run on {PLATFORM_NAMES[platform]}; use {' or '.join(there)} "
                                     f"(or {OTHER_TARGET[platform]})")
    return capabilities
