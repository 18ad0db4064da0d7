"""The package's shape is its architecture: each concern imports only what its __init__ says.

Every `import autotune...` in every module (function-level imports included, since they are
dependencies too) is checked against the table below, which is the one the subpackages'
docstrings state. A module that reaches upwards (the sweep importing the CLI, the probe
importing the sweep) or a runner that imports torch fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"
BASE = {"errors", "version"}
# what the sweep may import from outside itself (its top floor; each floor below names its own)
SWEEP_OUTSIDE = BASE | {"batching", "config", "files", "hardware", "registry", "process_tag",
                        "probe.measure.result", "probe.measure.oom", "runners", "memory",
                        "trainers"}
ALLOWED: dict[str, set[str]] = {
    # the ground floor
    "errors": set(),
    "version": set(),
    "hardware": set(),
    "process_tag": set(),
    "files": BASE,
    "batching": BASE,
    "config": BASE | {"files", "batching", "config"},
    "registry": BASE | {"config"},
    "memory": BASE | {"batching", "config", "files", "registry", "memory"},
    "memory.sketch": BASE | {"config", "memory.replay", "memory.workspaces", "memory.sketch"},
    "trainers": BASE | {"batching", "config", "files", "trainers"},
    # the probe, floor by floor; its top (worker, fork server, trace) may import every floor
    "probe.measure": BASE | {"config", "files", "hardware", "process_tag", "probe.measure"},
    "probe.modeling": BASE | {"config", "registry", "probe.modeling"},
    "probe.step": BASE | {"batching", "config", "files", "hardware", "registry",
                          "memory.replay",  # the allocator's settings a probe runs under
                          "probe.measure", "probe.modeling", "probe.step"},
    "probe.launch": BASE | {"config", "files", "hardware", "process_tag", "probe.measure",
                            "probe.launch"},
    "probe": BASE | {"batching", "config", "files", "hardware", "registry", "process_tag",
                     "memory.replay",  # the trace replays its allocations (pure Python)
                     "memory.workspaces",  # and records cuBLAS's workspaces (constants)
                     "probe"},
    "runners": BASE | {"config", "files", "hardware", "process_tag", "probe.measure.result",
                       "probe.measure.oom", "runners"},
    # the sweep, floor by floor; its top (plan, driver, tuner, tally, progress) every floor
    "sweep.space": BASE | {"batching", "config", "files", "trainers", "sweep.space"},
    "sweep.execution": BASE | {"config", "files", "hardware", "process_tag",
                               "probe.measure.result", "runners", "trainers", "sweep.space",
                               "sweep.execution"},
    "sweep.feasibility": BASE | {"batching", "config", "files", "hardware", "registry",
                                 "process_tag", "probe.measure.result", "memory", "sweep.space",
                                 "sweep.execution", "sweep.feasibility"},
    "sweep.study": BASE | {"config", "files", "hardware", "probe.measure.result", "sweep.space",
                           "sweep.execution", "sweep.study"},
    "sweep.pick": BASE | {"config", "files", "registry", "memory", "trainers",
                          "probe.measure.result", "runners", "sweep.space", "sweep.execution",
                          "sweep.feasibility", "sweep.study", "sweep.pick"},
    "sweep": SWEEP_OUTSIDE | {"sweep"},
    "estimates": BASE | {"batching", "config", "files", "hardware", "registry", "probe", "memory",
                         "sweep", "trainers", "estimates"},  # trainers: the split's rules
    "report": BASE | {"config", "files", "hardware", "memory", "probe.measure.result", "sweep",
                      "report"},
    "cli": {"*"},
}
TORCH_FREE = ("batching", "config", "errors", "version", "files", "hardware", "registry",
              "process_tag", "memory", "runners", "trainers", "sweep", "report", "cli",
              "probe.measure.result", "probe.measure.oom", "probe.measure.machine",
              "probe.launch")
MAX_MODULES_PER_PACKAGE = 15
MAX_MODULE_LINES = 600


def within(name: str, prefix: str) -> bool:
    """'sweep.study.storage' is within 'sweep.study' and 'sweep', not within 'sweep.stud'."""
    return name == prefix or name.startswith(prefix + ".")


def concern(module: str) -> str:
    """The floor a module is on: the longest key of ALLOWED it is within
    ('autotune.sweep.study.storage' -> 'sweep.study'; 'autotune.sweep.tuner' -> 'sweep')."""
    name = module.removeprefix("autotune.")
    return max((key for key in ALLOWED if within(name, key)), key=len)


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1 and parts[1] != "__main__":
            out.append((".".join(parts), path))
    return out


def allowed(source: str, target: str) -> bool:
    rules = ALLOWED[concern(source)]
    if "*" in rules:
        return True
    name = target.removeprefix("autotune.")
    return any(within(name, rule) for rule in rules)


def test_every_import_follows_the_layout():
    broken = []
    for module, path in modules():
        for target in imports_of(path):
            if target.startswith("autotune.") and not allowed(module, target):
                broken.append(f"{module} imports {target}")
    assert broken == []


def test_only_the_cli_imports_the_library_face():
    """`autotune/__init__.py` sits above everything (it loads the sweep, the estimates): a
    module below it that imports it (for `__version__`, say) imports upward."""
    broken = [module for module, path in modules() if concern(module) != "cli"
              and any(target == "autotune" for target in imports_of(path))]
    assert broken == []


def test_a_floor_never_imports_a_floor_above_it():
    """Within the probe and the sweep, the floors form a line: a package below may be imported
    by one above, never the other way round (the ALLOWED table says which is which)."""
    def may_import(source: str, target: str) -> bool:
        return any(within(target, rule) for rule in ALLOWED[source])

    floors = [key for key in ALLOWED if key.split(".")[0] in ("probe", "sweep")]
    assert len(floors) == 11
    both_ways = [f"{a} and {b}" for a in floors for b in floors if a < b
                 and a.split(".")[0] == b.split(".")[0]
                 and may_import(a, b) and may_import(b, a)]
    assert both_ways == []


def test_torch_free_concerns_never_import_torch_or_ray():
    heavy = ("torch", "transformers", "ray")
    broken = []
    for module, path in modules():
        name = module.removeprefix("autotune.")
        if not any(within(name, c) for c in TORCH_FREE):
            continue
        if name == "runners.ray_runner":
            heavy = ("torch", "transformers")  # Ray is this module's whole point
        broken += [f"{module} imports {t}" for t in imports_of(path)
                   if t.split(".")[0] in heavy]
        heavy = ("torch", "transformers", "ray")
    assert broken == []


def test_each_subpackage_says_what_it_owns_and_may_import():
    packages = [init.parent for init in PACKAGE.rglob("__init__.py") if init.parent != PACKAGE]
    assert len(packages) >= 18  # cli, config, ..., the probe's and the sweep's floors
    for package in packages:
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc and "May import" in doc, package


def test_every_subpackage_is_a_floor_of_the_table():
    """A new package gets a row of its own in ALLOWED, not its parent's rules by default."""
    for init in PACKAGE.rglob("__init__.py"):
        name = ".".join(init.parent.relative_to(PACKAGE).parts)
        if name and name != "config":  # config's modules share one rule set
            assert name in ALLOWED, name


