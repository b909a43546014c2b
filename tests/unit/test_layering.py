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


def _bench_modules_imported(path: pathlib.Path) -> set[str]:
    """The `bench.X` modules `path` imports, as names relative to bench/ (`trace`, `replay`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        module = node.module if isinstance(node, ast.ImportFrom) and node.level == 0 else None
        if module and module.startswith("bench."):
            names.add(module.removeprefix("bench."))
    return names


def test_benchmark_peers_never_import_kvserve() -> None:
    """A peer runs in vLLM's environment, where kvserve is not installed; the bench modules it
    shares (bench/trace.py, bench/replay.py, ...) must stay standard library only, transitively."""
    peers = sorted((ROOT / "bench" / "peers").glob("*.py"))
    shared: set[str] = set()
    pending = [name for path in peers for name in _bench_modules_imported(path)]
    while pending:
        name = pending.pop()
        if name not in shared and not name.startswith("peers."):  # peers are checked below
            shared.add(name)
            pending += _bench_modules_imported(ROOT / "bench" / f"{name.replace('.', '/')}.py")
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in peers
        for name in sorted(_imported_top_levels(path) & set(PACKAGES))
    ]
    for name in sorted(shared):
        path = ROOT / "bench" / f"{name.replace('.', '/')}.py"
        imports = _imported_top_levels(path) - {"bench"}
        offenders += [f"{path.relative_to(ROOT)} imports {other}" for other in imports - STDLIB]
    assert len(peers) >= 3 and {"trace", "replay", "scheduler_workloads"} <= shared, shared
    assert not offenders, offenders
