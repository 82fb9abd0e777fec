"""The repository's own rules: ruff (line length included) is clean, the configuration reference
documents every setting, and nothing points outside the repository."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

from kiln.config import SCHEMA

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    exe = shutil.which("ruff")
    cmd = [exe] if exe else [sys.executable, "-m", "ruff"]
    proc = subprocess.run([*cmd, "check", "."], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_configuration_reference_documents_every_setting():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    sections = re.split(r"^## ", doc, flags=re.M)
    documented = {(s.split("]")[0].lstrip("["), row) for s in sections if s.startswith("[")
                  for row in re.findall(r"^\| `(\w+)` \|", s, flags=re.M)}
    assert documented == {(k.section, k.name) for k in SCHEMA}


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert files
    outside = "../" + "shared"  # spelled apart so that this file does not match itself
    for name in files:
        path = ROOT / name
        if path.suffix in (".py", ".md", ".toml", ".txt", ".ipynb", "") and path.is_file():
            assert outside not in path.read_text(errors="replace"), name


def test_every_benchmark_imports():
    """A benchmark that no test runs still has to import: what it names from kiln must exist."""
    code = ("import importlib, pathlib, sys\n"
            "sys.path.insert(0, 'bench')\n"
            "for path in sorted(pathlib.Path('bench').glob('*.py')):\n"
            "    importlib.import_module(path.stem)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_documented_error_code_is_asserted_by_a_test():
    """docs/http-api.md's error table and the suite agree: each code it names is one some test's
    request gets (the test spells it out as a string)."""
    doc = (ROOT / "docs" / "http-api.md").read_text()
    table = doc[doc.index("## Errors"):doc.index("## Starting and shutting down")]
    codes = {code for line in table.splitlines() if re.match(r"\| \d{3} \|", line)
             for code in re.findall(r"`([a-z_]+)`", line.split("|")[3])} - {"null"}
    assert len(codes) > 30
    here = Path(__file__).name
    tests = "".join(p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name != here)
    assert not {c for c in codes if f'"{c}"' not in tests}, "documented error codes no test asserts"


def test_nothing_outside_the_engine_reaches_into_its_core():
    """The engine's facade (AsyncEngine) is all the rest of Kiln uses: EngineCore, the scheduler, the
    runner and the step types stay behind it."""
    inner = re.compile(r"\._core\b|\bEngineCore\b|kiln\.engine\.(core|scheduler|runner|step_types)\b")
    offenders = [f"{path.relative_to(ROOT)}:{i}" for path in (ROOT / "kiln").rglob("*.py")
                 if "engine" not in path.relative_to(ROOT / "kiln").parts[:1]
                 for i, line in enumerate(path.read_text().splitlines(), 1) if inner.search(line)]
    assert not offenders, offenders


def test_every_broad_except_says_why():
    """`except Exception` (or BaseException) catches bugs too, so each one either re-raises (cleanup)
    or says on its line why this is a boundary where anything must be caught."""
    broad = re.compile(r"^\s*except (Exception|BaseException)\b[^#]*$")
    offenders = []
    for path in (ROOT / "kiln").rglob("*.py"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if broad.match(line):
                body = [n.strip() for n in lines[i + 1:i + 6]]
                if "raise" not in body:
                    offenders.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not offenders, offenders


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The kiln modules `module` imports: at module level, inside functions and under `if TYPE_CHECKING:`,
    but not its own packages (imported before it anyway)."""
    found, todo = set(), [ast.parse(path.read_text())]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    while todo:
        node = todo.pop()
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                found.add(name)
        todo.extend(ast.iter_child_nodes(node))
    return found


def test_no_import_cycles():
    """Imports point one way, inside function bodies and `if TYPE_CHECKING:` blocks too (an import that
    dodges a cycle at run time still ties the two modules into one)."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "kiln").rglob("*.py")}
    graph = {m: _imports(p, m, set(paths)) for m, p in paths.items()}
    cycles, done = [], set()

    def visit(module, stack):
        if module in stack:
            cycles.append(stack[stack.index(module):] + [module])
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, stack + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, cycles


def test_the_module_map_lists_every_module():
    """docs/architecture.md's module map names every module under its package."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc[doc.index("## Module map"):doc.index("## The request path")]
    listed, package = set(), None
    for line in block.splitlines():
        if m := re.match(r"(kiln/\S*)", line):
            package = m[1] if m[1].endswith("/") else None
            if m[1].endswith(".py"):
                listed.add(m[1])
        elif package and (m := re.match(r"  (\w+\.py)\b", line)):
            listed.add(package + m[1])
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kiln").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py") and "proto" not in p.parts}
    assert not modules - listed, sorted(modules - listed)
    assert not listed - modules - {"kiln/server/__main__.py"}, sorted(listed - modules)
