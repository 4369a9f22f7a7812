"""The shape of the code, measured: what a newcomer meets between the wire and the cores.

    python simulations/architecture_measures.py [--json]

- string-key lookups in p2pswarm/agent/: `["key"]` subscripts and `.get("key")` calls,
  where a typed value would have a field;
- `dict[str, Any]` annotations in p2pswarm/agent/;
- the class that sets the most distinct `self.<name>` attributes, and the longest file;
- the share of the package's lines that `mypy` (strict, its `files` in pyproject.toml)
  checks;
- `ignore_imports` left in the import-linter contracts;
- the largest import cycle among the package's modules, imports under `TYPE_CHECKING`
  counted (a type import is still a dependency a reader has to follow).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

import grimp
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "p2pswarm"
KEY_LOOKUP = re.compile(r"""\[["'][A-Za-z_0-9]+["']\]|\.get\(["']""")
DICT_ANY = re.compile(r"dict\[str, Any\]")


def python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def count_in(folder: Path, pattern: re.Pattern[str]) -> int:
    return sum(len(pattern.findall(p.read_text())) for p in python_files(folder))


def largest_class() -> tuple[int, str]:
    """(attributes, 'path:Class') of the class that assigns the most `self.X`."""
    best = (0, "")
    for path in python_files(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names: set[str] = set()
            for sub in ast.walk(node):
                targets: list[ast.expr] = []
                if isinstance(sub, ast.Assign):
                    targets = list(sub.targets)
                elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                    targets = [sub.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                                and leaf.value.id == "self"):
                            names.add(leaf.attr)
            where = f"{path.relative_to(ROOT)}:{node.name}"
            best = max(best, (len(names), where))
    return best


def largest_file() -> tuple[int, str]:
    return max((line_count(p), str(p.relative_to(ROOT))) for p in python_files(PACKAGE))


def pyproject() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def strict_share(config: dict[str, object]) -> float:
    mypy = config["tool"]["mypy"]  # type: ignore[index]
    checked: set[Path] = set()
    for entry in mypy["files"]:
        path = ROOT / entry
        checked.update(python_files(path) if path.is_dir() else [path])
    total = sum(line_count(p) for p in python_files(PACKAGE))
    return sum(line_count(p) for p in checked if p.exists()) / total


def ignored_imports(config: dict[str, object]) -> int:
    contracts = config["tool"]["importlinter"]["contracts"]  # type: ignore[index]
    return sum(len(c.get("ignore_imports", [])) for c in contracts)


def largest_cycle() -> tuple[int, list[str]]:
    """Tarjan's strongly connected components over the module graph."""
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph("p2pswarm", exclude_type_checking_imports=False)
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    best: list[str] = []
    counter = 0

    def visit(root: str) -> None:  # iterative, so deep graphs do not hit the recursion limit
        nonlocal counter, best
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            targets = edges.get(node, [])
            if i < len(targets):
                work.append((node, i + 1))
                nxt = targets[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > len(best):
                    best = sorted(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])

    for m in modules:
        if m not in index:
            visit(m)
    return len(best) if len(best) > 1 else 0, best


def measure() -> dict[str, object]:
    config = pyproject()
    attrs, where_class = largest_class()
    lines, where_file = largest_file()
    cycle, members = largest_cycle()
    return {
        "string_key_lookups_agent": count_in(PACKAGE / "agent", KEY_LOOKUP),
        "dict_str_any_agent": count_in(PACKAGE / "agent", DICT_ANY),
        "largest_class_attributes": attrs, "largest_class": where_class,
        "largest_file_lines": lines, "largest_file": where_file,
        "mypy_strict_share": round(strict_share(config), 3),
        "ignored_imports": ignored_imports(config),
        "largest_import_cycle": cycle, "largest_import_cycle_modules": members,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    args = parser.parse_args()
    m = measure()
    if args.json:
        print(json.dumps(m, indent=2))
        return
    rows = [
        ("string-key lookups in p2pswarm/agent/", m["string_key_lookups_agent"]),
        ("dict[str, Any] in p2pswarm/agent/", m["dict_str_any_agent"]),
        ("attributes of the largest class",
         f"{m['largest_class_attributes']} ({m['largest_class']})"),
        ("largest file", f"{m['largest_file_lines']} lines ({m['largest_file']})"),
        ("package lines under mypy strict", f"{100 * float(m['mypy_strict_share']):.0f} %"),
        ("ignored imports in the layer contracts", m["ignored_imports"]),
        ("files in the largest import cycle (TYPE_CHECKING counted)",
         m["largest_import_cycle"]),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
