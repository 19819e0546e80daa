"""libtpu, driven through jax's compile-only client: no TPU needed to compile for one.

The client compiles StableHLO for a topology's devices; torch_xla's HloModuleProto is converted with jaxlib's
own `hlo_to_stablehlo`. Partitioning is torch_xla's SPMD, with torch_xla's own options: each parameter keeps
the sharding its tensor has, the outputs' shardings are propagated, over `num_partitions` = the slice's
devices. A placeholder's sharding (annotated on its first op: it has no data to lay out) is moved onto its
parameter first, where torch_xla puts a real tensor's. libtpu prints warnings about TPU metadata
it cannot find on a machine that has no TPU; they are silenced (TPU_* variables it would read are set to
neutral values only for the duration of the call, where unset).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from xla_shard.aot import memory
from xla_shard.errors import UserError

INSTALL = "pip install 'xla_shard[aot]'"  # jax and libtpu: see pyproject.toml
# A Python with a newer jax and libtpu, in an environment of its own (they exclude torch_xla 2.9's jax pin), for
# the generations this environment's libtpu cannot describe (TPU7x): see docs/planner.md.
ISOLATED = "XLA_SHARD_TPU_COMPILER"
ISOLATED_INSTALL = ("python -m venv ~/.xla_shard-tpu-compiler && ~/.xla_shard-tpu-compiler/bin/pip install "
                    "jax==0.10.2 jaxlib==0.10.2 libtpu==0.0.42, then XLA_SHARD_TPU_COMPILER="
                    "~/.xla_shard-tpu-compiler/bin/python")


@dataclass
class Compiled:
    devices: int
    argument_bytes: int  # per device
    output_bytes: int
    alias_bytes: int
    temp_bytes: int  # libtpu's own figure (its heap and about its largest buffer again: `aot.memory`)
    code_bytes: int
    flops: float  # per device, the compiler's cost analysis
    bytes_accessed: float
    hlo_text: str = field(repr=False)
    heap_bytes: int | None = None  # the buffer assignment's block of temporaries: what the runtime allocates
    slots: list = field(default_factory=list, repr=False)  # its largest slots: [bytes, dtype, shape], largest first

    @property
    def temporaries(self) -> int:
        return self.heap_bytes if self.heap_bytes is not None else self.temp_bytes


@dataclass
class Slice:
    """A slice as libtpu describes it, and where its compiler runs: in this process (`devices`, jax's), or in
    the isolated environment's (`python`), given the program on disk."""

    topology: str
    count: int  # devices of the compiled program, every slice's
    platform_version: str  # libtpu's: its build date decides the Mosaic version kernels are lowered at
    devices: list | None = None
    python: str | None = None
    slices: int = 1  # a multislice job's slices (over DCN), each of `topology`, its devices listed slice by slice

    def compile(self, proto: bytes, timeout_s: float | None = None) -> Compiled:
        """`timeout_s`: compiled in a process of its own (this environment's Python where no isolated one serves
        the slice), stopped after that long (`CompileTimedOut`): a bound on a compile that may not end."""
        python = self.python or (sys.executable if timeout_s else None)
        if python is None:
            return compile_program(proto, self.devices)
        with tempfile.TemporaryDirectory(prefix="xla_shard_compile_") as work:
            program, result = Path(work) / "step.pb", Path(work) / "compiled.json"
            program.write_bytes(proto)
            _isolated(python, timeout_s or _COMPILE_S, "compile", self.topology, str(self.slices), str(program),
                      str(result))
            written = result.read_text() if result.is_file() else ""
        answer = _answer(python, written, ())
        if isinstance(answer.get("refused"), str):  # the compiler's own words, read here as in this process
            raise rejection(answer["refused"])
        _answer(python, written, [f.name for f in dataclasses.fields(Compiled) if f.default is
                                       dataclasses.MISSING and f.default_factory is dataclasses.MISSING])
        try:
            return Compiled(**answer)
        except TypeError as exc:
            raise _unanswered(python, f"its figures do not fit: {exc}") from None


def describe(topology: str, slices: int = 1) -> Slice:
    """`slices` slices of `topology`, described by this environment's libtpu, or where it cannot (a newer
    generation) by the isolated one's, if XLA_SHARD_TPU_COMPILER names it."""
    try:
        devices = topology_devices(topology, slices)
        return Slice(topology, len(devices), devices[0].client.platform_version, devices=devices, slices=slices)
    except UserError as refused:
        python = os.environ.get(ISOLATED)
        if not python:
            raise UserError(f"{refused}; for a generation this libtpu does not know, install a newer one apart: "
                            f"{ISOLATED_INSTALL}") from None
    answer = _answer(python, _isolated(python, _DESCRIBE_S, "describe", topology, str(slices)),
                     ("count", "platform_version"))
    if not isinstance(answer["count"], int) or not isinstance(answer["platform_version"], str):
        raise _unanswered(python, f"its description {answer} is not a device count and a version")
    return Slice(topology, answer["count"], answer["platform_version"], python=python, slices=slices)


# How long the isolated environment may take: to describe a slice, and to compile one program (libtpu compiles
# Llama-3-70B's scanned step in minutes; an unrolled 8B in about 10).
_DESCRIBE_S, _COMPILE_S = 300, 3600


def _unanswered(python: str, problem: str) -> UserError:
    return UserError(f"{ISOLATED}={python}: the TPU compiler there {problem} ({ISOLATED_INSTALL})")


def _answer(python: str, text: str, keys) -> dict:
    """The isolated environment's JSON answer, holding `keys`."""
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or any(key not in answer for key in keys):
        shown = " ".join(text.split())[:120] or "nothing"
        raise _unanswered(python, f"answered {shown!r}, not its JSON with {', '.join(keys)}")
    return answer


def _isolated(python: str, timeout_s: float, *args: str) -> str:
    """Run this module's command line (`main`) with the isolated environment's Python, for at most `timeout_s`;
    its stdout."""
    where = Path(python)
    if not where.is_file() or not os.access(where, os.X_OK):
        problem = "no such file" if not where.exists() else "not a file" if not where.is_file() else "not executable"
        raise UserError(f"{ISOLATED}={python}: {problem}; it names the isolated environment's Python "
                        f"({ISOLATED_INSTALL})")
    package = str(Path(__file__).resolve().parents[2])  # what holds xla_shard: importable without installing it
    env = {**os.environ, "PYTHONPATH": package + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for key in ("TPU_LIBRARY_PATH", "PTXLA_TPU_LIBRARY_PATH"):  # torch_xla points them at its own libtpu
        env.pop(key, None)
    try:
        done = subprocess.run([python, "-m", "xla_shard.aot.compiler", *args], capture_output=True, text=True,
                              env=env, timeout=timeout_s, errors="replace")
    except subprocess.TimeoutExpired:
        raise CompileTimedOut(_unanswered(python, f"did not answer within {timeout_s:g} s ({args[0]}); stopped"),
                              timeout_s) from None
    except OSError as exc:
        raise _unanswered(python, f"could not be started: {exc.strerror or exc}") from None
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise UserError(f"the TPU compiler at {ISOLATED}={python} failed: "
                        f"{' '.join(lines[-1].split())[:300] if lines else done.returncode}")
    return done.stdout


def main(command: str, topology: str, slices: str, *paths: str) -> None:
    """The isolated environment's side: `describe TOPOLOGY SLICES` prints the slices as JSON; `compile TOPOLOGY
    SLICES PROTO OUT` writes the compiled program's figures (or the compiler's refusal, in its words) to OUT as
    JSON."""
    devices = topology_devices(topology, int(slices))
    if command == "describe":
        print(json.dumps({"count": len(devices), "platform_version": devices[0].client.platform_version}))
        return
    program, out = paths
    try:
        answer = dataclasses.asdict(compile_program(Path(program).read_bytes(), devices))
    except CompileRejected as rejected:
        answer = {"refused": rejected.compiler_said}
    Path(out).write_text(json.dumps(answer))


def topology_devices(topology: str, slices: int = 1) -> list:
    """The devices of `slices` slices of `topology`, as jax describes them (no TPU needed), slice by slice. A
    slice smaller than one host's 2x2 chips is described with its own shape as the host's bounds."""
    try:
        from jax.experimental import topologies
    except ImportError:
        raise UserError(f"compiling for a TPU needs jax and libtpu: {INSTALL}") from None
    with _quiet_libtpu():
        try:
            shape = [int(side) for side in topology.split(":")[1].split("x")]
            bounds = {"chips_per_host_bounds": (shape + [1, 1])[:3]} if shape[0] * shape[1] < 4 else {}
            if slices > 1:
                bounds["num_slices"] = slices
            return list(topologies.get_topology_desc(topology_name=topology, platform="tpu", **bounds).devices)
        except Exception as exc:  # noqa: BLE001 - libtpu's own refusal (an unknown generation or shape)
            raise UserError(f"libtpu cannot describe {topology}: {' '.join(str(exc).split())[:200]} (TPU7x needs a "
                            "newer libtpu than torch_xla 2.9's jax pins)") from None


@contextlib.contextmanager
def kernels_lowered_for(tpu: Slice):
    """Pallas kernels traced inside (flash attention: `attn_implementation: xla_pallas`, `auto` on a TPU; the
    MoE experts' grouped matmuls) are lowered for the TPU of `tpu`, as on a TPU VM with its libtpu. torch_xla
    lowers them for jax's default backend, which here is the CPU, where Pallas only interprets; and jax picks
    the Mosaic serialization version by the build date of the TPU runtime it finds, where a newer one than that
    libtpu reads is refused."""
    try:
        import jax
        import torch
        from jax._src import tpu_custom_call
        from torch_xla.core import xla_builder as xb
        from torch_xla.experimental import custom_kernel

        from xla_shard import experts  # here: the isolated compiler's environment has no torch
    except ImportError:  # no Pallas without jax
        yield
        return
    built = _build_date(tpu.platform_version)

    def older_than(year: int, month: int, day: int) -> bool:  # jax's rule, asked of this libtpu
        return built is not None and built < datetime.date(year, month, day)

    def for_tpu(kernel, *args, static_argnums=None, static_argnames=None, use_cache=False, **kwargs):
        from jax.experimental import pallas  # noqa: F401  (registers the Mosaic lowering: imported first)

        shapes = [custom_kernel.to_jax_shape_dtype_struct(a) if torch.is_tensor(a) else a for a in args]
        jitted = jax.jit(kernel, static_argnums=static_argnums, static_argnames=static_argnames)
        ir = jitted.trace(*shapes, **kwargs).lower(lowering_platforms=("tpu",)).compiler_ir()
        return custom_kernel._extract_backend_config(ir), [a for a in args if torch.is_tensor(a)]

    def specialize_for_tpu(self, sample_flat_args):  # xb.call_jax (the MoE experts' gmm), lowered for a TPU
        from torchax.ops.mappings import t2j_dtype

        shapes = tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, t2j_dtype(a.dtype))
                       for a in sample_flat_args)
        lowered = jax.jit(self._flat_input_func.flat_call, keep_unused=True).trace(shapes).lower(
            lowering_platforms=("tpu",))
        proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
        return xb.xla_computation_as_func(xb.computation_from_module_proto("jax_callable", proto), "jax_func")

    saved = custom_kernel.trace_pallas, tpu_custom_call.is_cloud_tpu_older_than, xb.JaxCallable.specialize
    custom_kernel.trace_pallas, tpu_custom_call.is_cloud_tpu_older_than = for_tpu, older_than
    xb.JaxCallable.specialize = specialize_for_tpu
    try:
        with experts.lowered_for_tpu():
            yield
    finally:
        custom_kernel.trace_pallas, tpu_custom_call.is_cloud_tpu_older_than, xb.JaxCallable.specialize = saved


