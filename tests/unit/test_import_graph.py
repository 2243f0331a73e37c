"""torchrig's import graph, read with `ast` from every torchrig/**/*.py (every import statement,
at any depth: inside functions too, where imports wait to keep `--list` fast; relative ones
resolved): no cycle between units (a top-level module, or a subpackage with all under it), the
layer order of torchrig/layers.py holds, and nothing outside torchrig/cli imports it."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

from torchrig.layers import LAYERS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "torchrig"


@dataclass(frozen=True)
class Import:
    source: str    # the importing module, dotted
    target: str    # the imported module (or package), dotted
    where: str     # path:line
    line: str      # the import statement as written

    def __str__(self) -> str:
        return f"{self.where}: {self.line}"


def modules(root: Path, package: str = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """dotted name -> (file, is a package's __init__). Not torchrig/shipped/: links to payload/
    and templates/, which run on the hosts and import no torchrig."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[1] == "shipped":
            continue
        init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if init else parts)] = (path, init)
    return out


def targets(node: ast.Import | ast.ImportFrom, module: str, init: bool, known) -> list[str]:
    """The modules an import statement names: `from P import x` is module P.x where that
    exists, else P (x is a name in P)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".") if init else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix
            for a in node.names]


def imports(root: Path, package: str = PACKAGE) -> list[Import]:
    """Every import of one of the package's modules, from every file of the package."""
    known = modules(root, package)
    out = []
    for module, (path, init) in known.items():
        text = path.read_text()
        lines = text.splitlines()
        rel = path.relative_to(root).as_posix()
        found = sorted((n for n in ast.walk(ast.parse(text, rel))
                        if isinstance(n, (ast.Import, ast.ImportFrom))), key=lambda n: n.lineno)
        for node in found:
            stmt = " ".join(ln.strip() for ln in lines[node.lineno - 1:node.end_lineno])
            for t in dict.fromkeys(targets(node, module, init, known)):
                if t == package or t.startswith(package + "."):
                    out.append(Import(module, t, f"{rel}:{node.lineno}", stmt))
    return out


def unit(module: str) -> str:
    """torchrig.facts.probe -> facts; torchrig.errors -> errors; torchrig -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def unit_edges(found: list[Import]) -> dict[tuple[str, str], list[Import]]:
    edges = defaultdict(list)
    for i in found:
        a, b = unit(i.source), unit(i.target)
        if a != b:
            edges[(a, b)].append(i)
    return edges


def cycles(edges) -> list[list[str]]:
    """One shortest cycle per strongly connected group of units (Tarjan, then a breadth-first
    walk back to the group's first unit), as [a, b, ..., a]."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        start = min(group)
        came = {start: None}
        queue = deque([start])
        while queue:
            v = queue.popleft()
            if start in graph[v]:
                path = [v]
                while came[path[-1]] is not None:
                    path.append(came[path[-1]])
                out.append(path[::-1] + [start])
                break
            for w in sorted(graph[v] & group):
                if w not in came:
                    came[w] = v
                    queue.append(w)
    return sorted(out)


def describe_cycle(cycle: list[str], edges) -> str:
    arrows = [f"  {a} -> {b}:\n" + "".join(f"    {i}\n" for i in edges[(a, b)])
              for a, b in zip(cycle, cycle[1:])]
    return "import cycle " + " -> ".join(cycle) + "\n" + "".join(arrows)


def layer_of(layers=LAYERS) -> dict[str, int]:
    out = {}
    for rank, (_, units) in enumerate(layers):
        for u in units:
            assert u not in out, f"torchrig/layers.py puts {u} in two layers"
            out[u] = rank
    return out


def upward(edges, layers=LAYERS) -> list[str]:
    """Each import of a unit in a higher layer, with its import lines."""
    rank, names = layer_of(layers), [name for name, _ in layers]
    return [f"{a} ({names[rank[a]]}) imports {b} ({names[rank[b]]}), a higher layer:\n"
            + "".join(f"    {i}\n" for i in found)
            for (a, b), found in sorted(edges.items())
            if a in rank and b in rank and rank[b] > rank[a]]


def units_on_disk(root: Path = ROOT) -> set[str]:
    return {unit(m) for m in modules(root)}


@functools.cache
def tree_edges():
    return unit_edges(imports(ROOT))


def test_no_cycle_between_units():
    found = cycles(tree_edges())
    assert not found, "\n".join(describe_cycle(c, tree_edges()) for c in found)


def test_every_unit_is_in_one_layer():
    declared, present = set(layer_of()), units_on_disk()
    assert not present - declared, (f"not in any layer of torchrig/layers.py: "
                                    f"{', '.join(sorted(present - declared))}")
    assert not declared - present, (f"torchrig/layers.py names what is not there: "
                                    f"{', '.join(sorted(declared - present))}")


def test_no_import_goes_up_a_layer():
    up = upward(tree_edges())
    assert not up, "".join(up)


def test_nothing_outside_cli_imports_cli():
    bad = [str(i) for i in imports(ROOT) if unit(i.target) == "cli" and unit(i.source) != "cli"]
    assert not bad, "the library imports the command line:\n" + "\n".join(bad)


# --- the checker itself, on a planted tree ------------------------------------------------------

def plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_cycle_and_upward_import_are_found_with_their_lines(tmp_path):
    """Each form the codebase uses: absolute, relative (`..`, `from . import x`), and an import
    inside a function (the way provision/slurm.py once hid provision -> launch)."""
    plant(tmp_path, {
        "__init__.py": "",
        "base.py": "",
        "launch/__init__.py": "",
        "launch/plan.py": "from ..provision import managed\nfrom .. import base\n",
        "provision/__init__.py": "",
        "provision/managed.py": "from . import slurm\n",
        "provision/slurm.py": "def kill_wait():\n    from torchrig.launch.plan import GRACE\n"
                              "    return GRACE\n",
    })
    edges = unit_edges(imports(tmp_path))
    assert set(edges) == {("launch", "provision"), ("launch", "base"), ("provision", "launch")}
    found = cycles(edges)
    assert found == [["launch", "provision", "launch"]]
    text = describe_cycle(found[0], edges)
    assert "import cycle launch -> provision -> launch" in text
    assert "torchrig/launch/plan.py:1: from ..provision import managed" in text
    assert "torchrig/provision/slurm.py:2: from torchrig.launch.plan import GRACE" in text
    up = upward(edges, (("base", ("base",)), ("domains", ("provision",)), ("jobs", ("launch",))))
    assert up == ["provision (domains) imports launch (jobs), a higher layer:\n"
                  "    torchrig/provision/slurm.py:2: from torchrig.launch.plan import GRACE\n"]


def test_relative_imports_resolve_to_modules_or_their_package(tmp_path):
    plant(tmp_path, {
        "__init__.py": "",
        "errors.py": "",
        "facts/__init__.py": "from . import probe\n",
        "facts/probe.py": "from ..errors import Oops\nfrom . import missing_name\n"
                          "import torchrig.errors\nfrom torchrig import errors, __version__\n",
    })
    got = {(i.source, i.target) for i in imports(tmp_path)}
    assert got == {("torchrig.facts", "torchrig.facts.probe"),
                   ("torchrig.facts.probe", "torchrig.errors"),
                   ("torchrig.facts.probe", "torchrig.facts"),
                   ("torchrig.facts.probe", "torchrig")}
