"""The shape of the tree, read from the source: `gateway -> pools -> engine -> kernels`, `bench`
beside them and imported only by the CLI module, no import cycle between project modules, the
third-party imports each layer must not make (aiohttp below the gateway, YAML in the engine), one
home for each formula that used to be written twice, light package imports, logging instead of
print, and functions that fit on a screen.

Every `import` statement counts, including those inside functions and under TYPE_CHECKING: a lazy
import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"kernels": 0, "engine": 1, "pools": 2, "gateway": 3}   # a package may import only lower ranks
PACKAGES = (*LAYERS, "bench")
BENCH_IMPORTERS = {"gateway.cli"}       # the `cliffguard bench ...` commands
FORBIDDEN = {"kernels": {"aiohttp", "yaml"}, "engine": {"aiohttp", "yaml"}, "pools": {"aiohttp"}}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Project modules and top-level third-party names that `module` imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known)
    return found


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project module -> project modules it imports, project module -> third-party top-level names)."""
    modules = _all_modules()
    known = set(modules)
    project: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = _imports(name, path, known)
        project[name] = {m for m in found if m in known and m != name}
        external[name] = {m.split(".")[0] for m in found if m.split(".")[0] not in PACKAGES}
    return project, external


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        pkg = module.split(".")[0]
        for target in sorted(targets):
            target_pkg = target.split(".")[0]
            if target_pkg == pkg:
                continue
            if target_pkg == "bench":
                if module not in BENCH_IMPORTERS:
                    bad.append(f"{module} imports {target}: only {', '.join(sorted(BENCH_IMPORTERS))} may use bench")
            elif pkg == "bench":
                if target_pkg == "gateway":
                    bad.append(f"{module} imports {target}: bench stands beside the gateway, it may use "
                               "pools, engine and kernels")
            elif LAYERS[target_pkg] > LAYERS[pkg]:
                bad.append(f"{module} imports {target}: {pkg} is below {target_pkg} (gateway -> pools -> engine "
                           "-> kernels)")
    return bad


def _forbidden_imports(external: dict[str, set[str]]) -> list[str]:
    return [f"{module} imports {name}" for module, names in sorted(external.items())
            for name in sorted(names & FORBIDDEN.get(module.split(".")[0], set()))]


def test_no_import_cycle_between_project_modules():
    graph, _ = _graph()
    assert _cycles(graph) == []


def test_imports_follow_the_layer_order():
    graph, external = _graph()
    assert _layer_violations(graph) == []
    assert _forbidden_imports(external) == []


def test_the_checks_catch_a_cycle_and_an_upward_import():
    graph = {"engine.a": {"engine.b"}, "engine.b": {"engine.a"}, "kernels.k": {"engine.a"},
             "pools.p": {"bench.serve"}, "bench.x": {"gateway.app"}, "gateway.cli": {"bench.x"}}
    assert _cycles(graph) == [["engine.a", "engine.b"]]
    bad = _layer_violations(graph)
    assert len(bad) == 3 and any("kernels.k imports engine.a" in b for b in bad)
    assert any("pools.p imports bench.serve" in b for b in bad) and any("bench.x imports gateway.app" in b for b in bad)
    assert _forbidden_imports({"engine.x": {"yaml", "torch"}, "gateway.y": {"aiohttp"}}) == ["engine.x imports yaml"]


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from engine.config import X\n    from . import sibling\n")
    found = _imports("pools.m", path, {"engine.config", "pools.sibling"})
    assert {"engine.config", "pools", "pools.sibling"} <= found


def _hits(pattern, home: str) -> list[str]:
    """Lines of project modules other than `home` (a path under the root) that match `pattern`."""
    return [f"{path.relative_to(ROOT)}:{i}" for path in _all_modules().values()
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if pattern.search(line) and path.relative_to(ROOT).as_posix() != home]