def _build_date(platform_version: str) -> datetime.date | None:
    """libtpu's build date, from its platform version (`Built on Aug 1 2025 14:50:34 (1754085034) ...`)."""
    stamp = re.search(r"\((\d{9,})\)", platform_version)
    return datetime.date.fromtimestamp(int(stamp.group(1))) if stamp else None


def compile_program(proto: bytes, devices: list) -> Compiled:
    """Compile torch_xla's HloModuleProto for `devices` (a slice, or several), SPMD-partitioned over all of
    them: the program's device i is `devices[i]`."""
    import jax
    import jaxlib._jax as jaxlib_client
    import numpy as np
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir
    from jaxlib._jax import mlir

    options = xla_client.CompileOptions()
    build = options.executable_build_options
    build.num_replicas, build.num_partitions = 1, len(devices)
    build.use_spmd_partitioning = True
    build.allow_spmd_sharding_propagation_to_parameters = [False]
    build.allow_spmd_sharding_propagation_to_output = [True]
    build.device_assignment = xla_client.DeviceAssignment.create(np.array([[d.id for d in devices]]))
    with _quiet_libtpu(), jax_mlir.make_ir_context(), tempfile.TemporaryDirectory(prefix="xla_shard_dump_") as dump:
        module = _pin_parameters(_without_empty_tilings(ir.Module.parse(mlir.hlo_to_stablehlo(proto))))
        # jax < 0.8's compile-only client takes the module's bytecode; later ones the module itself.
        program = module if jax.__version_info__ >= (0, 8) else module.operation.get_asm(binary=True)
        memory.dump_options(options, dump)
        try:
            executable = devices[0].client.compile(program, jaxlib_client.DeviceList(tuple(devices)), options)
        except Exception as exc:  # noqa: BLE001 - what the TPU compiler rejected, said in one line
            raise rejection(" ".join(str(exc).split())) from None
        assignment = memory.read(dump)
        optimized = _optimized_text(dump, executable)
    stats = executable.get_compiled_memory_stats()
    cost = executable.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return Compiled(len(devices), stats.argument_size_in_bytes, stats.output_size_in_bytes,
                    stats.alias_size_in_bytes, stats.temp_size_in_bytes, stats.generated_code_size_in_bytes,
                    float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)), optimized,
                    assignment.heap if assignment else None,
                    [[s.bytes, s.dtype, list(s.shape)] for s in assignment.slots[:memory.KEPT]] if assignment else [])


