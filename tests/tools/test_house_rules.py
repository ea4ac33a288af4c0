"""The house rules of "How we write code", checked on the code as it is, so that a change that breaks one fails here
instead of being found by the next engineer:

- the scheduler side never loads the worker side, the copy kernels or CUDA; the worker side and `kernels/` never load
  the scheduler side (checked by importing them, so an import hidden in a package `__init__` counts too);
- a module both sides share never imports the scheduler side (only under `TYPE_CHECKING`, or by name in a registry);
- a second tier is known by name only inside its own modules: no branch on a tier anywhere else;
- `Any` in the product stays under 40 (issue "A house for the next engineer");
- `kernels/` at the repository root never answers to the top-level name `kernels` (Hugging Face's package).
"""
from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = sorted(p for top in ("offload_connector", "kernels") for p in (ROOT / top).rglob("*.py")
                 if "__pycache__" not in p.parts)

# The modules that are a second tier (or name them to build them, or validate their keys): the only places its name
# may decide anything.
TIER_MODULES = {"offload_connector/config.py", "offload_connector/second_tiers.py",
                "offload_connector/transfer_jobs.py", "offload_connector/scheduler/disk_tier.py",
                "offload_connector/scheduler/remote_tier.py",
                "offload_connector/worker/disk_io.py", "offload_connector/worker/remote_io.py"}
TIER_PACKAGES = ("offload_connector/disk/", "offload_connector/remote/")
# Our snake-case names and string values, class names, and the two tier constants; not vLLM's WAITING_FOR_REMOTE_KVS,
# nor "shared" alone (a prefix two requests share).
TIER_NAME = re.compile(r"(^|_)(disk|remote|redis|mooncake)(_|$)|shared_tier|^(Disk|Remote|Redis|Mooncake)[A-Z]"
                       r"|^(DISK|SHARED)$")


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _module(p: Path) -> str:
    parts = p.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _loaded_after_importing(modules: list[str]) -> list[str]:
    """The connector's modules (and cupy) in sys.modules after importing `modules` in a fresh interpreter."""
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            "ours = lambda m: getattr(sys.modules[m], '__file__', None) or ''\n"
            # A top-level `kernels` that is not this repository's is transformers' probe for Hugging Face's package.
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('offload_connector', 'cupy'))\n"
            "                        or m.startswith('kernels') and ours(m).startswith(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "kernels")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_scheduler_side_loads_no_worker_side_kernel_or_cuda_module() -> None:
    scheduler = [_module(p) for p in PRODUCT if _rel(p).startswith("offload_connector/scheduler/")]
    assert len(scheduler) > 20
    loaded = _loaded_after_importing(scheduler)
    assert "offload_connector.scheduler.admission" in loaded
    assert [m for m in loaded if m.startswith(("offload_connector.worker", "offload_connector.kernels", "kernels",
                                               "cupy"))] == []


def test_the_worker_side_and_the_kernels_load_no_scheduler_module() -> None:
    # kernels/ is imported as the package maps it (offload_connector.kernels), as the worker side imports it.
    worker = [_module(p) for p in PRODUCT if _rel(p).startswith("offload_connector/worker/")]
    kernels = ["offload_connector." + _module(p) for p in PRODUCT if _rel(p).startswith("kernels/")]
    assert len(worker) > 8 and len(kernels) > 8
    loaded = _loaded_after_importing(worker + kernels)
    assert "offload_connector.worker.side" in loaded and "offload_connector.kernels.api" in loaded
    assert [m for m in loaded if m.startswith("offload_connector.scheduler")] == []


def _runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every import that runs at import time or in a function: not those under TYPE_CHECKING."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_no_shared_module_imports_the_scheduler_side() -> None:
    # connector.py is the facade vLLM instantiates in both processes: it alone builds either side.
    shared = [p for p in PRODUCT if not _rel(p).startswith(("offload_connector/scheduler/", "offload_connector/worker/",
                                                            "kernels/"))
              and _rel(p) != "offload_connector/connector.py"]
    assert any(_rel(p) == "offload_connector/policies.py" for p in shared)
    climbing = [f"{_rel(p)}:{line} imports {mod}" for p in shared
                for line, mod in _runtime_imports(ast.parse(p.read_text()))
                if mod.startswith("offload_connector.scheduler")]
    assert climbing == []


def _names_in(node: ast.AST) -> list[str]:
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.append(n.id)
        elif isinstance(n, ast.Attribute):
            out.append(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.append(n.value)
    return out


def tier_branches(source: str) -> list[str]:
    """Every condition (if, elif, conditional expression, while, assert, comprehension filter, match) that names a
    second tier."""
    found = []
    for node in ast.walk(ast.parse(source)):
        tests: list[ast.AST] = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.Match):
            tests.append(node.subject)
            tests.extend(c.pattern for c in node.cases)
        for t in tests:
            hits = [n for n in _names_in(t) if TIER_NAME.search(n)]
            if hits:
                found.append(f"line {t.lineno}: {ast.unparse(t)}")
    return found


