"""`xla-shard`: train, and inspect or import configs.

User mistakes (bad config, missing file) print one line and exit 2; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

from xla_shard import config as cfglib
from xla_shard import launch
from xla_shard.config.schema import Backend as BackendName
from xla_shard.deploy.render import TARGETS
from xla_shard.errors import UserError, one_line, redact
from xla_shard.io import device
from xla_shard.io.overlap import Protected, refuse_overlap


def _count(text: str) -> int:
    """A whole number of at least 1 (argparse prints the one-line usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: needs at least 1")
    return value


def _positive(text: str) -> float:
    """A finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text}: needs a finite number above 0")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xla-shard", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_config, _add_gcp, _add_plan, _add_compile, _add_ckpt):
        add(commands)
    return parser


def _add_train(commands) -> None:
    train = commands.add_parser("train", help="train a model as the config says")
    train.add_argument("config", nargs="?", help="YAML config (ours, accelerate's or transformers')")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.steps=20 (repeatable)")
    train.add_argument("--nproc-per-node", type=_count, default=None,
                       help="torch_fsdp: processes torchrun starts on this node (default: GPUs, or cpu_devices)")
    train.set_defaults(func=_train)


def _add_config(commands) -> None:
    config = commands.add_parser("config", help="check or import a config")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    check = config_commands.add_parser("check", help="validate a config as `train` would, and say so in one line")
    check.add_argument("config", nargs="?", help="YAML config (defaults and --set alone if omitted)")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    check.add_argument("--print", action="store_true", help="print the config with every default filled in")
    check.set_defaults(func=_config_check)
    imp = config_commands.add_parser("import", help="convert an accelerate FSDP YAML or transformers fsdp_config")
    imp.add_argument("file")
    imp.add_argument("-o", "--output", help="write the converted config here instead of stdout")
    imp.set_defaults(func=_config_import)


def _add_gcp(commands) -> None:
    gcp = commands.add_parser("gcp", help="render gcloud / GKE deployment scripts from a config")
    gcp_commands = gcp.add_subparsers(dest="gcp_command", required=True)
    render = gcp_commands.add_parser("render", help="deploy.sh, teardown.sh and the config (VMs: startup.sh; "
                                                         "gke: jobset.yaml and xpk.sh)")
    render.add_argument("config")
    render.add_argument("--target", required=True, choices=TARGETS)
    render.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    render.add_argument("--out", metavar="DIR", help="write the files here (default: print deploy.sh)")
    render.add_argument("--write-mib-s", type=_positive, default=None, help="a checkpoint writer's rate, for the "
                        "emergency save's time (default: measured by this run's newest checkpoint, else assumed)")
    render.set_defaults(func=_gcp_render, torch_xla=False)


def _add_plan(commands) -> None:
    plan = commands.add_parser("plan", help="rank the sharding triples for a model and a cluster by the cost model")
    plan.add_argument("config", nargs="?", help="YAML config (its model, batch, precision and optimizer)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--devices", type=_count, help="accelerators in the job (a TPU slice's name says it)")
    plan.add_argument("--accelerator", required=True, help="one of: " + ", ".join(_accelerators()) + "; or a TPU "
                                                           "slice as deploy.accelerator_type names it (v5p-64)")
    plan.add_argument("--hosts", type=_count, default=None, help="GPU nodes (default: full nodes of the accelerator)")
    plan.add_argument("--slices", type=_count, default=1, help="TPU slices joined by DCN (default 1)")
    plan.add_argument("--hbm-gib", type=_positive, default=None, help="memory per device (default: the table's)")
    plan.add_argument("--efficiency", type=_positive, default=0.7,
                      help="fraction of peak FLOP/s the step's kernels reach when not waiting (default 0.7)")
    plan.add_argument("--backend", choices=[b.value for b in BackendName if b is not BackendName.AUTO],
                      help="rank for this backend (default: the config's; auto: torch_fsdp on GPUs, xla_spmd on TPUs)")
    plan.add_argument("--show", action="append", default=[], metavar="P/G/OS",
                      help="also print the fsdp: YAML of this row (as written in the table, e.g. 8(1)/64/64)")
    plan.add_argument("--write-mib-s", type=_positive, default=None, help="a checkpoint writer's rate, for the "
                      "emergency save's time (default: measured by this run's newest checkpoint, else assumed)")
    plan.add_argument("--top", type=_count, default=10, help="rows to print")
    plan.add_argument("--json", action="store_true", help="every candidate, as JSON")
    plan.set_defaults(func=_plan, torch_xla=False)


def _add_compile(commands) -> None:
    aot = commands.add_parser("compile", help="compile the config's training step for a TPU slice with the TPU "
                                               "compiler (no TPU needed): memory per device, collectives, roofline")
    aot.add_argument("config", nargs="?", help="YAML config (defaults and --set alone if omitted)")
    aot.add_argument("--tpu", required=True, metavar="SLICE", help="the slice, as deploy.accelerator_type names it: "
                                                                  "v5p-64, v6e-16, v5litepod-8, v4-32")
    aot.add_argument("--slices", type=_count, default=None, help="a multislice job of this many slices, joined by "
                                                                  "DCN (default: the config's deploy.num_slices)")
    aot.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    aot.add_argument("--json", action="store_true", help="the report as JSON")
    aot.add_argument("--longest", action="store_true", help="the longest sequence (doubling train.seq_len) that "
                                                            "fits the slice, and with which mesh.context: each "
                                                            "answer a compile")
    aot.add_argument("--budget-minutes", type=_positive, default=30.0, help="--longest, and the search for a change "
                                                                         "that fits: start no compile after this long")
    aot.add_argument("--no-suggest", action="store_true", help=argparse.SUPPRESS)  # a compile of a suggestion
    aot.set_defaults(func=_compile)


def _add_ckpt(commands) -> None:
    ckpt = commands.add_parser("ckpt", help="list, verify or export checkpoints")
    ckpt.set_defaults(torch_xla=False)
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    ls = ckpt_commands.add_parser("list", help="checkpoints under a checkpoint.dir, committed or not")
    ls.add_argument("url", help="checkpoint.dir: a local path, gs://bucket/prefix, ...")
    ls.set_defaults(func=_ckpt_list)
    verify = ckpt_commands.add_parser("verify", help="check every shard's size and crc32, and completeness")
    verify.add_argument("url", help="one checkpoint (.../step-00000100) or a checkpoint.dir (its newest)")
    verify.set_defaults(func=_ckpt_verify)
    export = ckpt_commands.add_parser("export", help="write a Hugging Face model directory (safetensors)")
    export.add_argument("url", help="one checkpoint (.../step-00000100) or a checkpoint.dir (its newest)")
    export.add_argument("--to", required=True, metavar="DIR",
                        help="output directory: a local path or any fsspec URL (gs://bucket/dir); written whole")
    export.add_argument("--overwrite", action="store_true", help="replace what --to holds (else it must be empty)")
    export.add_argument("--max-shard-size", default="2GB", help="split safetensors files at this size")
    export.add_argument("--merge", action="store_true",
                        help="a LoRA run: write the whole model with the adapters merged (else a peft adapter)")
    export.add_argument("--fused-experts", action="store_true",
                        help="MoE: write each layer's experts as one tensor, as the model holds them (else one "
                             "tensor per expert, as save_pretrained writes them)")
    export.set_defaults(func=_ckpt_export)


def _accelerators() -> list[str]:
    from xla_shard.planner.hardware import ACCELERATORS

    return list(ACCELERATORS)


def _plan(args) -> int:
    import json

    from xla_shard import backends

    cfg = cfglib.load(args.config, args.set)
    hardware = _plan_hardware(args)
    if not 0 < args.efficiency <= 1:
        raise UserError(f"--efficiency {args.efficiency}: a fraction of peak, in (0, 1]")
    for flag, value in (("--slices", args.slices), ("--hosts", args.hosts or 1)):
        if args.devices % value:
            raise UserError(f"{flag} {value}: needs a count that divides --devices {args.devices}")
    if hardware.domain_max and args.slices != 1:
        raise UserError(f"--slices {args.slices}: slices are TPU pods joined by DCN; {hardware.name} nodes are "
                        "given with --hosts")
    if not hardware.domain_max and args.hosts is not None:
        raise UserError(f"--hosts {args.hosts}: counts GPU nodes; a TPU slice's hosts follow from --devices "
                        "(use --slices for several slices)")
    if cfg.train.global_batch_size * cfg.train.seq_len < args.devices:
        raise UserError(f"train.global_batch_size x seq_len is fewer tokens than --devices {args.devices}")
    backend = args.backend or backends.resolve_name(cfg, on="cuda" if hardware.domain_max else "tpu")
    view = _ranking(cfg, args, hardware, backend)
    ranked = view.plan
    for wanted in args.show:
        if view.row(wanted) is None:
            raise UserError(f"--show {wanted}: no such row; write it as the table does (P/G/OS, or P(k)/G/OS)")
    train = cfg.train
    micro = train.global_batch_size // train.grad_accum_steps
    rows_over = args.devices // cfg.mesh.context  # each row's tokens split over mesh.context of them
    split = None if micro % rows_over == 0 else (
        f"train.global_batch_size={train.global_batch_size} in {train.grad_accum_steps} micro-batch(es) of {micro} "
        f"rows does not split over {rows_over} devices"
        + (f" ({args.devices} over mesh.context={cfg.mesh.context})" if cfg.mesh.context > 1 else "")
        + ": no row runs with this batch")
    accumulate = None if view.best is not None or split else _accumulation_that_fits(cfg, args, hardware, backend)
    if args.json:
        print(json.dumps({**view.as_json(batch_splits=split is None), "accumulate": accumulate}, indent=1))
        return 0
    if split:
        print(f"xla-shard: WARNING: {split}", file=sys.stderr)
    print(view.table(f"{args.devices} x {hardware.name} ({ranked.domain} per {hardware.fast_name} domain), "
                     f"{cfg.model.name}, {train.global_batch_size} x {train.seq_len} tokens per step; ranked for "
                     f"backend {backend}", args.top, args.show), end="")
    if accumulate:
        print(f"with train.grad_accum_steps={accumulate['grad_accum_steps']} (micro-batches of "
              f"{accumulate['rows']} rows, the same step), {accumulate['triple']} fits: "
              f"{accumulate['gib_per_device']:.1f} GiB per device, {accumulate['step_ms']:.0f} ms predicted")
    print(_preemption(cfg, args, hardware, backend, view))
    return 0


def _preemption(cfg, args, hardware, backend, view) -> str:
    """The emergency save of the plan's pick against the window a preempted machine of this kind gets."""
    from xla_shard import backends
    from xla_shard.checkpoint import window
    from xla_shard.deploy import tpu

    work = view.plan.work
    hosts = (args.hosts or max(1, args.devices // hardware.domain_max)) if hardware.domain_max else \
        tpu.slice_hosts(args.accelerator, args.devices)
    writers = hosts if backends.capabilities(backend).launcher == "in_process" else args.devices
    step_s = view.best.step_s if view.best is not None else 0.0
    _, said = window.say(cfg, "gpu-vm" if hardware.domain_max else "tpu-vm", work.params, work.trained_params,
                         work.frozen_bytes, writers, step_s, window.rate_for(cfg, args.write_mib_s))
    return f"preemption ({cfg.deploy.provisioning}): {said}"


def _ranking(cfg, args, hardware, backend):
    """`plan`'s ranking of `cfg` on the hardware its flags name, read for `backend`."""
    from xla_shard import backends, planner
    from xla_shard.planner import report

    work = planner.workload(cfg, args.devices, backends.capabilities(backend), hardware)
    ranked = planner.plan(work, args.devices, hardware, hosts=args.hosts, slices=args.slices,
                          hbm_bytes=args.hbm_gib * 2**30 if args.hbm_gib else None, efficiency=args.efficiency)
    return report.BackendView(ranked, backend, lambda e: backends.running(e.triple, args.devices, cfg))


def _accumulation_that_fits(cfg, args, hardware, backend) -> dict | None:
    """When nothing fits: the fewest micro-batches (train.grad_accum_steps, doubled) whose activations let the
    backend's pick fit, each micro-batch still splitting over the devices."""
    train, steps = cfg.train, cfg.train.grad_accum_steps * 2
    while train.global_batch_size % steps == 0 and (train.global_batch_size // steps) % args.devices == 0:
        trial = cfg.model_copy(update={"train": train.model_copy(update={"grad_accum_steps": steps})})
        best = _ranking(trial, args, hardware, backend).best
        if best is not None:
            return {"grad_accum_steps": steps, "rows": train.global_batch_size // steps, "triple": str(best.triple),
                    "gib_per_device": best.memory["total"] / 2**30, "step_ms": best.step_s * 1e3}
        steps *= 2
    return None


def _plan_hardware(args):
    """`--accelerator`: a generation, with `--devices`; or a TPU slice, whose chips are the devices (said, since
    a v5p-64 is 32 chips: the number counts TensorCores)."""
    from xla_shard import planner

    try:
        hardware = planner.accelerator(args.accelerator)
    except KeyError:
        hardware = None
    if hardware is not None:
        if args.devices is None:
            raise UserError(f"--accelerator {args.accelerator}: give --devices, or name a slice (v5p-64)")
        return hardware
    from xla_shard.aot import target
    from xla_shard.deploy import tpu

    if args.accelerator.split("-")[0] not in {generation.prefix for generation in tpu.GENERATIONS.values()}:
        raise UserError(f"--accelerator {args.accelerator!r}: choose one of {', '.join(_accelerators())}, or a TPU "
                        "slice (v5p-64, v6e-256, tpu7x-128, v5litepod-16)")
    chosen = target.parse(args.accelerator, "--accelerator")
    if args.devices not in (None, chosen.chips):
        raise UserError(f"--devices {args.devices}: a {chosen.name} slice is {chosen.chips} chips (leave --devices "
                        "out)")
    args.devices = chosen.chips
    print(f"xla-shard: {chosen.name} is {chosen.chips} chips ({chosen.topology})", file=sys.stderr)
    return chosen.chip


def _compile(args) -> int:
    import json

    from xla_shard.aot import run

    cfg = cfglib.load(args.config, args.set)
    slices = args.slices or cfg.deploy.num_slices
    if args.longest:
        print(f"compiling for {args.tpu}, the sequence doubling from {cfg.train.seq_len} tokens:")
        found = run.longest(cfg, args.tpu, slices, budget_s=args.budget_minutes * 60)
        if found is None:
            raise UserError(f"train.seq_len {cfg.train.seq_len} does not fit {args.tpu} with any mesh.context this "
                            "batch allows: start from a shorter one, or a bigger slice")
        seq_len, context, gib = found
        print(f"longest: train.seq_len {seq_len} with mesh.context {context} ({gib:.2f} GiB per device)")
        return 0
    report = run.compile_for(cfg, args.tpu, slices)
    print(json.dumps(report.as_dict(), indent=1) if args.json else report.text())
    generating = getattr(report, "compiled_generation", None)
    if report.fits and generating is not None and generating.fits is False:
        raise UserError(generating.refusal(report.target.label))
    if report.fits or args.no_suggest:
        return 0
    sys.stdout.flush()
    fix, untried = run.what_fits(cfg, report, run.compile_elsewhere(args.config, args.set, slices),
                                 budget_s=args.budget_minutes * 60)
    raise run.refusal(report, fix, untried)


def _gcp_render(args) -> int:
    from pathlib import Path

    from xla_shard.deploy.render import preemption_note, render
    from xla_shard.deploy.scripts import placeholders
    from xla_shard.errors import file_in_the_way

    cfg = cfglib.load(args.config, args.set)
    rendering = render(cfg, args.target)
    if not args.out:
        print(rendering.files["deploy.sh"], end="")
    else:
        refuse_overlap("--out", args.out, [Protected("the config being rendered", args.config),
                                           Protected("checkpoint.dir", cfg.checkpoint.dir, inside_too=True),
                                           Protected("output_dir", cfg.output_dir)])
        out = Path(args.out)
        blocker = file_in_the_way(out)
        if blocker:
            raise UserError(f"--out {args.out}: {blocker} is a file, not a directory")
        out.mkdir(parents=True, exist_ok=True)
        for name, text in rendering.files.items():
            (out / name).write_text(text)
            if name.endswith(".sh"):
                (out / name).chmod(0o755)
        xpk = f" or {out / 'xpk.sh'}" if "xpk.sh" in rendering.files else ""
        print(f"wrote {', '.join(rendering.files)} to {out}; run {out / 'deploy.sh'}{xpk} (DRY_RUN=1 to preview)")
    print(f"xla-shard: {preemption_note(cfg, args.target, args.write_mib_s)}", file=sys.stderr)
    found = placeholders(cfg)  # after the rendering is written: an error above stays the one line printed
    if found:
        print(f"xla-shard: WARNING: {', '.join(found)} still hold the example's placeholders: deploy.sh will "
              "refuse to start until they are yours (a DRY_RUN=1 preview works)", file=sys.stderr)
    return 0


def _ckpt_list(args) -> int:
    import datetime

    from xla_shard.checkpoint.inspect import list_checkpoints

    rows = list_checkpoints(args.url)
    if not rows:
        print(f"no checkpoints under {args.url}")
        return 0
    print(f"{'step':>10}  {'state':<10} {'bytes':>12}  {'writers':>7}  {'backend':<10} created")
    for row in rows:
        if not row.committed or row.damaged:
            state = "damaged" if row.damaged else "incomplete"
            print(f"{row.step:>10}  {state:<10} {'-':>12}  {'-':>7}  {'-':<10} -"
                  + (f"  ({redact(one_line(row.damaged))})" if row.damaged else ""))
            continue
        created = datetime.datetime.fromtimestamp(row.created).isoformat(timespec="seconds") if row.created else "-"
        print(f"{row.step:>10}  {'committed':<10} {row.bytes:>12}  {row.writers:>7}  {row.backend:<10} {created}")
    return 0


def _ckpt_verify(args) -> int:
    from xla_shard.checkpoint.inspect import verify

    manifest, problems = verify(args.url)
    for problem in problems:
        print(f"xla-shard: error: {redact(one_line(problem))}", file=sys.stderr)
    if problems:
        return 2
    files = manifest.data["files"]
    print(f"OK {redact(manifest.url)}: step {manifest.step}, {len(files)} file(s), {len(manifest.tensors)} tensors, "
          f"{sum(f['bytes'] for f in files.values())} bytes, every crc32 matches")
    return 0


def _ckpt_export(args) -> int:
    from xla_shard.checkpoint.export import export, parse_size

    report = export(args.url, args.to, parse_size(args.max_shard_size), overwrite=args.overwrite, merge=args.merge,
                    fused_experts=args.fused_experts)
    print(report.describe(args.to))
    if report.note:
        print(f"note: {report.note}")
    return 0


def _config_check(args) -> int:
    cfg = cfglib.load(args.config, args.set)  # a mistake in it is said before torch and transformers load
    from xla_shard import backends

    cfg, auto = _settle_auto(cfg)  # as `train` would
    backend = _backend(cfg)  # the backend's own checks, without starting it
    from xla_shard.train import preflight

    devices = backends.check_devices(backend)  # ... and the plan against the devices it will have, where known
    preflight(cfg, backend.capabilities, backend.method)
    if args.print:
        print(cfglib.dump(cfg), end="")
    where = f" on {devices} {backend.device_kind} device(s)" if devices else ""
    print(f"xla-shard: {args.config or 'the defaults'}" + (" with --set" if args.set else "")
          + f": valid, for backend {backend.name}{where}" + (f" (backend auto: {auto})" if auto else "")
          + ("" if args.print else " (--print shows it with every default filled in)"), file=sys.stderr)
    return 0


def _config_import(args) -> int:
    raw = cfglib.read_raw(args.file)
    native, kind, notes = cfglib.to_native(raw)
    text = cfglib.dump(cfglib.validate(native))
    if args.output:
        refuse_overlap("-o", args.output, [Protected("the file being imported", args.file)])
        try:
            with open(args.output, "w") as out:
                out.write(text)
        except OSError as exc:
            raise UserError(f"-o {args.output}: cannot write it ({exc.strerror or exc})") from None
    print(f"# imported from {kind}: {args.file}", file=sys.stderr)
    for note in notes:
        print(f"# note: {note}", file=sys.stderr)
    if not args.output:
        print(text, end="")
    return 0


def _backend(cfg):
    """The config's backend, created (its checks run), with the runtime declared before transformers loads: a
    backend that does not run on torch_xla keeps it out of the process."""
    from xla_shard import backends

    backend = backends.create(cfg)
    device.declare_runtime(backend.capabilities.torch_xla)
    return backend


def _settle_auto(cfg):
    """`backend: auto` decided once, by the launcher (its workers train the backend it names), and why: to say
    once the config has passed its checks ("" where the config names its backend)."""
    from xla_shard import backends

    if cfg.backend is not BackendName.AUTO:
        return cfg, ""
    name, why = backends.auto_choice(cfg, can_launch=True)
    return cfglib.revalidated(cfg, {"backend": name}), why


def _train(args) -> int:
    cfg, kind, notes = cfglib.load_with_notes(args.config, args.set)
    from xla_shard import backends

    if notes and not launch.torchrun_worker():  # said once, by the launcher
        print(f"xla-shard: {args.config} imported from {kind} ({len(notes)} note(s); `xla-shard config import "
              f"{args.config}` lists them)", file=sys.stderr)
    from xla_shard.checkpoint import nothing_to_train

    finished = nothing_to_train(cfg)
    if finished:  # before any backend, process or model: a rerun of a finished run
        print(f"xla-shard: {finished}", file=sys.stderr)
        return 0
    auto = ""
    if not launch.torchrun_worker():
        cfg, auto = _settle_auto(cfg)
        cfg, said = backends.launch_from_environment(cfg)
        if said:
            print(f"xla-shard: {said}", file=sys.stderr)
    backend = _backend(cfg)  # refuses what this backend cannot honour, before anything starts
    from xla_shard import train

    launch.refuse_nproc_flag(backend.capabilities.launcher, args.nproc_per_node, backend.name)
    devices = backends.check_devices(backend, args.nproc_per_node)
    backend.check_runtime()
    nodes = cfg.launch
    launcher = launch.pick(backend.capabilities.launcher, settled=cfglib.dump(cfg),
                           nproc=devices // nodes.nnodes if devices else devices, prepare=backend.configure,
                           grace_s=cfg.checkpoint.preemption_grace_s,
                           nodes=launch.Nodes(nodes.nnodes, nodes.node_rank, nodes.rdzv_endpoint, nodes.rdzv_id,
                                              nodes.timeout_s))
    train.preflight(cfg, backend.capabilities, backend.method)
    if auto:
        print(f"xla-shard: backend auto: {auto}", file=sys.stderr)
    return launcher.start(functools.partial(train.run, cfg))


def main(argv: list[str] | None = None) -> int:
    device.declare_xla_device()
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if getattr(args, "torch_xla", True) is False:  # a command that never runs on XLA (train decides by backend)
        device.declare_runtime(torch_xla=False)
    return launch.exit_status(functools.partial(args.func, args))


if __name__ == "__main__":
    sys.exit(main())
