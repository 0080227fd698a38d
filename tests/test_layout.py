"""The house as its listing says (issue 40): each folder's ``__init__`` docstring names, after "May use:", the
parts its modules may import; the imports form no circle, file by file or folder by folder, and stand on at most
9 floors; every wrapper named in the instrumentation table is a function that exists."""

import ast
import importlib
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "accel_ds_fix"
GROUND = {"errors", "notices", "versions", "units", "lookup", "deepspeed_config"}
FACE = {"__init__", "__main__", "pth_file", "instrumentation"}
FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())

pytestmark = pytest.mark.quick


def module_name(path):
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path):
    """The package's modules that ``path`` imports, anywhere in it (inside functions too), as dotted names."""
    here = module_name(path).split(".") if module_name(path) else []
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            target = base + (node.module.split(".") if node.module else [])
            for alias in node.names:  # a module imported by name, else the module the names come from
                candidate = ".".join(target + [alias.name])
                found.add(candidate if (PACKAGE / candidate.replace(".", "/")).with_suffix(".py").exists()
                          or (PACKAGE / candidate.replace(".", "/") / "__init__.py").exists() else ".".join(target))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found |= {n[len("accel_ds_fix."):] if n != "accel_ds_fix" else "" for n in names
                      if n == "accel_ds_fix" or n.startswith("accel_ds_fix.")}
    return found


def part_of(name):
    first = name.split(".")[0] if name else "__init__"
    if first in FOLDERS:
        return first
    return "ground" if first in GROUND else "face"


def rules():
    """{part: the parts it may use}, from the docstrings."""
    allowed = {"ground": {"ground"}, "face": {"every part"}}
    for folder in FOLDERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
        said = re.search(r"May use: ([^.]*)\.", re.sub(r"\([^)]*\)", "", doc.replace("\n", " ")))
        assert said, f"accel_ds_fix/{folder}/__init__.py says no 'May use: ...' line"
        words = {w.strip() for w in said.group(1).replace(" and ", ", ").split(",")}
        allowed[folder] = {"ground" if w == "the ground" else w for w in words if w}
    package_doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    assert "the ground: errors, notices, versions, units, lookup" in package_doc.replace("\n  ", " ")
    return allowed


def test_every_import_keeps_its_folders_may_use_rule():
    allowed = rules()
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = part_of(module_name(path))
        for target in sorted(imports(path)):
            other = part_of(target)
            if other != part and "every part" not in allowed[part] and other not in allowed[part]:
                broken.append(f"{path.relative_to(PACKAGE.parent)} ({part}) imports {target} ({other})")
    assert not broken, "\n".join(broken)


def _floors(graph):
    """The longest chain of imports below each node (1 for one that imports nothing); AssertionError on a circle."""
    floors, visiting = {}, []

    def floor(node):
        if node in floors:
            return floors[node]
        assert node not in visiting, "a circle: " + " -> ".join(visiting[visiting.index(node):] + [node])
        visiting.append(node)
        floors[node] = 1 + max((floor(n) for n in graph.get(node, ()) if n != node), default=0)
        visiting.pop()
        return floors[node]

    for node in list(graph):
        floor(node)
    return floors


def test_no_circle_and_at_most_nine_floors():
    by_file = {module_name(p): {t for t in imports(p) if t != module_name(p)} for p in PACKAGE.rglob("*.py")}
    _floors(by_file)  # no file imports itself back through others
    rooms = {}  # folders as one room, the top-level modules one each
    for name, targets in by_file.items():
        room = name.split(".")[0] if name.split(".")[0] in FOLDERS else (name or "__init__")
        rooms.setdefault(room, set()).update(
            t.split(".")[0] if t.split(".")[0] in FOLDERS else (t or "__init__") for t in targets)
    floors = _floors(rooms)  # no import runs from a lower folder up to a higher one
    assert max(floors.values()) <= 9, floors


def test_every_wrapper_in_the_instrumentation_table_is_a_function():
    pytest.importorskip("deepspeed")
    from accel_ds_fix import instrumentation

    named = [w for table in instrumentation.PATCHES.values() for ws in table.values()
             for w in (ws if isinstance(ws, tuple) else (ws,))]
    assert len(named) > 20
    for wrapper in named:
        module, _, function = wrapper.rpartition(".")
        assert callable(getattr(importlib.import_module("accel_ds_fix." + module), function, None)), wrapper
