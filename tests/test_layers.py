"""The package's layers (README "What is where"): two products in one package, the toolkit (the patch
stack and what builds and verifies it) and the sparse-attention lab (``lab/``), which imports the toolkit and
is never imported by it (but for ``cli/main.py``, which registers its command group). Each folder imports only
from the layers below it, there is no import circle, click lives only in ``cli/`` folders, and no source names
a machine's absolute path.

    1 base (errors, config, report, progress, safe_extract, verdict)     toolkit
    2 stack/    3 markers/ (reads the patch model of stack/)               toolkit
    4 builds/   5 verify/                                                  toolkit
    6 lab/                                                                 lab
    7 cli/ (the toolkit's commands and the options every command shares)   toolkit
    8 lab/cli/ (the lab's commands)                                        lab
    9 cli/main.py (the entry point: the toolkit's commands, the lab's group)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "opencoti_patch"
LAYERS = ("", "stack", "markers", "builds", "verify", "lab", "cli", "lab.cli", "cli.main")
RANKS = {name: rank for rank, name in enumerate(LAYERS, 1)}
LAB = "lab"
REGISTRAR = "cli.main"  # the one toolkit module that imports the lab: it adds the lab's command group


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package: Path, loading: bool = False) -> set[str]:
    """Modules of the package that ``path`` imports (relative imports resolved); ``loading``: only those its
    loading runs (not the ones a function imports when it is called)."""
    name = module_name(path, package)
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in (_loading_nodes(tree) if loading else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == package.name}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != package.name:
                continue
            for alias in node.names:  # `from .stack import apply` imports the module stack.apply
                sub = f"{mod}.{alias.name}"
                out.add(sub if _exists(sub, package) else mod)
    return out


def _exists(module: str, package: Path) -> bool:
    rel = Path(*module.split(".")[1:])
    root = package / rel
    return root.with_suffix(".py").is_file() or (root / "__init__.py").is_file()


def layer_of(module: str) -> str:
    """The longest layer name that ``module`` (``opencoti_patch.x.y``) lies in ("" for the base modules)."""
    rel = module.split(".", 1)[1] if "." in module else ""
    if rel == "cli":  # the package's face re-exports the entry point (``opencoti_patch.cli:main``)
        return "cli.main"
    return max((name for name in LAYERS if name and (rel == name or rel.startswith(name + "."))),
               key=len, default="")


def in_lab(module: str) -> bool:
    return layer_of(module).split(".")[0] == LAB


def _loading_nodes(tree: ast.AST) -> list[ast.AST]:
    """The nodes that run when the module is loaded: everything outside function bodies."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo += ast.iter_child_nodes(node)
    return out


def problems(package: Path) -> list[str]:
    files = sorted(package.rglob("*.py"))
    graph = {module_name(p, package): imports_of(p, package) for p in files}
    loading = {module_name(p, package): imports_of(p, package, loading=True) for p in files}
    found = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if RANKS[layer_of(dep)] > RANKS[layer_of(mod)]:
                found.append(f"{mod} imports {dep} from a higher layer")
            if in_lab(dep) and not in_lab(mod) and mod != f"{package.name}.{REGISTRAR}":
                found.append(f"{mod} imports {dep}: the toolkit never imports the lab")
    found += [f"import circle: {' -> '.join(c)}" for c in _circles(with_packages(loading, package.name))]
    return found


def with_packages(graph: dict[str, set[str]], root: str) -> dict[str, set[str]]:
    """``graph`` with the imports Python makes on the way: importing ``a.b.c`` runs ``a/b/__init__.py``
    first (a package's own ancestors and the root package aside), so a package's face that imports more
    than its module can close a circle."""
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        own = {mod.rsplit(".", i)[0] for i in range(mod.count(".") + 1)}
        parents = {d.rsplit(".", i)[0] for d in deps for i in range(1, d.count("."))}
        out[mod] = deps | {p for p in parents if p in graph and p not in own and p != root}
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    circles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep == node or dep == node.rsplit(".", 1)[0]:
                continue  # a module's own package __init__ (empty docstrings) is not a circle
            if state.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return circles


def test_every_import_goes_down_and_there_is_no_circle() -> None:
    assert problems(PACKAGE) == []


