import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
WORKERS = Path(__file__).resolve().parent / "workers"
sys.path.insert(0, str(REPO))  # bench/'s harnesses (measure.py, gcs_emulator.py) import as `bench.*`

# TorchTPU (in the newest-torch environment) registers itself for torch's device-backend autoload, so every
# `import torch` would load it; without a TPU its runtime then asks the GCP metadata server for the TPU's shape
# at the first backward (30 tries a key). The torch_tpu backend imports it explicitly when it starts.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# Nothing may reach the Hugging Face hub; XLA's CPU client stays quiet.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA's CPU backend compiles without LLVM's optimizations: the tests' graphs compile ~3x faster (a tiny Llama's
# step: 1.7 s against 5.2 s) and their HLO, sharding and collectives are the same; the TPU compile of
# `xla-shard compile` is left as users run it (`run_cli(..., drop=...)` in tests/test_aot.py).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
# Read by gcsfs when first imported: its experimental client probes buckets over gRPC, which the GCS emulator
# never answers (xla_shard's Storage avoids it anyway; `datasets` opens gs:// files through fsspec itself).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _env() -> dict:
    env = dict(os.environ)
    # USE_TORCH_XLA: set in this process by a command run in it (`run_in_process`); a child decides its own.
    for key in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD", "LOCAL_RANK", "RANK", "WORLD_SIZE", "USE_TORCH_XLA"):
        env.pop(key, None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # Under pytest-xdist the workers' children share the cores: torch's OpenMP threads a core's share each, as
    # the workers' own (below). test_trainer.py and test_pretrained.py side by side: 186 s against 196-206 s.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    return env


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600, drop: tuple[str, ...] = ()
            ) -> subprocess.CompletedProcess:
    """`xla-shard ARGS` in a fresh process, as a user would run it (`drop`: environment variables it must not
    see)."""
    env = {key: value for key, value in _env().items() if key not in drop}
    return subprocess.run([sys.executable, "-m", "xla_shard.cli", *args], cwd=cwd or REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """`xla-shard ARGS` in this process, for a command that neither trains nor starts a runtime (plan, config,
    ckpt): what `run_cli` returns, without a process's start-up (~6 s of imports) to pay."""
    from xla_shard.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit:  # argparse's usage errors
        code = exit.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["xla-shard", *args], code, out.out, out.err)


