"""The house rules of docs/layout.md, measured from the code (benchmarks/house.py): no import cycle,
errors and settings at the bottom, the whole Config only where a run is assembled, short functions,
each setting's default written once."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import house  # noqa: E402

SRC = ROOT / "src" / "rlvr"
MAX_FUNCTION_LINES = 80
MEASURED = house.measure(SRC)


def test_no_import_cycle_not_even_through_imports_inside_functions():
    assert MEASURED["cycles"] == []


def test_errors_and_settings_sit_at_the_bottom():
    graph = MEASURED["graph"]
    assert graph["rlvr.errors"] == set()
    assert graph["rlvr.trl_settings"] == set()
    for module, imported in graph.items():
        if module == "rlvr.config" or module.startswith("rlvr.config."):
            below = {m for m in imported if not m.startswith("rlvr.config")}
            assert below <= {"rlvr.errors", "rlvr.trl_settings", "rlvr.methods"}, \
                f"{module} imports {below}: the settings must not import the parts"




def test_only_the_modules_that_assemble_a_run_take_the_whole_config():
    parts = {f"{module}.{function}" for module, function in MEASURED["takes_cfg"] if not house.is_assembly(module)}
    assert parts == set(), "a part takes its settings section (cfg.rollout_settings, ...), not the whole Config"


def test_no_function_is_longer_than_a_screen_and_a_half():
    long = [f"{module}.{function}: {n} lines" for n, module, function in MEASURED["longest"] if n > MAX_FUNCTION_LINES]
    assert long == []


def test_no_file_of_the_config_package_is_over_300_lines():
    sizes = {path.name: len(path.read_text().splitlines()) for path in (SRC / "config").glob("*.py")}
    assert max(sizes.values()) <= 300, sizes


def test_every_setting_is_defined_once_in_one_section():
    from rlvr.config import Config

    leaves = [cls for cls in Config.__mro__ if "_rules" in cls.__dict__]
    owners: dict[str, list[str]] = {}
    for cls in leaves:
        for name in cls.__dict__.get("__annotations__", {}):
            owners.setdefault(name, []).append(cls.__name__)
    assert {f.name for f in dataclasses.fields(Config)} == set(owners)
    assert {name: who for name, who in owners.items() if len(who) > 1} == {}


def test_no_settings_class_outside_the_config_writes_a_default_again():
    """A settings class outside rlvr.config with defaults of its own can drift from the Config's (as
    reference.KLSettings.horizon 10000 did from kl_horizon 100): one outside is built field by field
    from the sections.  (Request-level values such as SamplingParams' neutral defaults are not settings.)"""
    again = []
    for path in SRC.rglob("*.py"):
        if "config" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Settings"):
                again += [f"{path.name}:{node.name}.{ast.unparse(item.target)}" for item in node.body
                          if isinstance(item, ast.AnnAssign) and item.value is not None]
    assert again == []


def test_the_measurements_see_what_they_claim():
    """The rules above cannot pass by measuring nothing: a planted cycle, cfg parameter and long
    function are found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert house.cycles(graph) == [["a", "b", "c"]]
    assert len(MEASURED["graph"]) > 80 and MEASURED["graph"]["rlvr.run"]
    assert ("rlvr.cli", "main") in {(m, f) for _, m, f in MEASURED["longest"]}
    assert any(module == "rlvr.settings" for module, _ in MEASURED["takes_cfg"])