def test_one_capacity_formula():
    """`0.9 x memory - weights`, blocks and max_num_seqs are computed in engine/capacity.py only; the
    planner and the engine's KV cache (its check against the GPU as loaded) import it."""
    import re

    pattern = re.compile(r"memory_utilization \*|0\.9 \*|\* 0\.9|// \(\w*kv\w* \* \w*(block_size|avg_len)\)")
    assert _hits(pattern, "engine/capacity.py") == []
    graph, _ = _graph()
    assert "engine.capacity" in graph["pools.capacity_plan"] and "engine.capacity" in graph["engine.kv_cache"]


# The linear step-cost form: its fit (least squares), its attended-pairs regressor, its product.
LINEAR_FORM = r"lstsq\(|num_attended\s*/\s*1024|\.vector\(\)\s*@"
# The bookkeeping after a step: computed tokens advance, full blocks enter the prefix cache.
STEP_COMMIT = r"\.num_computed_tokens\s*\+=|\.register_computed\("


def test_one_step_cost_model_and_one_step_commit():
    """The composer, the simulator and the benchmarks share engine/step_cost.py; the engine, its
    warm-up and the simulator share `engine.step_commit.commit_step` (the scheduler registers a preempted or
    finished sequence's known blocks itself)."""
    import re

    assert _hits(re.compile(LINEAR_FORM), "engine/step_cost.py") == []
    hits = _hits(re.compile(STEP_COMMIT), "engine/step_commit.py")
    assert len(hits) == 1 and hits[0].startswith("engine/scheduler.py:"), hits   # `Scheduler._cache_computed`
    for line in ("t = a + d * f.num_attended / 1024", "coef = nonnegative_lstsq(x, t)", "f.vector() @ coef"):
        assert re.search(LINEAR_FORM, line)
    for line in ("seq.num_computed_tokens += n", "bm.register_computed(table, ids, n)"):
        assert re.search(STEP_COMMIT, line)


