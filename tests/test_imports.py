"""The import graph of `dflash/` as docs/ARCHITECTURE.md draws it ("The rooms, in layers").

Every import statement of every module is read with `ast`, those inside functions included (they run
on first use, and a circle through them is a circle all the same), as are `importlib.import_module`
calls with a literal name. A room is a package or a top-level module of `dflash/` (the package's own
`__init__` and the compiled `_C` are the room `dflash`). The test fails on:
- a room that imports a room on its own layer or above it, unless it is in UPWARD_ALLOWED;
- a circle between modules, unless it is in MODULE_CIRCLES_ALLOWED;
- a name imported from a module that re-exports it from another room (`dflash.models`, the users'
  one-import facade, is one): inside the package, import it from the module that defines it;
- a room missing from the written layers, or a written room that does not exist.
A circle between rooms needs an arrow that is not downward, so the layer check rules those out too.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dflash"

# The one circle of modules by design: the backend choice and the compile check each ask the other on
# first use (which backend runs depends on whether the kernels compile on this device, and the compile
# check needs the backend's kernels).
MODULE_CIRCLES_ALLOWED = [{"dflash.ops.common.backend", "dflash.ops.common.compile_check"}]
# (from room, to room) arrows against the layers, each with its reason; none today.
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}


def modules(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) of every module under `package`."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


class Import:
    """One imported name: `module` (the module the statement names), `name` (None for `import module`),
    `target` (the module it runs: `module`, or `module.name` when that is a submodule), where."""

    def __init__(self, source: str, line: int, module: str, name: str | None, known):
        self.source, self.line, self.module, self.name = source, line, module, name
        self.target = f"{module}.{name}" if name and f"{module}.{name}" in known else module
        while self.target not in known and "." in self.target:  # dflash._C, a compiled module
            self.target = self.target.rpartition(".")[0]

    def __repr__(self):
        what = f"{self.name} from {self.module}" if self.name else self.module
        return f"{self.source}:{self.line} imports {what}"


def imports(known) -> list[Import]:
    """Every import of a dflash module by a dflash module, wherever it sits in the file."""
    found = []
    for name, (path, is_package) in known.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [Import(name, node.lineno, a.name, None, known) for a in node.names
                          if a.name.split(".")[0] == "dflash"]
            elif isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                if module.split(".")[0] == "dflash":
                    found += [Import(name, node.lineno, module, a.name, known) for a in node.names]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
                  and str(node.args[0].value).startswith("dflash.")):
                found.append(Import(name, node.lineno, node.args[0].value, None, known))
    return found


def top_level(nodes):
    """A module's own statements: its body and what its `if`s and `try`s hold, not what functions hold."""
    for node in nodes:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            yield from top_level([*node.body, *node.orelse, *getattr(node, "finalbody", []),
                                  *(s for h in getattr(node, "handlers", []) for s in h.body)])


