"""The layout ARCHITECTURE.md describes, checked on the source (parsed with `ast`, nothing imported): few top-level
modules, no import cycle between packages nor between files, few imports inside functions (each saying why), HF only
in selfspec/model/, entry points only in selfspec/cli/, short functions.

A node of the package graph is a first-level package of selfspec (model, heads, decoding, training, data,
evaluation, analysis, utils, cli) or a top-level module (api, errors, train, ...); a node of the file graph is one
module (a package's __init__.py is the package). Every import counts, those inside functions too."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "selfspec"
MAX_TOP_LEVEL = 7
HF = {"transformers", "peft", "huggingface_hub", "accelerate"}
SHIMS = {"train", "eval", "analyze", "generate"}  # `python -m selfspec.X` kept working: they only call selfspec/cli/X.py
MAX_LINES = 60
MAX_LINES_DECODING = 60
# Imports of selfspec modules inside functions: each defers an expensive or optional import on purpose (a command
# line's --help, a library that imports without omegaconf or matplotlib) and says so in a comment.
MAX_FUNCTION_IMPORTS = 40


def _files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _module(path: Path) -> str:
    parts = ["selfspec", *path.relative_to(PKG).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _node(module: str) -> str | None:
    """The graph node a dotted name belongs to (None outside selfspec)."""
    parts = module.split(".")
    if parts[0] != "selfspec":
        return None
    return parts[1] if len(parts) > 1 else "selfspec"  # `selfspec` itself: the package's __init__


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported dotted name, line) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                anchor = package.split(".")[: len(package.split(".")) - (n.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from selfspec import config`: the name may be a module (a node of its own)
            out += [(f"{base}.{a.name}" if base == "selfspec" else base, n.lineno) for a in n.names]
    return out


def _graph() -> dict[str, dict[str, list[str]]]:
    """node -> imported node -> ["file:line", ...]."""
    nodes = {_node(_module(p)) for p in _files()}
    graph: dict[str, dict[str, list[str]]] = {}
    for path in _files():
        src = _node(_module(path))
        for name, line in _imports(path):
            dst = _node(name)
            if dst is not None and dst not in nodes:  # `from selfspec import SelfSpecModel`: the package's __init__
                dst = "selfspec"
            where = f"{path.relative_to(PKG.parent)}:{line}"
            if dst is not None and dst != src and where not in graph.setdefault(src, {}).setdefault(dst, []):
                graph[src][dst].append(where)
    return graph


def _cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, {})):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        state[u] = 2
        path.pop()
        return None

    for u in sorted(graph):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def test_few_top_level_modules() -> None:
    top = sorted(p.stem for p in PKG.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} top-level modules in selfspec/ (at most {MAX_TOP_LEVEL}): {top}"


def test_no_import_cycle_between_packages() -> None:
    graph = _graph()
    cycle = _cycle(graph)
    if cycle:
        where = [f"{a} -> {b} ({', '.join(graph[a][b][:3])})" for a, b in zip(cycle, cycle[1:])]
        print("import cycle:\n  " + "\n  ".join(where))
        raise AssertionError("import cycle between packages: " + "; ".join(where))


def test_hf_libraries_only_in_model() -> None:
    bad = [f"{p.relative_to(PKG.parent)}:{line} imports {name}" for p in _files() if "model" != p.relative_to(PKG).parts[0]
           for name, line in _imports(p) if name.split(".")[0] in HF]
    assert not bad, "HF libraries imported outside selfspec/model/: " + "; ".join(bad)


def test_entry_points_are_imported_by_no_library_module() -> None:
    def allowed(p: Path) -> bool:
        rel = p.relative_to(PKG)
        return rel.parts[0] == "cli" or (len(rel.parts) == 1 and p.stem in SHIMS)

    bad = [f"{p.relative_to(PKG.parent)}:{line} imports {name}" for p in _files() if not allowed(p)
           for name, line in _imports(p) if name == "selfspec.cli" or name.startswith("selfspec.cli.")]
    assert not bad, "library modules import selfspec/cli/ (entry points): " + "; ".join(bad)
    assert (PKG / "cli").is_dir(), "selfspec/cli/ (every `python -m` entry point) is missing"
    mains = [str(p.relative_to(PKG.parent)) for p in _files() if not allowed(p) and "__main__" in p.read_text(encoding="utf-8")]
    assert not mains, "`__main__` entry points outside selfspec/cli/: " + ", ".join(mains)


def _module_imports(path: Path) -> list[tuple[str, ast.stmt, bool]]:
    """(imported selfspec module, the import statement, whether it is inside a function) of every import of a selfspec
    module in the file, relative ones resolved: `from a.b import c` imports module a.b.c where that is one, else a.b."""
    modules = {_module(p) for p in _files()}
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    out: list[tuple[str, ast.stmt, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((a.name, child, in_function) for a in child.names if a.name.split(".")[0] == "selfspec")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                if base.split(".")[0] == "selfspec":
                    out.extend((f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base, child, in_function)
                               for a in child.names)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return out


def _file_graph() -> dict[str, dict[str, list[str]]]:
    """module -> imported selfspec module -> ["file:line", ...]."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in _files():
        src = _module(path)
        for dst, node, _ in _module_imports(path):
            where = f"{path.relative_to(PKG.parent)}:{node.lineno}"
            if dst != src and where not in graph.setdefault(src, {}).setdefault(dst, []):
                graph[src][dst].append(where)
    return graph