def test_tier_branches_are_found() -> None:
    """The check below would see a branch on a tier in any of its shapes."""
    assert tier_branches("if self.disk is None:\n    pass") != []
    assert tier_branches("x = a if remote_tier else b") != []
    assert tier_branches("y = [k for k in keys if k.tier == DISK]") != []
    assert tier_branches("if tier == 'redis':\n    pass") != []
    assert tier_branches("if self.shared_tier_reads:\n    pass") != []
    assert tier_branches("if shared_prefix_boundary and unshared:\n    pass") == []  # "shared" prefixes are no tier


def test_no_module_outside_a_tier_branches_on_a_tier() -> None:
    outside = [p for p in PRODUCT if _rel(p) not in TIER_MODULES and not _rel(p).startswith(TIER_PACKAGES)]
    assert any(_rel(p) == "offload_connector/scheduler/core.py" for p in outside)
    branches = {_rel(p): b for p in outside if (b := tier_branches(p.read_text()))}
    assert branches == {}


def _any_uses(source: str) -> int:
    """Uses of `typing.Any` (names in annotations, casts and aliases), not its import."""
    return sum(1 for tok in tokenize.generate_tokens(io.StringIO(source).readline)
               if tok.type == tokenize.NAME and tok.string == "Any"
               and not re.match(r"\s*from typing import|\s*import typing", tok.line))


def test_any_in_the_product_stays_under_40() -> None:
    assert _any_uses("from typing import Any, Callable\nx: Any = 1\ndef f(a: Any) -> dict[str, Any]: ...\n") == 3
    uses = {_rel(p): n for p in PRODUCT if (n := _any_uses(p.read_text()))}
    assert sum(uses.values()) < 40, uses


_PROBE = """
import importlib.util, json, sys
import kernels
spec = importlib.util.find_spec("kernels")  # what transformers asks first; must not raise
try:
    from transformers.integrations import hub_kernels  # probes for Hugging Face's kernels on import
    from transformers.utils.import_utils import is_kernels_available
    hub = is_kernels_available()
except ImportError as exc:
    hub = f"ImportError: {exc}"
import offload_connector.kernels as ours
print(json.dumps({"file": getattr(kernels, "__file__", None), "hub": hub, "ours": ours.__file__,
                  "copier": callable(ours.make_copier),
                  "top_level": sorted(m for m in sys.modules if m.startswith("kernels."))}))
"""


def _probe(*extra_paths: Path) -> dict:
    # Run in the repository root, where the top-level name finds kernels/ (`-c` puts the working directory first on
    # sys.path), with nothing else of ours on the path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in extra_paths)
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_kernels_directory_is_not_hugging_faces_kernels_package(tmp_path: Path) -> None:
    """Without Hugging Face's `kernels` installed, the top-level name finds nothing usable (transformers reads it as
    absent) and none of our modules is imported a second time under it; the connector's kernels load as always. The
    repository a second time on sys.path, through a symlink, and another checkout of it are not taken for another
    `kernels` (each would step aside again, without end)."""
    import importlib.machinery
    import shutil
    link = tmp_path / "checkout"
    link.symlink_to(ROOT)
    other = tmp_path / "other-checkout"
    (other / "offload_connector").mkdir(parents=True)
    (other / "offload_connector" / "__init__.py").write_text("")
    (other / "kernels").mkdir()
    shutil.copy(ROOT / "kernels" / "__init__.py", other / "kernels" / "__init__.py")
    # Hugging Face's, if this environment has it: a `kernels` on sys.path that is no checkout of this project.
    found = (importlib.machinery.PathFinder.find_spec("kernels", [p]) for p in sys.path if isinstance(p, str))
    installed = next((s for s in found if s is not None and s.origin
                      and not (Path(s.origin).parent.parent / "offload_connector" / "__init__.py").is_file()), None)
    seen = _probe(link, other)
    if installed is None:
        assert seen["file"] is None and seen["hub"] is False, seen
    else:  # this environment has Hugging Face's: it is what the name finds
        assert seen["file"] == installed.origin, seen
    assert seen["top_level"] == []
    assert seen["ours"] == str(ROOT / "kernels" / "__init__.py") and seen["copier"]


def test_hugging_faces_kernels_package_is_found_past_the_repository_root(tmp_path: Path) -> None:
    """With it installed, transformers imports its API from it, not from our kernels/ (which failed with
    `cannot import name 'CUDAProperties' from 'kernels'` before), and the connector still gets its own."""
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__version__ = "0.17.2"\n\n\ndef __getattr__(name):\n'
                                     '    if name.startswith("__"):\n        raise AttributeError(name)\n'
                                     '    return type(name, (), {})\n')
    dist = tmp_path / "kernels-0.17.2.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.17.2\n")
    seen = _probe(tmp_path)
    assert seen["file"] == str(pkg / "__init__.py"), seen
    assert seen["hub"] is True, seen  # transformers found a usable Hugging Face kernels and imported its API
    assert seen["ours"] == str(ROOT / "kernels" / "__init__.py") and seen["copier"]
