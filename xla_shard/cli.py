"""`xla-shard`: train, and inspect or import configs.

User mistakes (bad config, missing file) print one line and exit 2; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from xla_shard import config as cfglib
from xla_shard.errors import UserError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xla-shard", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a model as the config says")
    train.add_argument("config", nargs="?", help="YAML config (ours, accelerate's or transformers')")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.steps=20 (repeatable)")
    train.add_argument("--nproc-per-node", type=int, default=None,
                       help="torch_fsdp: processes torchrun starts on this node (default: GPUs, or cpu_devices)")
    train.set_defaults(func=_train)

    config = commands.add_parser("config", help="check or import a config")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    check = config_commands.add_parser("check", help="validate a config and print it with every default filled in")
    check.add_argument("config")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    check.set_defaults(func=_config_check)
    imp = config_commands.add_parser("import", help="convert an accelerate FSDP YAML or transformers fsdp_config")
    imp.add_argument("file")
    imp.add_argument("-o", "--output", help="write the converted config here instead of stdout")
    imp.set_defaults(func=_config_import)
    return parser


def _config_check(args) -> int:
    from xla_shard import backends
    from xla_shard.train import preflight

    cfg = cfglib.load(args.config, args.set)
    backends.create(cfg)  # the backend's own checks, without starting it
    preflight(cfg)
    print(cfglib.dump(cfg), end="")
    return 0


def _config_import(args) -> int:
    raw = cfglib.read_raw(args.file)
    native, kind, notes = cfglib.to_native(raw)
    cfg = cfglib.validate(native)
    print(f"# imported from {kind}: {args.file}", file=sys.stderr)
    for note in notes:
        print(f"# note: {note}", file=sys.stderr)
    text = cfglib.dump(cfg)
    if args.output:
        with open(args.output, "w") as out:
            out.write(text)
    else:
        print(text, end="")
    return 0


def _train(args) -> int:
    from xla_shard import backends
    from xla_shard.train import Trainer, preflight

    cfg = cfglib.load(args.config, args.set)
    name = backends.resolve_name(cfg)
    backend = backends.BACKENDS[name](cfg)
    backend.check()
    if name == "torch_fsdp" and "LOCAL_RANK" not in os.environ:
        preflight(cfg)
        return _torchrun(args, cfg)
    if name == "xla_fsdp":
        preflight(cfg)
        return _xla_spawn(cfg)
    Trainer(cfg, backend).setup().run()
    return 0


def _torchrun(args, cfg) -> int:
    """Re-enter this command under torchrun; multi-node users call torchrun with `-m xla_shard.cli` directly."""
    import torch

    nproc = args.nproc_per_node or (torch.cuda.device_count() if torch.cuda.is_available() else cfg.cpu_devices)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "xla_shard.cli", *sys.argv[1:]]
    return subprocess.call(command)


def _spawned(index: int, cfg) -> None:
    from xla_shard.train import Trainer

    Trainer(cfg).setup().run()


def _xla_spawn(cfg) -> int:
    from xla_shard.backends.xla_common import configure_runtime

    configure_runtime(cfg.cpu_devices)
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(_spawned, args=(cfg,))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"xla-shard: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