def _optimized_text(dump: str, executable) -> str:
    """The optimized program as the compiler wrote it into its dump; else as jaxlib reads it back (a libtpu
    newer than jaxlib writes ops jaxlib's parser refuses: 0.0.52's async-update under jax 0.10.2). The largest
    module is the step (each Pallas kernel is a module of its own)."""
    files = list(Path(dump).glob("*after_optimizations.txt"))
    if not files:
        return executable.hlo_modules()[0].to_string()
    return max(files, key=lambda f: f.stat().st_size).read_text()


def _without_empty_tilings(module):
    """The module with every op's empty `result_tilings` attribute dropped: newer jax writes it on the custom
    calls of the Pallas kernels torch_xla 2.9 lowers, and libtpu 0.0.52 refuses it; an empty list says nothing."""
    def walk(operation):
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    attributes = op.operation.attributes
                    if "result_tilings" in attributes and str(attributes["result_tilings"]) == "[]":
                        del attributes["result_tilings"]
                    walk(op.operation)

    walk(module.operation)
    return module


def _pin_parameters(module):
    """The StableHLO `module` with each unsharded parameter given the sharding its first op annotates (the
    `Sharding` custom call a placeholder's layout is traced as)."""
    from jax._src.lib.mlir import ir

    main = next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
    arguments = main.regions[0].blocks[0].arguments
    attrs = (list(ir.ArrayAttr(main.attributes["arg_attrs"])) if "arg_attrs" in main.attributes
             else [ir.DictAttr.get({})] * len(arguments))
    for index, argument in enumerate(arguments):
        if _SHARDING in ir.DictAttr(attrs[index]):
            continue
        for use in argument.uses:
            op = use.owner
            if ("call_target_name" in op.attributes and _SHARDING in op.attributes
                    and ir.StringAttr(op.attributes["call_target_name"]).value == "Sharding"):
                attrs[index] = ir.DictAttr.get({**{a.name: a.attr for a in ir.DictAttr(attrs[index])},
                                                _SHARDING: op.attributes[_SHARDING]})
                break
    main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
    return module


