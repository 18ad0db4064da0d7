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
BASE = {"errors"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "hardware": set(),
    "files": BASE,
    "batching": BASE,
    "config": BASE | {"files", "batching", "config"},
    "registry": BASE | {"config"},
    "probe": BASE | {"batching", "config", "files", "hardware", "registry", "probe",
                     "memory.allocator"},  # the trace replays its allocations (pure Python)
    "memory": BASE | {"batching", "config", "files", "registry", "memory"},
    "runners": BASE | {"config", "files", "probe.result", "probe.oom", "probe.process_tag",
                       "runners", "hardware"},
    "trainers": BASE | {"batching", "config", "files", "trainers"},
    "sweep": BASE | {"batching", "config",
                     "files", "hardware", "registry", "probe.result", "probe.oom",
                     "probe.process_tag", "runners", "memory", "trainers", "sweep"},
    "estimates": BASE | {"batching", "config", "files", "hardware", "registry", "probe", "memory",
                         "sweep", "estimates"},
    "report": BASE | {"config", "files", "hardware", "memory", "probe.result", "sweep",
                      "report"},
    "cli": {"*"},
}
TORCH_FREE = ("batching", "config", "errors", "files", "hardware", "registry", "memory", "runners",
              "trainers", "sweep", "report", "cli", "probe.result", "probe.oom", "probe.launcher",
              "probe.process_tag", "probe.machine", "probe.command", "probe.trainer_logs")


def concern(module: str) -> str:
    """'autotune.sweep.tuner' -> 'sweep'; 'autotune.config' -> 'config'."""
    return module.split(".")[1]


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
    return any(name == rule or name.startswith(rule + ".") for rule in rules)


def test_every_import_follows_the_layout():
    broken = []
    for module, path in modules():
        for target in imports_of(path):
            if target.startswith("autotune.") and not allowed(module, target):
                broken.append(f"{module} imports {target}")
    assert broken == []


def test_torch_free_concerns_never_import_torch_or_ray():
    heavy = ("torch", "transformers", "ray")
    broken = []
    for module, path in modules():
        name = module.removeprefix("autotune.")
        if not any(name == c or name.startswith(c + ".") for c in TORCH_FREE):
            continue
        if name == "runners.ray_runner":
            heavy = ("torch", "transformers")  # Ray is this module's whole point
        broken += [f"{module} imports {t}" for t in imports_of(path)
                   if t.split(".")[0] in heavy]
        heavy = ("torch", "transformers", "ray")
    assert broken == []


def test_each_subpackage_says_what_it_owns_and_may_import():
    for package in ("cli", "probe", "runners", "sweep", "memory", "trainers", "report",
                    "estimates"):
        doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
        assert doc and "May import" in doc, package


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
