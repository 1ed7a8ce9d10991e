"""The package's layers, read from its source: every import (at the top of a module or inside a
function) runs down the layers ops/optim < model < plan < train < cli, with hf, xcheck and
bench beside train importing down only, and no import circle exists between modules or
between sub-packages. The rest of the package (config, mesh, memory, reference, skew, the
helpers) is the base every layer may use; it imports nothing above it but where listed."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "peakflat_jax"
LAYERS = {"ops": 0, "optim": 0, "model": 1, "plan": 2, "train": 3, "hf": 3, "xcheck": 4,
          "bench": 4, "cli": 5}
"""Each sub-package's layer: a module may import its own layer's and those below. hf sits with
train (the trainer loads checkpoints through it; it makes models), xcheck and bench above it
(they build trainers), the command on top."""



def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> set[str]:
    """The peakflat_jax modules ``path`` imports, anywhere in it (functions included): a
    submodule named in ``from package import submodule`` is an arrow to it, not to the
    package's ``__init__``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:  # a submodule named, else the module itself
                found.add(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}")
                          else base)
    modules = {m for m in found if m.startswith("peakflat_jax")}
    return {m for m in modules if _is_module(m)} - {name}


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    return {module_name(path): imports(path) for path in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> tuple[str, int | None]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    return top, LAYERS.get(top)


def test_no_arrow_runs_up_the_layers():
    upward = []
    for module, targets in graph().items():
        if module == "peakflat_jax":  # the public names, re-exported from every layer
            continue
        top, level = layer_of(module)
        for target in targets:
            target_top, target_level = layer_of(target)
            if target_top == top or target_level is None:
                continue
            if level is None:
                upward.append(f"{module} -> {target} (a base module importing a layer)")
            elif target_level > level:
                upward.append(f"{module} -> {target}")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circle():
    edges = graph()
    circles = set()

    def visit(node, path, on_path):
        for target in edges.get(node, ()):
            if target in on_path:
                circles.add(frozenset(path[path.index(target):]))
            elif target not in done:
                visit(target, [*path, target], on_path | {target})
        done.add(node)

    done: set[str] = set()
    for start in sorted(edges):
        if start not in done:
            visit(start, [start], {start})
    assert not circles, [sorted(c) for c in circles]


def test_no_circle_between_sub_packages():
    """Between sub-packages too (the base modules, config, mesh and the helpers, count as one):
    an arrow from a sub-package to another never comes back."""
    arrows: dict[str, set[str]] = {}
    for module, targets in graph().items():
        top = layer_of(module)[0]
        arrows.setdefault(top, set()).update(
            t for t in (layer_of(target)[0] for target in targets) if t != top)
    both = sorted((a, b) for a in arrows for b in arrows[a]
                  if a < b and a in arrows.get(b, ()) and LAYERS.get(a) is not None
                  and LAYERS.get(b) is not None)
    assert not both, both


def test_the_planner_reads_no_environment_and_no_device():
    """plan/ is pure: no os.environ, no /proc, no device query (and, by the layers, no
    trainer and no data pipeline)."""
    for path in (PACKAGE / "plan").glob("*.py"):
        text = path.read_text()
        for forbidden in ("os.environ", "os.getenv", "/proc/", "jax.devices(",
                          "jax.local_devices(", "memory_stats(", "jax.process_index("):
            assert forbidden not in text, (path.name, forbidden)