def test_the_checker_catches_an_upward_import_a_circle_and_the_toolkit_using_the_lab(tmp_path: Path) -> None:
    pkg = tmp_path / "opencoti_patch"
    for sub in ("", "stack", "verify", "cli", "lab", "lab/cli"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("from .cli import main\n")
    (pkg / "cli" / "main.py").write_text("from ..stack.tree import Tree\nfrom ..lab.cli import lab_group\n")
    (pkg / "cli" / "pin.py").write_text("from ..lab import bench\n")
    (pkg / "stack" / "tree.py").write_text("from .apply import x\n")
    (pkg / "stack" / "apply.py").write_text("from . import tree\n")
    (pkg / "lab" / "bench.py").write_text("from ..verify import identical\nfrom .cli import selector\n")
    (pkg / "lab" / "cli" / "selector.py").write_text("from .. import bench\n")
    (pkg / "verify" / "identical.py").write_text("from ..lab import bench\n")
    found = problems(pkg)
    assert "opencoti_patch.errors imports opencoti_patch.cli.main from a higher layer" in found
    assert any(f.startswith("import circle:") and "opencoti_patch.stack.tree" in f for f in found)
    assert "opencoti_patch.lab.bench imports opencoti_patch.lab.cli.selector from a higher layer" in found
    never = "the toolkit never imports the lab"
    assert f"opencoti_patch.cli.pin imports opencoti_patch.lab.bench: {never}" in found
    assert f"opencoti_patch.verify.identical imports opencoti_patch.lab.bench: {never}" in found
    assert not any(f.startswith("opencoti_patch.cli.main ") for f in found), found  # the one registrar


def test_every_folder_has_a_layer() -> None:
    """A folder of the package is a layer, or lies in one (``lab/serving/`` in ``lab/``)."""
    folders = {".".join(p.parent.relative_to(PACKAGE).parts) for p in PACKAGE.rglob("*.py")
               if p.parent != PACKAGE}
    assert {f for f in folders if not any(f == n or f.startswith(n + ".") for n in LAYERS if n)} == set()


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_click_only_in_cli_and_no_machine_paths(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    uses_click = any(
        (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "click" for a in n.names))
        or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "click")
        for n in ast.walk(tree))
    if path.parent.name != "cli":
        assert not uses_click, f"{path.name} imports click outside a cli/ folder"
    assert_no_machine_path(path, text)


MACHINE_PATHS = ("/work/", "/home/", "/root/", "/Users/")


def assert_no_machine_path(path: Path, text: str) -> None:
    for machine in MACHINE_PATHS:
        assert machine not in text, f"{path.name} names a machine path ({machine}...)"


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.parent.joinpath("tests").glob("*.py")
                                        if p.name != "test_layers.py"), ids=lambda p: p.name)
def test_no_machine_paths_in_tests(path: Path) -> None:
    assert_no_machine_path(path, path.read_text(encoding="utf-8"))


DOCS = [PACKAGE.parent / "README.md", *sorted(p for p in (PACKAGE.parent / "docs").rglob("*")
                                              if p.suffix in (".md", ".json", ".txt"))]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_machine_paths_in_docs_and_results(path: Path) -> None:
    assert_no_machine_path(path, path.read_text(encoding="utf-8"))


def test_reports_are_written_with_portable_paths(tmp_path: Path) -> None:
    from opencoti_patch.config import portable, write_report

    root = tmp_path / "proj"
    text = (f"tree {root}/work/llama.cpp; root {root}; model {Path.home()}/.cache/m.gguf; "
            f"sibling {root}x/file")
    assert portable(text, root) == f"tree work/llama.cpp; root .; model ~/.cache/m.gguf; sibling {root}x/file"
    out = tmp_path / "r.md"
    write_report(out, f"{root}/a", root)
    assert out.read_text() == "a"


def _splices_or_searches_lines(tree: ast.AST) -> list[int]:
    """Lines of a slice assignment (``cur[a:b] = ...``) or a slice comparison (``x[a:b] == y``): what
    applying or locating a hunk in a file's lines takes."""
    def sliced(node: ast.AST) -> bool:
        return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(sliced(t) for t in node.targets):
            found.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(sliced(x) for x in (node.left, *node.comparators)):
            found.append(node.lineno)
    return found


def test_one_patch_model_and_one_applier() -> None:
    """Every module that reads hunks (of the patch model, stack/series.py) leaves locating and applying
    them to the stack's in-memory applier (stack/hunks.py), and only series.py parses diffs."""
    applier = PACKAGE / "stack" / "hunks.py"
    model = PACKAGE / "stack" / "series.py"
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path != model:
            assert "@@ -(" not in text and "^@@" not in text, f"{path.name} parses hunk headers itself"
        mod = module_name(path, PACKAGE)
        reads_hunks = any(w in text for w in (".hunks", "text_lines", "Hunk"))
        if path in (applier, model) or not reads_hunks:
            continue
        assert not _splices_or_searches_lines(ast.parse(text)), \
            f"{mod} locates or applies hunks itself (lines {_splices_or_searches_lines(ast.parse(text))})"
