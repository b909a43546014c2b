"""The import rules of DESIGN.md §2, checked by parsing every module's imports."""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "engine_core", "worker", "deploy")
STDLIB = set(sys.stdlib_module_names)

# package -> top-level modules it must never import
FORBIDDEN = {
    "protocol": {"engine_core", "worker", "deploy", "torch", "numpy", "zmq"},
    "engine_core": {"torch", "worker", "deploy"},
    "worker": {"engine_core", "deploy"},
    "deploy": set(),
}
PROTOCOL_ALLOWED_THIRD_PARTY = {"msgspec"}


def _imported_top_levels(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _modules(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_package_respects_import_rules(package: str) -> None:
    violations = []
    for path in _modules(package):
        imported = _imported_top_levels(path)
        for name in sorted(imported & FORBIDDEN[package]):
            violations.append(f"{path.relative_to(ROOT)} imports {name}")
        if package == "protocol":
            for name in sorted(imported - STDLIB - PROTOCOL_ALLOWED_THIRD_PARTY - {"protocol"}):
                violations.append(f"{path.relative_to(ROOT)} imports {name}, not stdlib or msgspec")
    assert not violations, "\n".join(violations)


def test_nothing_imports_deploy() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("protocol", "engine_core", "worker", "bench")
        for path in sorted((ROOT / package).rglob("*.py"))
        if "deploy" in _imported_top_levels(path)
    ]
    assert not offenders, offenders


def test_engine_and_worker_never_read_argv_or_environment() -> None:
    offenders = []
    for package in ("protocol", "engine_core", "worker"):
        for path in _modules(package):
            text = path.read_text()
            if "os.environ" in text or "sys.argv" in text or "os.getenv" in text:
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_benchmark_peers_never_import_kvserve() -> None:
    """A peer runs in vLLM's environment, where kvserve is not installed; bench/trace.py is shared
    with it, so it too must stay standard library only."""
    paths = [ROOT / "bench" / "trace.py", *sorted((ROOT / "bench" / "peers").glob("*.py"))]
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in paths
        for name in sorted(_imported_top_levels(path) & set(PACKAGES))
    ]
    trace_imports = _imported_top_levels(ROOT / "bench" / "trace.py")
    offenders += [f"bench/trace.py imports {name}" for name in sorted(trace_imports - STDLIB)]
    assert len(paths) >= 3 and not offenders, offenders
