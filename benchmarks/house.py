"""The shape of the house, measured from the code itself: import cycles (imports inside functions
included), functions that take the whole Config (`cfg`), the longest functions, the largest files.

    python benchmarks/house.py [--src src/rlvr]

tests/test_house.py asserts the rules on the same measurements (no cycle; `cfg` parameters only in
the modules that assemble a run; no function over MAX_FUNCTION_LINES; config files under 300 lines).
"""

from __future__ import annotations

import argparse
import ast
import collections
from pathlib import Path

# The modules that assemble a run from its settings: only they may take the whole Config.  The two
# trainers (GRPO's, SFT/DPO's) build their parts from it; loop.py is run.py's loop around the steps.
ASSEMBLY = ("rlvr.cli", "rlvr.run", "rlvr.loop", "rlvr.trainer", "rlvr.finetune.trainer", "rlvr.settings", "rlvr.plan",
            "rlvr.methods", "rlvr.config", "rlvr.api")


def modules(src: Path) -> dict[str, Path]:
    """rlvr.x.y -> its file, for every module of the package at `src`."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = (src.name, *path.relative_to(src).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The rlvr modules `name` imports anywhere in its file (top level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from rlvr import checkpoint` imports the submodule; `from rlvr import GRPOConfig` the package itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return groups


def functions(path: Path):
    """(name, first line, number of lines, parameter names) of every function in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1, params


def is_assembly(module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in ASSEMBLY)


def measure(src: Path) -> dict:
    known = modules(src)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    takes_cfg = [(m, f) for m, p in known.items() for f, _, _, params in functions(p) if "cfg" in params]
    lengths = sorted(((n, m, f) for m, p in known.items() for f, _, n, _ in functions(p)), reverse=True)
    sizes = sorted(((len(p.read_text().splitlines()), m) for m, p in known.items()), reverse=True)
    return {"graph": graph, "cycles": cycles(graph), "takes_cfg": takes_cfg, "longest": lengths, "largest": sizes,
            "lines": sum(n for n, _ in sizes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src" / "rlvr"))
    m = measure(Path(parser.parse_args().src))
    print(f"modules {len(m['graph'])}, lines {m['lines']}")
    print(f"import cycles: {len(m['cycles'])}")
    for group in m["cycles"]:
        print("   ", " <-> ".join(group))
    outside = [(mod, f) for mod, f in m["takes_cfg"] if not is_assembly(mod)]
    by_module = collections.Counter(mod for mod, _ in m["takes_cfg"])
    print(f"functions with a cfg parameter: {len(m['takes_cfg'])} in {len(by_module)} modules "
          f"({len(outside)} outside the modules that assemble a run)")
    for mod, n in sorted(by_module.items()):
        print(f"    {mod}: {n}{'' if is_assembly(mod) else '  <- a part'}")
    print("longest functions:", ", ".join(f"{m_}.{f} {n}" for n, m_, f in m["longest"][:5]))
    print("largest files:", ", ".join(f"{m_} {n}" for n, m_ in m["largest"][:5]))


if __name__ == "__main__":
    main()