def test_no_package_holds_more_than_fifteen_modules():
    crowded = {}
    for init in [PACKAGE / "__init__.py", *PACKAGE.rglob("*/__init__.py")]:
        count = len([p for p in init.parent.glob("*.py") if p.name != "__init__.py"])
        if count > MAX_MODULES_PER_PACKAGE:
            crowded[str(init.parent.relative_to(PACKAGE.parent))] = count
    assert crowded == {}


def test_no_module_name_repeats():
    """One name, one module: `tuner.py` is found without knowing which package holds it."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_no_module_past_six_hundred_lines():
    long = {module: n for module, path in modules()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_import_circle_between_modules():
    """Module-level imports between autotune's modules form no circle (a function-level import
    that closes one is a dependency too, and is counted)."""
    graph: dict[str, set[str]] = {}
    names = {module for module, _ in modules()}
    for module, path in modules():
        targets = {t for t in imports_of(path) if t in names and t != module}
        graph[module] = {t for t in targets if not module.startswith(t + ".")}  # a package's
        # own __init__ re-exports are not a circle

    def circle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    circles = [c for m in sorted(graph) if (c := circle_from(m))]
    assert circles == []


def test_modules_past_500_lines_are_said():
    """Splits follow concerns, not a line count; a module past 500 lines is shown here (as a
    warning, not a failure) so that someone looks at whether it holds two concerns."""
    import warnings

    for module, path in modules():
        lines = len(path.read_text().splitlines())
        if lines > 500:
            warnings.warn(f"{module} is {lines} lines: does it own more than one concern?",
                          stacklevel=1)


def test_benchmarks_and_scripts_import_names_that_exist():
    """A move or a rename reaches the benchmarks and scripts too: every `from autotune... import
    name` there names a module and a name that exist (benchmarks/memory_accuracy.py imported
    the pre-screen's constants from a module that no longer held them, unseen until it ran)."""
    import importlib

    missing = []
    for folder in ("benchmarks", "scripts"):
        for path in sorted((PACKAGE.parent / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.module
                        and node.module.split(".")[0] == "autotune"):
                    continue
                module = importlib.import_module(node.module)
                missing += [f"{path.name}: {node.module}.{alias.name}" for alias in node.names
                            if not hasattr(module, alias.name) and not (
                                hasattr(module, "__path__")  # a package: its submodule?
                                and importlib.util.find_spec(f"{node.module}.{alias.name}"))]
    assert missing == []
