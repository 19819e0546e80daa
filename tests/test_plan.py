"""The sharding plan and what each backend can run: data on the backend classes, checked by the base class,
and the strategy table of docs/backends.md checked against that data."""

import re
from pathlib import Path

import pytest

from xla_shard import config, plan
from xla_shard.backends import BACKENDS
from xla_shard.config.schema import ShardingStrategy
from xla_shard.errors import ConfigError

STRATEGY_PAGE = Path(__file__).resolve().parent.parent / "docs" / "backends.md"


def _readme_table() -> dict[str, dict[str, str]]:
    """strategy -> {backend: cell} from docs/backends.md's "What each backend does with the strategy" table."""
    section = STRATEGY_PAGE.read_text().split("### What each backend does with the strategy", 1)[1]
    rows_text = section.strip().split("\n\n", 1)[0]  # the first table, up to its blank line
    lines = [line for line in rows_text.splitlines() if line.startswith("|")]
    header = [cell.strip().split()[0] for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header[1:], cells[1:]))
    return rows


def test_the_readme_strategy_table_says_what_the_backends_do():
    table = _readme_table()
    assert set(table) == {s.value for s in ShardingStrategy}
    for strategy, cells in table.items():
        assert set(cells) == set(BACKENDS)
        for backend, cell in cells.items():
            refused = ShardingStrategy(strategy) in BACKENDS[backend].capabilities.strategies
            assert cell.startswith("rejected") == refused, (strategy, backend, cell)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_unsupported_strategy_is_refused_naming_key_and_backend(name):
    for strategy in ShardingStrategy:
        cfg = config.load(None, [f"backend={name}", f"fsdp.sharding_strategy={strategy.value}", "cpu_devices=1"])
        if strategy in BACKENDS[name].capabilities.strategies:
            with pytest.raises(ConfigError) as raised:
                BACKENDS[name](cfg).check()
            assert raised.value.key == "fsdp.sharding_strategy" and raised.value.backend == name
        else:
            BACKENDS[name](cfg).check()


@pytest.mark.parametrize("strategy, sets, devices, expect", [
    ("FULL_SHARD", [], 4, (1, 4, True, 4)),
    ("SHARD_GRAD_OP", [], 4, (1, 4, False, 4)),
    ("NO_SHARD", [], 4, (4, 1, False, 1)),
    ("HYBRID_SHARD", ["mesh.replica=2"], 8, (2, 4, True, 4)),
    ("HYBRID_SHARD_ZERO2", ["mesh.replica=2", "mesh.fsdp=2"], 4, (2, 2, False, 2)),
])
def test_plans(strategy, sets, devices, expect):
    cfg = config.load(None, [f"fsdp.sharding_strategy={strategy}", *sets])
    resolved = plan.resolve(cfg.fsdp, cfg.mesh, devices)
    replicas, shard, reshard, split = expect
    assert (resolved.replicas, resolved.shard, resolved.reshard_after_forward) == (replicas, shard, reshard)
    assert resolved.replicas * resolved.shard == devices
    assert (resolved.params, resolved.grads, resolved.optimizer) == (split,) * 3
    assert resolved.replicate_only == (strategy == "NO_SHARD")
    assert resolved.describe()["strategy"] == strategy


def test_a_mesh_that_does_not_fit_the_devices_is_refused():
    cfg = config.load(None, ["mesh.fsdp=2"])  # FULL_SHARD over 4 devices, but 2 asked for
    with pytest.raises(ValueError, match=re.escape("1 x 2 = 2 does not match the 4 devices")):
        plan.resolve(cfg.fsdp, cfg.mesh, 4)
    # as a MaxText user writes it (ici_fsdp x ici_context = devices): the message says how the keys combine
    cfg = config.load(None, ["mesh.fsdp=2", "mesh.context=2"])
    with pytest.raises(ValueError, match=re.escape("lie inside mesh.fsdp's, which counts them: fsdp 4 with "
                                                   "context 2")):
        plan.resolve(cfg.fsdp, cfg.mesh, 4)