def run_worker(script: str, *args: str, nproc: int = 0, cwd: Path, env: dict | None = None, timeout: int = 600
               ) -> subprocess.CompletedProcess:
    """tests/workers/SCRIPT ARGS in a fresh process (under torchrun, `nproc` processes, when nproc > 0), asserted
    to succeed."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc \
        else [sys.executable]
    done = subprocess.run([*launcher, str(WORKERS / script), *args], env={**_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def runs_args(runs) -> list[str]:
    """Several runs' overrides on a worker's command line (tests/workers/runs.py): `-- RUN -- RUN ...`."""
    return [arg for run in runs for arg in ("--", *run)]


def run_probe(out: Path, *overrides: str, nproc: int = 0, timeout: int = 600, each: list[list[str]] = ()
              ) -> dict | list[dict]:
    """tests/workers/probe.py in a fresh process (under torchrun when nproc > 0); returns what it saved. `each`:
    a run per list of overrides (added to `overrides`), all in the same process (one start-up for several), and
    the list of what they saved."""
    import torch

    run_worker("probe.py", str(out), *overrides, *runs_args(each), nproc=nproc, cwd=out.parent, timeout=timeout)
    return torch.load(out)


HAS_XLA = importlib.util.find_spec("torch_xla") is not None


def needs_xla(backend: str) -> bool:
    return backend.startswith("xla")


def backend_params(names) -> list:
    """Backend names as pytest parameters, the torch_xla ones marked `xla` (skipped without torch_xla)."""
    return [pytest.param(name, marks=pytest.mark.xla) if needs_xla(name) else name for name in names]


def runnable(backends: dict) -> dict:
    """The entries of a {backend: ...} table this environment can run (a fixture that runs each)."""
    return {name: value for name, value in backends.items() if HAS_XLA or not needs_xla(name)}


# The suite's budget (docs/contributing.md, "Tests and their budget"): a unit test's call may take UNIT_LIMIT_S
# at most, or it belongs in the end-to-end tier; tests/run.sh states each tier's minutes in
# XLA_SHARD_TIER_MINUTES, and a tier over them fails.
UNIT_LIMIT_S = 5.0
_TIER_MINUTES = "XLA_SHARD_TIER_MINUTES"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (report.when == "call" and report.passed and report.duration > UNIT_LIMIT_S
            and not item.get_closest_marker("e2e")):
        report.outcome = "failed"
        report.longrepr = (f"over the unit tier's budget: {report.duration:.1f} s > {UNIT_LIMIT_S:g} s (make it "
                           "cheaper, or mark it e2e)")


def pytest_sessionstart(session):
    import time

    session.config._xla_shard_started = time.monotonic()


def pytest_sessionfinish(session, exitstatus):
    import time

    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller judges the whole tier
        return
    minutes = os.environ.get(_TIER_MINUTES)
    took = (time.monotonic() - session.config._xla_shard_started) / 60
    if minutes and took > float(minutes) and exitstatus == 0:
        terminal = session.config.pluginmanager.get_plugin("terminalreporter")
        terminal.write("\n")
        terminal.write_line(
            f"over budget: this tier took {took:.1f} min, its budget is {minutes} min ({_TIER_MINUTES}, tests/run.sh)",
            red=True)
        session.exitstatus = 1


# Seconds each end-to-end file took in the torch 2.9 tier (`--durations=0`, setup and calls summed, Dec 7 2026,
# both xdist workers busy). The parallel tier hands out whole files (`--dist loadfile --no-loadscope-reorder`) in
# collection order, so the heaviest go first and the tier does not end on one long file while the other worker
# idles. Only the order matters; a file not listed goes last, in its usual place.
E2E_SECONDS = {
    "test_checkpoint.py": 434, "test_aot_planner.py": 427, "test_pretrained.py": 270, "test_grpo.py": 269,
    "test_aot.py": 256, "test_sequence.py": 247, "test_qlora.py": 230, "test_trainer.py": 204, "test_moe.py": 170,
    "test_ray.py": 163, "test_planner.py": 159, "test_backends.py": 120, "test_hostile_checkpoints.py": 106,
    "test_api.py": 103, "test_untrusted.py": 86, "test_neutral.py": 80, "test_dpo.py": 75, "test_importers.py": 68,
    "test_lora.py": 65, "test_deploy.py": 55, "test_config.py": 53, "test_sft.py": 53, "test_hardening.py": 37,
    "test_families.py": 25, "test_models.py": 21, "test_data.py": 17, "test_gke.py": 16,
}


# Where a torch_version test's torch_fsdp variant also runs in the torch_xla environment (torch 2.9): FSDP2 at the
# low end of the torch range, on the backends' own tests and checkpoints moving between backends.
FSDP2_FLOOR = {"test_backends.py", "test_checkpoint.py"}


def pytest_collection_modifyitems(items):
    """A slow test is an end-to-end one, whether or not it says so: the unit tier stays fast. Without torch_xla
    (the base install, on the newest torch) the tests that need it skip. A torch_version test's torch_fsdp
    variant is an `fsdp2` one (outside FSDP2_FLOOR): tests/run.sh runs those on the newest torch only."""
    no_xla = pytest.mark.skip(reason="needs torch_xla (pip install 'xla_shard[xla]')")
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.e2e)
        if item.get_closest_marker("xla") and not HAS_XLA:
            item.add_marker(no_xla)
        variant = getattr(getattr(item, "callspec", None), "id", "")
        if (item.get_closest_marker("torch_version") and "torch_fsdp" in variant.split("-")
                and item.path.name not in FSDP2_FLOOR):
            item.add_marker(pytest.mark.fsdp2)


class _HeaviestFileFirst:
    @pytest.hookimpl(trylast=True)  # after `-m` selected and pytest grouped the items by fixture parameters
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda item: -E2E_SECONDS.get(item.path.name, 0))  # stable: a file keeps its order


def pytest_configure(config):
    config.pluginmanager.register(_HeaviestFileFirst(), "xla_shard_heaviest_file_first")
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:  # a pytest-xdist worker shares the machine's cores with the others
        import torch

        # torch's OpenMP threads spin while they wait: two workers each running a thread per core made the unit
        # tier's model tests up to 40x slower whenever both ran them at once (0.15 s alone, 5-10 s together).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def probe(tmp_path):
    counter = iter(range(1000))

    def _probe(*overrides: str, nproc: int = 0) -> dict:
        return run_probe(tmp_path / f"probe{next(counter)}.pt", *overrides, nproc=nproc)

    return _probe


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    """A real GCS JSON API on loopback; gs:// URLs in this process and in `run_cli` children reach it."""
    from bench.gcs_emulator import GcsEmulator

    emulator = GcsEmulator(tmp_path).start()
    for key, value in emulator.env().items():
        monkeypatch.setenv(key, value)
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()
    yield emulator
    emulator.stop()
    gcsfs.GCSFileSystem.clear_instance_cache()