_SHARDING = "mhlo.sharding"


def rejection(text: str) -> CompileRejected:
    """The compiler's refusal as an error: out of HBM (its verdict parsed), or anything else in one line."""
    used, one, temps = _OUT_OF_HBM.search(text), _ONE_ALLOCATION.search(text), _TEMPORARIES_EXCEED.search(text)
    if used:
        error = OutOfHbm(_bytes(used.group(1)), _bytes(used.group(2)), _temporaries(text))
    elif temps:  # refused before any assignment: the temporaries alone (a lower bound of what it needs)
        error = OutOfHbm(_bytes(temps.group(1)), _bytes(temps.group(2)), _bytes(temps.group(1)))
    elif one:
        error = OutOfHbm(int(one.group(1)), int(one.group(2)), None, allocation=one.group(3))
    else:
        error = CompileRejected(text[:400])
    error.compiler_said = text  # for a process that reads it again: the isolated compiler's caller
    return error


class CompileTimedOut(UserError):
    """The TPU compiler did not finish within its time bound (`Slice.compile`'s timeout_s)."""

    def __init__(self, said: UserError, timeout_s: float):
        super().__init__(str(said))
        self.timeout_s = timeout_s


class CompileRejected(UserError):
    """The TPU compiler refused the program."""

    compiler_said = ""  # its whole message (`rejection`), which the one-line error may shorten