def test_the_credit_ledger_and_the_capacity_formula_import_without_torch():
    """`import pools.credits.ledger` (the gateway's ledger) and `engine.capacity` (the formula) load neither
    torch nor the engine: the packages' `__init__` import nothing."""
    import subprocess
    import sys

    code = ("import sys, pools.credits.ledger, engine.capacity; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('engine.llm')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _print_lines(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]


CLI = ("gateway/cli.py", "gateway/simulate_cli.py")   # the command line: what it prints is its output


def test_the_library_logs_and_only_the_cli_prints(tmp_path):
    """gateway/ (but its CLI), pools/, engine/ and kernels/ speak through `logging`: what a server
    says goes where its operator sends logs, with a time and a level."""
    found = [f"{path.relative_to(ROOT)}:{line}" for pkg in ("gateway", "pools", "engine", "kernels")
             for path in sorted((ROOT / pkg).rglob("*.py")) if path.relative_to(ROOT).as_posix() not in CLI
             for line in _print_lines(path)]
    assert found == []
    probe = tmp_path / "probe.py"   # the check itself can fail
    probe.write_text("def f():\n    print('x', file=None)\n")
    assert _print_lines(probe) == [2]


MAX_FUNCTION_LINES = 60     # gateway/ and engine/: a function reads on one screen
MAX_APP_LINES = 300         # gateway/app.py: the app factory, middleware and lifecycle only


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [f"{path.parent.name}/{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


MAX_MODULE_LINES = 500


def test_functions_fit_on_a_screen_and_modules_hold_one_concept(tmp_path):
    """No function over `MAX_FUNCTION_LINES` and no module over `MAX_MODULE_LINES` in gateway/, pools/,
    engine/ and bench/ (kernels are exempt)."""
    paths = [path for pkg in ("gateway", "pools", "engine", "bench") for path in sorted((ROOT / pkg).rglob("*.py"))]
    assert [f for path in paths for f in _long_functions(path)] == []
    assert [path.relative_to(ROOT).as_posix() for path in paths
            if len(path.read_text(encoding="utf-8").splitlines()) > MAX_MODULE_LINES] == []
    assert len((ROOT / "gateway" / "app.py").read_text(encoding="utf-8").splitlines()) < MAX_APP_LINES
    probe = tmp_path / "probe.py"   # the check itself can fail
    probe.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert len(_long_functions(probe)) == 1


def test_every_module_is_on_the_map():
    """Each module of gateway/, pools/, engine/, kernels/ and bench/ is named (in backquotes) in the
    README's layout table or docs/ARCHITECTURE.md, so a newcomer can find what it is for."""
    import re

    text = (ROOT / "README.md").read_text(encoding="utf-8") + (ROOT / "docs" / "ARCHITECTURE.md").read_text(
        encoding="utf-8")
    named = set(re.findall(r"`([\w/]+)`", text))
    missing = [module for module in _all_modules() if module.split(".")[-1] not in named
               and module.split(".")[-1] + "/" not in named and module not in PACKAGES]
    assert missing == []


def test_module_names_are_unique():
    """A module's name says its layer and concept: no two modules of the packages share one. A benchmark's
    command module is named for its command (`bench.admission` is `cliffguard bench admission`), which may
    be the name of what it measures."""
    from gateway.cli import BENCHMARKS

    seen: dict[str, str] = {}
    clashes = []
    for module, path in _all_modules().items():
        if path.name == "__init__.py" or module.removeprefix("bench.") in BENCHMARKS:
            continue
        name = module.split(".")[-1]
        if name in seen:
            clashes.append(f"{seen[name]} and {module}")
        seen[name] = module
    assert clashes == []


def test_the_repo_speaks_of_the_project_only():
    """Docs, docstrings and comments cite dates, commits and the repo's own files, never a numbered work
    period or ticket, nor documents a reader of the repo does not have."""
    import re

    pattern = re.compile(r"\b(session|issue|ticket|sprint) #?\d+\b|DESIGN\.md|STYLE\.md|\bseeds/|\blesson\b", re.I)
    texts = [ROOT / "README.md", ROOT / "config" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *_all_modules().values(), *sorted((ROOT / "tests").rglob("*.py"))]
    hits = [f"{path.relative_to(ROOT)}:{i}" for path in texts
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)
            and path != Path(__file__).resolve()]
    assert hits == []
    assert pattern.search("as session 9 found") and pattern.search("see STYLE.md")


def test_one_metrics_reader_and_one_percentile_function():
    """The benchmarks read `/metrics` text through `bench.load.scrape.pool_samples` and summarize
    latencies with `pools.workload.latency_stats`; nobody writes a second one."""
    import re

    assert _hits(re.compile(r"text_string_to_metric_families"), "bench/load/scrape.py") == []
    assert _hits(re.compile(r"def _?percentiles?\("), "pools/workload.py") == []


def test_no_module_imports_a_private_name_of_another_package():
    """A name that starts with `_` is its module's own: another top-level package (gateway, pools, engine,
    kernels, bench) never imports it; what a package shares, it names without the underscore."""
    found = []
    for module, path in _all_modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            source = node.module.split(".")[0]
            if source in PACKAGES and source != module.split(".")[0]:
                found += [f"{module}:{node.lineno} imports {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert found == []


def test_every_subpackage_opens_with_a_one_line_summary():
    """Each package and subpackage's `__init__.py` starts with a docstring whose first line says what it
    holds (the map a newcomer reads folder by folder)."""
    missing = []
    for module, path in _all_modules().items():
        if path.name != "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        if not doc or not doc.splitlines()[0].strip():
            missing.append(module)
    assert missing == []


def test_every_file_make_test_runs_alone_exists():
    """tests/conftest.py's SERIAL names the test files `make test` runs alone after the parallel part, PARALLEL the
    files of its folders that run on the workers all the same: a name there that no longer exists (a file renamed or
    moved) would send its tests to the other part unnoticed."""
    from tests.conftest import PARALLEL, SERIAL

    missing = [name for name in SERIAL + PARALLEL if not (ROOT / name).exists()]
    assert not missing, f"tests/conftest.py's SERIAL or PARALLEL names what does not exist: {missing}"
    assert all(name.endswith(("/", ".py")) for name in SERIAL)
    assert all(name.startswith(SERIAL) for name in PARALLEL), "PARALLEL takes files out of SERIAL's folders alone"