def start_cli(*args: str, log: Path, own_group: bool = False) -> subprocess.Popen:
    """`xla-shard ARGS` in the background (to be signalled or killed), output to `log`; `own_group`: in a
    process group of its own, which `os.killpg` signals as a terminal's Ctrl-C does its foreground job."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "xla_shard.cli", *args], cwd=REPO, env=_env(),
                                stdout=out, stderr=subprocess.STDOUT, process_group=0 if own_group else None)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """'Pretrained' model directories, built once per session with save_pretrained (see tests/model_dirs.py)."""
    import types

    import torch
    from model_dirs import CHAT_TEMPLATE, bert_classifier_dir, llama_dir

    root = tmp_path_factory.mktemp("pretrained")
    return types.SimpleNamespace(
        llama=llama_dir(root / "llama", files=2),  # two safetensors files and an index
        llama_tied=llama_dir(root / "llama_tied", tied=True),
        llama_bf16=llama_dir(root / "llama_bf16", dtype=torch.bfloat16),
        llama_chat=llama_dir(root / "llama_chat", chat_template=CHAT_TEMPLATE),
        bert=bert_classifier_dir(root / "bert"),
        bert_base=bert_classifier_dir(root / "bert_base", base_only=True),
    )


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory):
    """A small MoE model directory of each family (tests/model_dirs.py's MOE_FAMILIES), one tensor per expert."""
    from model_dirs import MOE_FAMILIES, moe_dir

    root = tmp_path_factory.mktemp("moe")
    return {family: moe_dir(root / family, family) for family in MOE_FAMILIES}


def sgd_losses(model, source, lr: float, steps: int) -> list[float]:
    """Plain PyTorch on one process, the reference runs are compared with: each step's whole global batch of
    `source` in one forward, SGD over the parameters that train."""
    import torch

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        loss = model(**source.global_batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def in_process_checkpointer(directory, *sets: str, log=lambda message: None):
    """A `Checkpointer` of the config `sets` (synchronous) for a model held in this process, as one process of a
    run would hold it: checkpoints written and read without a backend or a runtime."""
    import types

    from xla_shard import config
    from xla_shard.backends.processes import Processes
    from xla_shard.backends.state import BackendState
    from xla_shard.checkpoint import Checkpointer

    cfg = config.load(None, [f"checkpoint.dir={directory}", "checkpoint.async=false", *sets])
    backend = types.SimpleNamespace(name="test", num_devices=1, plan=None, cfg=cfg, processes=Processes(),
                                    wrapper_prefixes=())
    return Checkpointer(cfg.checkpoint, BackendState(backend), log=log)


def run_trainings(root: Path, common: list[str], each: dict[str, list[str]], nproc: int = 0) -> dict[str, list[dict]]:
    """tests/workers/train_runs.py: each run of `each` ({name: its overrides, added to `common`}) trained in turn
    in one fresh process (under torchrun when nproc > 0), into root/NAME; returns each run's metrics records. The
    process's log is left in root/train_runs.log."""
    root.mkdir(parents=True, exist_ok=True)
    runs = [[*overrides, f"output_dir={root / name}"] for name, overrides in each.items()]
    done = run_worker("train_runs.py", *common, *runs_args(runs), nproc=nproc, cwd=root, timeout=900)
    (root / "train_runs.log").write_text(done.stderr)
    return {name: [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
            for name in each}


def run_load_probe(out: Path, *overrides: str, nproc: int = 0, env: dict | None = None) -> list[dict]:
    """tests/workers/load_probe.py (under torchrun when nproc > 0); what each writing process saved."""
    import torch

    run_worker("load_probe.py", str(out), *overrides, nproc=nproc, cwd=out.parent, env=env)
    return [torch.load(path) for path in sorted(out.parent.glob(f"{out.name}.*.pt"))]