def reexports(known) -> dict[str, dict[str, str]]:
    """module -> {name: the module it imports `name` from} for the names a module binds at its top
    level by importing them from another room: names it passes on rather than defines."""
    found = {}
    for name, (path, _) in known.items():
        bound = {}
        for node in top_level(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.startswith("dflash") and room(node.module) != room(name):
                bound.update({a.asname or a.name: node.module for a in node.names})
        if bound:
            found[name] = bound
    return found


def is_facade(module: str, path: Path) -> bool:
    """A module that only re-exports (imports, a docstring, `__all__`), from another room at least once."""
    body = ast.parse(path.read_text(), str(path)).body
    only_reexports = all(isinstance(n, (ast.Import, ast.ImportFrom))
                         or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
                         or (isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"])
                         for n in body)
    return only_reexports and any(isinstance(n, ast.ImportFrom) and n.module and room(n.module) != room(module)
                                  for n in body)


def layers(text: str) -> list[list[str]]:
    """The rooms by layer, bottom first, from ARCHITECTURE's block under "The rooms, in layers"."""
    block = re.search(r"^## The rooms, in layers\n.*?```text\n(.*?)```", text, re.S | re.M)
    assert block, "docs/ARCHITECTURE.md has no ```text block under '## The rooms, in layers'"
    rows = [line.split("#")[0].split() for line in block.group(1).splitlines()]
    return [[r.strip("·") for r in row if r.strip("·")] for row in reversed(rows) if row]


def graph_problems(package: Path, architecture: str) -> list[str]:
    known = modules(package)
    found = imports(known)
    level = {r: i for i, row in enumerate(layers(architecture)) for r in row}
    rooms = {room(m) for m in known}
    problems = [f"room {r} is not in ARCHITECTURE's layers" for r in sorted(rooms - level.keys())]
    problems += [f"ARCHITECTURE's layers name {r}, which is not a room of dflash/"
                 for r in sorted(level.keys() - rooms)]
    for imp in found:
        a, b = room(imp.source), room(imp.target)
        if a != b and a in level and b in level and level[b] >= level[a] and (a, b) not in UPWARD_ALLOWED:
            problems.append(f"{imp}: room {a} may import only rooms below it, and {b} is "
                            f"{'on its layer' if level[a] == level[b] else 'above it'}")
    again = reexports(known)
    for imp in found:
        if imp.name and imp.target == imp.module and (source := again.get(imp.module, {}).get(imp.name)):
            problems.append(f"{imp}: {imp.module} re-exports it from {source}; import it from there")
        elif (imp.name is None or imp.target != imp.module) and is_facade(imp.target, known[imp.target][0]):
            problems.append(f"{imp}: a facade of other rooms' names; import from the modules that define them")
    edges: dict[str, set[str]] = {}
    room_edges: dict[str, set[str]] = {}
    for imp in found:
        if imp.target != imp.source:
            edges.setdefault(imp.source, set()).add(imp.target)
        if room(imp.target) != room(imp.source):
            room_edges.setdefault(room(imp.source), set()).add(room(imp.target))
    problems += [f"a circle of rooms: {' -> '.join(c)}" for c in circles(room_edges)]
    problems += [f"a circle of modules: {' -> '.join(c)}" for c in circles(edges, allowed=MODULE_CIRCLES_ALLOWED)]
    return problems


def circles(edges: dict[str, set[str]], allowed=()) -> list[list[str]]:
    """A shortest circle through each strongly connected group of two or more modules (a group in
    `allowed` left out; a group that holds one and more is named through a module outside it)."""
    found = []
    for group in strongly_connected(edges):
        if group in allowed:
            continue
        start = min(group - set().union(*allowed) or group)  # through what made the group not allowed
        paths, seen = [[start]], {start}
        while paths:  # breadth first, for the shortest way back
            path = paths.pop(0)
            nxt = sorted(w for w in edges.get(path[-1], ()) if w in group)
            if start in nxt:
                found.append([*path, start])
                break
            paths += [[*path, w] for w in nxt if w not in seen]
            seen.update(nxt)
    return found


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of two or more nodes (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while not group or w != v:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def test_the_import_graph_follows_the_written_layers():
    problems = graph_problems(PACKAGE, (REPO / "docs" / "ARCHITECTURE.md").read_text())
    assert not problems, "\n".join(problems)


ARCH = """## The rooms, in layers\n```text\nc\nb · d\na · dflash\n```\n"""


@pytest.mark.parametrize("files, problem", [
    ({"b/__init__.py": "", "b/x.py": "from dflash.a.y import f\n", "a/y.py": "def f():\n    import dflash.c\n",
      "c.py": "", "d.py": ""},
     "dflash.a.y:2 imports dflash.c: room a may import only rooms below it, and c is above it"),
    ({"a.py": "", "b.py": "import dflash.d\n", "c.py": "", "d.py": ""},
     "dflash.b:1 imports dflash.d: room b may import only rooms below it, and d is on its layer"),
    ({"a.py": "X = 1\n", "b.py": "from dflash.a import X\n", "c.py": "from dflash.b import X\n", "d.py": ""},
     "dflash.c:1 imports X from dflash.b: dflash.b re-exports it from dflash.a; import it from there"),
    ({"a.py": "X = 1\n", "b.py": "", "d.py": '"""A facade."""\nfrom dflash.a import X\n__all__ = ["X"]\n',
      "c.py": "def f():\n    from dflash import d\n"},
     "dflash.c:2 imports d from dflash: a facade of other rooms' names; import from the modules that define them"),
    ({"a/__init__.py": "", "a/p.py": "def f():\n    from dflash.a import q\n", "a/q.py": "from . import p\n",
      "b.py": "", "c.py": "", "d.py": ""}, "a circle of modules: dflash.a.p -> dflash.a.q -> dflash.a.p"),
    ({"a.py": "import dflash.b\n", "b.py": "import dflash.a\n", "c.py": "", "d.py": ""},
     "a circle of rooms: a -> b -> a"),
    ({"a.py": "", "b.py": "", "c.py": "", "d.py": "", "e.py": ""}, "room e is not in ARCHITECTURE's layers"),
])
def test_the_check_names_each_kind_of_problem(tmp_path, files, problem):
    """Each rule on a small package of its own, whose layers are a < b, d < c."""
    for name, text in {"__init__.py": "", **files}.items():
        (tmp_path / "dflash" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dflash" / name).write_text(text)
    problems = graph_problems(tmp_path / "dflash", ARCH)
    assert problem in problems, problems


def test_launch_scripts_are_shims_over_the_package():
    """A `launch/` script is at most 60 lines: its program lives in `dflash/`, where a test imports it."""
    long = {p.stem: n for p in (REPO / "launch").glob("*.py") if (n := len(p.read_text().splitlines())) > 60}
    assert not long, long


def test_an_allowed_circle_grown_by_a_third_module_is_named():
    pair = [{"p", "q"}]
    assert circles({"p": {"q"}, "q": {"p"}}, allowed=pair) == []
    assert circles({"p": {"q"}, "q": {"p", "r"}, "r": {"p"}}, allowed=pair) == [["r", "p", "q", "r"]]


# Rooms whose tests live elsewhere: the demo's and the real benchmark's assets (tests/test_demo_assets.py,
# tests/test_bench_real.py).
ROOMS_WITHOUT_TESTS = {"demo", "bench_real"}


def test_every_room_has_its_tests_folder():
    """tests/ mirrors dflash/: each room's tests in tests/<room>/, at least one test file there."""
    rooms = {room(m) for m in modules()} - {"dflash"}
    missing = sorted(r for r in rooms - ROOMS_WITHOUT_TESTS if not any((REPO / "tests" / r).glob("test_*.py")))
    assert not missing, f"rooms of dflash/ with no tests/<room>/test_*.py: {missing}"
    strays = sorted(p.name for p in (REPO / "tests").iterdir() if p.is_dir() and (p / "__init__.py").exists()
                    and p.name not in rooms)
    assert not strays, f"test folders named for no room of dflash/: {strays}"