def _function_imports() -> list[tuple[Path, ast.stmt]]:
    """(file, statement) of every import statement inside a function that imports a selfspec module."""
    out = []
    for path in _files():
        seen = set()
        for _, node, in_function in _module_imports(path):
            if in_function and node.lineno not in seen:
                seen.add(node.lineno)
                out.append((path, node))
    return out


def _comment_lines(path: Path) -> tuple[set[int], set[int]]:
    """(lines holding a comment, lines holding nothing but a comment)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT}
    return comments, {n for n in comments if lines[n - 1].lstrip().startswith("#")}


def test_no_import_cycle_between_files() -> None:
    graph = _file_graph()
    cycle = _cycle(graph)
    if cycle:
        where = [f"{a} -> {b} ({', '.join(graph[a][b][:3])})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError(f"import cycle between files: {' -> '.join(cycle)}: " + "; ".join(where))


def test_few_imports_inside_functions() -> None:
    found = _function_imports()
    listed = [f"{p.relative_to(PKG.parent)}:{node.lineno}" for p, node in found]
    print(f"{len(found)} imports of selfspec modules inside functions:\n  " + "\n  ".join(listed))
    assert len(found) <= MAX_FUNCTION_IMPORTS, (
        f"{len(found)} imports of selfspec modules inside functions (at most {MAX_FUNCTION_IMPORTS}; move them to the top "
        "of their file unless they defer an expensive or optional import on purpose): " + ", ".join(listed))


def test_imports_inside_functions_say_why() -> None:
    silent = []
    for path, node in _function_imports():
        comments, comment_only = _comment_lines(path)
        lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        if not any(n in comments for n in lines) and node.lineno - 1 not in comment_only:
            silent.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert not silent, ("imports of selfspec modules inside functions without a comment (on the line or the line above) "
                        "saying why they are not at the top of the file: " + ", ".join(silent))


def _long_functions() -> list[tuple[str, int, int]]:
    """(file:line name, lines, limit) of every function over its limit, nested ones and methods included."""
    out = []
    for path in _files():
        limit = MAX_LINES_DECODING if path.relative_to(PKG).parts[0] == "decoding" else MAX_LINES
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = n.end_lineno - n.lineno + 1
                if lines > limit:
                    out.append((f"{path.relative_to(PKG.parent)}:{n.lineno} {n.name}", lines, limit))
    return out


def test_no_long_functions() -> None:
    long = _long_functions()
    assert not long, f"functions over their length limit ({MAX_LINES} lines; {MAX_LINES_DECODING} in selfspec/decoding/): " + "; ".join(
        f"{where} is {lines} lines (limit {limit})" for where, lines, limit in long)
