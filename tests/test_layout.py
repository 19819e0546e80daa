"""The package's architecture, checked on its import graph: every import (function-local ones included) goes
down the layers below or stays inside its own layer, and no set of modules imports itself round in a loop."""

import ast
import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

from xla_shard.backends import BACKENDS
from xla_shard.capabilities import Capabilities

PACKAGE = Path(__file__).resolve().parent.parent / "xla_shard"

# Lowest first. A module belongs to the layer of the longest prefix that names it or a package holding it (a
# prefix may hold shell wildcards: a method's keys, `methods/<name>_config.py`, are the config's).
LAYERS = [
    ("ground", ["xla_shard.errors", "xla_shard.io", "xla_shard.hostmem", "xla_shard.preemption", "xla_shard.launch"]),
    ("config", ["xla_shard.config", "xla_shard.methods.registry", "xla_shard.methods.*_config"]),
    ("plan", ["xla_shard.plan", "xla_shard.capabilities", "xla_shard.planner.cost", "xla_shard.planner.hardware",
              "xla_shard.planner.hlo", "xla_shard.schedule",
              "xla_shard.attention", "xla_shard.sequence", "xla_shard.experts", "xla_shard.metrics"]),
    ("storage formats and data", ["xla_shard.checkpoint", "xla_shard.data"]),
    ("model", ["xla_shard.models", "xla_shard.wrap", "xla_shard.lm_head", "xla_shard.logit_tail", "xla_shard.sampling",
               "xla_shard.methods", "xla_shard.quant", "xla_shard.tensor_parallel"]),
    # the exporter writes a checkpoint's adapters in the format their method's room holds
    ("loading and planning", ["xla_shard.pretrained", "xla_shard.planner", "xla_shard.checkpoint.export"]),
    ("backends", ["xla_shard.backends"]),
    ("training", ["xla_shard.train"]),
    ("front ends", ["xla_shard.cli", "xla_shard.worker", "xla_shard.deploy", "xla_shard.aot", "xla_shard.__main__",
                    "xla_shard.ray_train"]),
    ("the package", []),  # `xla_shard` itself, its public names; no module falls here by its prefix
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    if module == "xla_shard":
        return len(LAYERS) - 1
    found = [(len(p), index) for index, (_, prefixes) in enumerate(LAYERS) for p in prefixes
             if fnmatch.fnmatchcase(module, p) or module.startswith(p + ".")]
    if not found:
        raise AssertionError(f"{module} is in no layer of tests/test_layout.py: place it")
    return max(found)[1]


def _imports(module: str) -> set[str]:
    """The xla_shard modules `module` imports anywhere in its body. `from pkg import name` counts as an import
    of pkg.name where that is a module, else of pkg."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # `import xla_shard.checkpoint.layout as x` and the like
                name = name.rpartition(".")[0]
            if name.startswith("xla_shard") and name != module:
                found.add(name)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def test_every_import_goes_down_the_layers():
    upward = [f"{module} ({LAYERS[_layer(module)][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
              for module, targets in GRAPH.items() for target in targets
              if module != "xla_shard" and _layer(target) > _layer(module)]
    assert not upward, "\n".join(sorted(upward))


def test_no_modules_import_each_other_round_in_a_loop():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    loops = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                loops.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    assert not loops, "\n".join(loops)


def test_the_check_sees_function_local_imports():
    """The loops this check exists for ran through imports inside functions: they must be in the graph."""
    assert "xla_shard.planner.settle" in GRAPH["xla_shard.backends"]
    assert "xla_shard.models" in GRAPH["xla_shard.planner"]  # imported inside `workload`


def test_nothing_outside_the_methods_room_names_a_concrete_method():
    """The trainer, evaluation and the rest ask `xla_shard.methods` for the objective; only the room itself
    imports the modules that hold the methods (and the config, which composes itself from the registry). The
    adapters' export format (`peft_export`, LoRA's and DoRA's alike) is no method: the exporter imports it."""
    reaching_in = [f"{module} imports {target}" for module, targets in GRAPH.items() for target in targets
                   if target.startswith("xla_shard.methods.") and not module.startswith("xla_shard.methods")
                   and not (module.startswith("xla_shard.config.") and target == "xla_shard.methods.registry")
                   and (module, target) != ("xla_shard.checkpoint.export", "xla_shard.methods.peft_export")]
    assert not reaching_in, reaching_in
    for asking in ("xla_shard.train", "xla_shard.pretrained", "xla_shard.planner", "xla_shard.backends.base"):
        assert "xla_shard.methods" in GRAPH[asking], asking


def test_a_methods_name_and_section_appear_only_in_its_room_and_the_schema():
    """A method is chosen by the config's `method` and reached through `method_for`: outside `xla_shard/methods`
    and the schema that composes the config, no module names one (as a string, or its section as an attribute),
    and the schema's methods and sections are the room's registry."""
    import re
    import typing

    from xla_shard.config import schema
    from xla_shard.methods import METHODS

    assert set(typing.get_args(schema.Method)) == set(METHODS)
    sections = {name: entry.section for name, entry in METHODS.items() if entry.section}
    assert {name: schema.ShardConfig.model_fields[name].annotation for name in sections} == sections
    names = "|".join(METHODS)
    named = re.compile(rf"""["']({names})["']|\.({names})\b(?!\()""")
    found = [f"{module}: {match.group(0)}" for module, path in MODULES.items()
             if not module.startswith("xla_shard.methods") and module != "xla_shard.config.schema"
             for match in named.finditer(path.read_text())]
    assert not found, found
    assert named.search('cfg.dpo.beta') and named.search('method == "sft"')  # the check sees both spellings


def test_a_methods_keys_sit_below_its_code_and_the_config_reads_without_torch():
    """The schema composes the methods' sections from the registry: the registry and the sections import no torch
    (a config is checked, and the CLI answers, before torch is imported)."""
    for module in MODULES:
        if module == "xla_shard.methods.registry" or fnmatch.fnmatchcase(module, "xla_shard.methods.*_config"):
            assert LAYERS[_layer(module)][0] == "config", module
    firsts = ("xla_shard.config", "xla_shard.methods", "xla_shard.config.section", "xla_shard.methods.dpo_config")
    started = [subprocess.Popen([sys.executable, "-c", f"import sys, {first}, xla_shard.config, xla_shard.methods; "
                                                       "assert 'torch' not in sys.modules, 'torch imported'"])
               for first in firsts]  # whichever is imported first, no import loop
    assert [process.wait() for process in started] == [0] * len(firsts)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_backend_declares_one_frozen_capabilities_under_its_own_name(name):
    capabilities = BACKENDS[name].capabilities
    assert isinstance(capabilities, Capabilities) and capabilities.name == name
    with pytest.raises(AttributeError):
        capabilities.scan_layers = None  # frozen


def test_the_registry_and_the_schema_name_the_same_backends():
    """The schema's names are what the config and the CLI's --backend choices accept; the registry runs them."""
    from xla_shard.cli import _parser
    from xla_shard.config.schema import Backend as BackendName

    assert set(BACKENDS) == {b.value for b in BackendName} - {"auto"}
    plan = next(a for a in _parser()._subparsers._group_actions[0].choices["plan"]._actions if a.dest == "backend")
    assert set(plan.choices) == set(BACKENDS)


def test_no_code_outside_a_backend_compares_a_backend_name():
    names = set(BACKENDS)
    found = []
    for module, path in MODULES.items():
        if module.startswith("xla_shard.backends.") and module != "xla_shard.backends.base":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and _names_one_of([node.left, *node.comparators], names):
                found.append(f"{module}:{node.lineno}")
    assert not found, found


def _names_one_of(operands: list[ast.expr], names: set[str]) -> bool:
    """An operand that is one of `names` (a backend's, a data kind's) or an enum member spelling one
    (`Backend.TORCH_FSDP`), or a tuple, list or set holding one (`name in ("a", "b")`)."""
    for operand in operands:
        items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        if any((isinstance(item, ast.Constant) and item.value in names)
               or (isinstance(item, ast.Attribute) and item.attr.isupper() and item.attr.lower() in names)
               for item in items):
            return True
    return False


def test_a_data_kind_is_a_registry_line_and_only_its_own_module_names_it():
    """`data.kind` is composed from config/data_kinds.py, each kind's rows class loads from its module, one method
    trains each kind, and no code compares a kind's name but the module of that kind's rows: the config's checks
    and `data.build` read the registry's facts instead."""
    import typing

    from xla_shard.config.data_kinds import KINDS
    from xla_shard.config.schema import DataSection
    from xla_shard.data.kind import RowKind, row_kind
    from xla_shard.methods import METHODS

    assert set(typing.get_args(DataSection.model_fields["kind"].annotation)) == set(KINDS)
    assert sorted(kind for entry in METHODS.values() for kind in entry.rows) == sorted(KINDS)
    for name, entry in KINDS.items():
        rows = row_kind(name)
        assert isinstance(rows, RowKind) and rows.name == name and type(rows).__module__ == entry.rows.split(":")[0]
    found = []
    for module, path in MODULES.items():
        own = {name for name, entry in KINDS.items() if entry.rows.split(":")[0] == module}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and _names_one_of([node.left, *node.comparators], set(KINDS) - own):
                found.append(f"{module}:{node.lineno}")
    assert not found, found


def test_the_name_check_looks_inside_tuples_and_sees_enum_members():
    compare = ast.parse('backend not in ("auto", "torch_fsdp")').body[0].value
    assert _names_one_of([compare.left, *compare.comparators], set(BACKENDS))
    assert not _names_one_of([compare.left], set(BACKENDS))
    compare = ast.parse("self.backend is Backend.TORCH_FSDP").body[0].value
    assert _names_one_of([compare.left, *compare.comparators], set(BACKENDS))
    compare = ast.parse("self.backend is Backend.AUTO").body[0].value  # `auto` names no backend
    assert not _names_one_of([compare.left, *compare.comparators], set(BACKENDS))


def test_every_module_has_its_layer_whatever_it_imports():
    unplaced = []
    for module in MODULES:
        try:
            _layer(module)
        except AssertionError as error:
            unplaced.append(str(error))
    assert not unplaced, "\n".join(unplaced)


def test_the_backend_interface_stays_small_and_its_parts_are_objects_of_their_own():
    """The step, the wrap and the runtime are the backend's; who the processes are and the sharded state that
    checkpoints read are `backend.processes` and `backend.state`, each a class per backend where it differs."""
    from xla_shard.backends.base import Backend
    from xla_shard.backends.processes import Processes
    from xla_shard.backends.state import BackendState
    from xla_shard.checkpoint.contract import ShardedState

    methods = [name for name, value in vars(Backend).items()
               if not isinstance(value, type) and (callable(value) or isinstance(value, property))]
    assert len(methods) <= 27, methods  # (26: `to_host`, for what a method reads back; 27: `generation_context`)
    protocol = {name for name in vars(ShardedState) if not name.startswith("_")}
    assert protocol <= set(dir(BackendState)) and not protocol & set(dir(Backend))
    assert not {"is_main", "writer", "any_rank", "barrier", "main_first"} & set(dir(Backend))
    assert {"is_main", "writer", "any_rank", "barrier", "main_first", "local_leader"} <= set(dir(Processes))