class OutOfHbm(CompileRejected):
    """The TPU compiler's own verdict that the program does not fit: `used` bytes of the `capacity` a device
    leaves a program (its HBM less the runtime's reserve)."""

    def __init__(self, used: int, capacity: int, temporaries: int | None, allocation: str | None = None):
        self.used, self.capacity, self.temporaries, self.allocation = used, capacity, temporaries, allocation
        what = f"one allocation ({allocation}) needs" if allocation else "used"
        super().__init__(f"the TPU compiler ran out of HBM: {what} {used / 2**30:.2f} GiB of {capacity / 2**30:.2f}")


_OUT_OF_HBM = re.compile(r"Ran out of memory in memory space hbm\. Used ([0-9.]+[KMGT]?) of ([0-9.]+[KMGT]?) hbm")
# A single buffer larger than a device's HBM is refused before any assignment: its shape says which.
_ONE_ALLOCATION = re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\).*?shape = '([^'{]+)")
_TEMPORARIES_EXCEED = re.compile(r"total memory required for HLO temporaries \(([0-9.]+[KMGT]?)\) exceeds "
                                 r"available HBM \(([0-9.]+[KMGT]?)\)")
_TEMP = re.compile(r"HLO temp ([0-9.]+[KMGT]?)")


def _bytes(text: str) -> int:
    """XLA's human-readable sizes (binary units: 24.66G is GiB)."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(text[-1], 1)
    return int(float(text.rstrip("KMGT")) * scale)


def _temporaries(text: str) -> int | None:
    match = _TEMP.search(text)
    return _bytes(match.group(1)) if match else None


@contextlib.contextmanager
def _quiet_libtpu():
    """libtpu asks the environment (and the GCE metadata server) for the TPU it runs on: on a machine without
    one, neutral answers keep it from warning and from waiting on the network."""
    # ALLOW_MULTIPLE_LIBTPU_LOAD: a compile-only client holds no TPU, so it needs no lock against another
    # process's libtpu (without it, a second compile on the machine aborts on /tmp/libtpu_lockfile).
    neutral = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
               "TPU_STDERR_LOG_LEVEL": "3", "TPU_MIN_LOG_LEVEL": "3", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    added = {k: v for k, v in neutral.items() if k not in os.environ}
    os.environ.update(added)
    sys.stderr.flush()
    saved = os.dup(2)  # libtpu writes its warnings to the C-level stderr, past Python's
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        for key in added:
            os.environ.pop(key, None)


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except UserError as error:
        sys.exit(str(error))
