"""The import rules of DESIGN.md §2 and the folder rules of engine_core and worker/models, checked
by parsing every module's imports under a root; and every module opens with a docstring of what it
owns.

Each checking function takes the root directory, so the tests below also run it on planted trees.
"""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = (
    *("protocol", "kv_hashing", "engine_core", "engine_client", "worker", "deploy", "api_server"),
    "kvserve",
)
STDLIB = set(sys.stdlib_module_names)

# package -> top-level modules it must never import
FORBIDDEN = {
    "protocol": {
        *("engine_core", "engine_client", "worker", "deploy", "api_server"),
        *("torch", "numpy", "zmq"),
    },
    "engine_core": {"torch", "worker", "deploy", "api_server", "engine_client"},
    # the client library speaks the protocol over a socket and needs nothing of the engine
    "engine_client": {"engine_core", "worker", "deploy", "api_server", "torch", "kv_hashing"},
    "worker": {"engine_core", "engine_client", "deploy", "api_server", "kv_hashing"},
    # block hashing, shared by the engine and the front end: the protocol and xxhash only
    "kv_hashing": {
        *("engine_core", "engine_client", "worker", "deploy", "api_server"),
        *("torch", "numpy", "zmq"),
    },
    "deploy": set(),
    "api_server": {"engine_core", "worker", "deploy", "torch"},  # engines only through the client
    # the offline API: it launches through deploy/ and reaches engines only through the client,
    # as the front end does; the model and the scheduler stay in the processes it starts
    "kvserve": {"engine_core", "worker", "kv_hashing", "torch"},
}
PROTOCOL_ALLOWED_THIRD_PARTY = {"msgspec"}
KV_HASHING_ALLOWED_IMPORTS = {"msgspec", "xxhash", "protocol", "kv_hashing"}
# The only modules that may import kv_hashing: the KV-cache layer keys its prefix cache with it,
# the engine service announces its HashParams, and the front end hashes requests to route them.
KV_HASHING_IMPORTERS = ("engine_core.kv_cache", "engine_core.service", "api_server.routing")
# The only modules that may import triton: its kernels compile for GPUs only, and a CPU-only
# install (no triton there) must be able to import everything else. The attention kernels, and
# the decoder's fused norm, SiLU and rotary kernels (imported by layer_ops for CUDA only).
TRITON_IMPORTERS = ("worker.attention_backends", "worker.models.hf.fused_kernels")

# The folders of engine_core (and core.py), each with the folders of engine_core it may import
# besides its own; every other import between them is a FORBIDDEN_EDGE. Every module of
# engine_core lies in one of them, so a new folder or loose module must state its rule here.
ENGINE_CORE_FOLDERS = {
    # the KV-cache layer, plain Python: the pool knows nothing of scheduling
    "engine_core.kv_cache": (),
    # requests and the scheduler, which asks the KV-cache manager; no processes, no sockets
    "engine_core.sched": ("engine_core.kv_cache", "engine_core.structured"),
    # the grammar owner of structured outputs: it compiles and matches, and schedules nothing
    "engine_core.structured": (),
    # P/D pins and pulls over the pool; requests as the scheduler builds them, never scheduled
    "engine_core.kv_transfer": ("engine_core.sched", "engine_core.kv_cache"),
    # the Executor protocols and the in-process pipeline: they run steps and schedule nothing
    "engine_core.executors": (),
    # EngineCore, the step loop over an Executor: it owns the scheduler and touches no socket
    "engine_core.core": (
        "engine_core.executors",
        "engine_core.sched",
        "engine_core.kv_cache",
        "engine_core.structured",
        "engine_core.kv_transfer",
    ),
    # addresses, binding and CURVE: under every folder that opens a socket, above none
    "engine_core.net": (),
    # metrics and KV events bind through net, and read neither the scheduler nor the pool
    "engine_core.telemetry": ("engine_core.net",),
    # the worker side binds through net and never reaches the service, so never the client router
    "engine_core.workers": ("engine_core.net",),
    # the engine process: the only folder that joins the worker side and the client side
    "engine_core.service": (
        *("engine_core.core", "engine_core.sched", "engine_core.kv_cache"),
        "engine_core.structured",
        "engine_core.kv_transfer",
        *("engine_core.net", "engine_core.telemetry", "engine_core.workers"),
    ),
}

# The parts of worker/models, each with the parts it may import besides its own, as above: the
# built-in models and the checkpoint decoder never import each other, and meet only in the
# registry and the Model protocol. Every module of worker/models lies in one of them.
WORKER_MODELS_FOLDERS = {
    # the one protocol both kinds of model satisfy: it imports no model
    "worker.models.model": (),
    # the built-in names, which deploy/ reads without torch
    "worker.models.names": (),
    # Hugging Face checkpoints know nothing of the built-in models
    "worker.models.hf": ("worker.models.model",),
    # the built-in models; their references ask the registry for a model's ModelInfo
    "worker.models.fake": ("worker.models.model", "worker.models.registry"),
    # the registry builds either kind by name
    "worker.models.registry": (
        *("worker.models.model", "worker.models.names"),
        *("worker.models.hf", "worker.models.fake"),
    ),
}
# The three concerns of the front end, each a package, and the two modules that join them, each
# with the parts of api_server it may import besides its own, as above.
API_SERVER_FOLDERS = {
    # tokenizers and chat templates: text in, token ids out, for the protocol and the offline API
    "api_server.tokenizer": (),
    # the engine pool, its records and policies: engine requests in, outputs out; it knows
    # nothing of the OpenAI protocol, nor of text
    "api_server.routing": (),
    # the OpenAI protocol surface submits through routing's package interface only (below)
    "api_server.openai": ("api_server.tokenizer", "api_server.routing"),
    # /metrics reads the pool's records and holds serving's latency histograms
    "api_server.metrics": ("api_server.openai", "api_server.routing"),
    # the app joins them all
    "api_server.app": (
        *("api_server.tokenizer", "api_server.routing", "api_server.openai"),
        "api_server.metrics",
    ),
}
# (importer, package): `importer` may import `package` itself (what its __init__ exports), never
# a module inside it, so that the package's internals can change behind that interface.
NARROW_INTERFACES = (("api_server.openai", "api_server.routing"),)
# each package, with the folders (or modules) every one of its modules must lie in
FOLDER_RULES = {
    "engine_core": ENGINE_CORE_FOLDERS,
    "worker.models": WORKER_MODELS_FOLDERS,
    "api_server": API_SERVER_FOLDERS,
}


def _folder_edges(folders: dict[str, tuple[str, ...]]) -> tuple[tuple[str, str], ...]:
    """The edges between `folders` that their allowed lists leave out."""
    return tuple(
        (folder, other)
        for folder, allowed in folders.items()
        for other in folders
        if other != folder and other not in allowed
    )


# (importer, imported): edges inside a package that must not exist; each side is a module or a
# package, and a package stands for every module under it.
FORBIDDEN_EDGES = (
    *_folder_edges(ENGINE_CORE_FOLDERS),
    # the server reaches the scheduler and the pool only through EngineCore
    ("engine_core.service.server", "engine_core.sched"),
    ("engine_core.service.server", "engine_core.kv_cache"),
    *_folder_edges(WORKER_MODELS_FOLDERS),
    # the fixed-point grids, and the sampler that draws on them, need no model
    ("worker.numerics", "worker.models"),
    ("worker.sampling", "worker.models"),
    ("worker.sampler", "worker.models"),
    *_folder_edges(API_SERVER_FOLDERS),
)
# Known violations of FORBIDDEN_EDGES; each entry goes when its import does.
ALLOWED_EDGES: tuple[tuple[str, str], ...] = ()
# no two modules of these import each other, even indirectly
ACYCLIC_PACKAGES = ("deploy", "engine_client")


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: pathlib.Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _is_within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _imported_modules(path: pathlib.Path, root: pathlib.Path) -> set[str]:
    """Every module `path` imports, at any depth (lazy imports too), as absolute dotted names.

    `from a import b` names `a.b` when that is a module under `root`, else `a`.
    """
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base_parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*base_parts, *([node.module] if node.module else [])])
            for alias in node.names:
                member = f"{base}.{alias.name}"
                names.add(member if _is_module(member, root) else base)
    return names


def _modules(root: pathlib.Path, name: str) -> list[pathlib.Path]:
    """The files of module or package `name` under `root`."""
    path = root.joinpath(*name.split("."))
    if path.with_suffix(".py").is_file():
        return [path.with_suffix(".py")]
    return sorted(path.rglob("*.py"))


def _imported_top_levels(path: pathlib.Path, root: pathlib.Path) -> set[str]:
    return {name.split(".")[0] for name in _imported_modules(path, root)}


def package_violations(root: pathlib.Path, package: str) -> list[str]:
    """Imports of top-level modules that FORBIDDEN (or protocol's stdlib rule) refuses."""
    violations = []
    for path in _modules(root, package):
        imported = _imported_top_levels(path, root)
        for name in sorted(imported & FORBIDDEN[package]):
            violations.append(f"{path.relative_to(root)} imports {name}")
        if package == "protocol":
            for name in sorted(imported - STDLIB - PROTOCOL_ALLOWED_THIRD_PARTY - {"protocol"}):
                violations.append(f"{path.relative_to(root)} imports {name}, not stdlib or msgspec")
        if package == "kv_hashing":
            for name in sorted(imported - STDLIB - KV_HASHING_ALLOWED_IMPORTS):
                violations.append(f"{path.relative_to(root)} imports {name}, outside its rule")
    return violations


def kv_hashing_importers_outside(root: pathlib.Path) -> list[str]:
    """Imports of kv_hashing by a module of PACKAGES outside KV_HASHING_IMPORTERS."""
    return [
        f"{path.relative_to(root)} imports {name}"
        for package in PACKAGES
        if package != "kv_hashing"
        for path in _modules(root, package)
        if not any(_is_within(_module_name(path, root), ok) for ok in KV_HASHING_IMPORTERS)
        for name in sorted(_imported_modules(path, root))
        if _is_within(name, "kv_hashing")
    ]


def triton_importers_outside(root: pathlib.Path) -> list[str]:
    """Imports of triton by a module of PACKAGES outside TRITON_IMPORTERS."""
    return [
        f"{path.relative_to(root)} imports {name}"
        for package in PACKAGES
        for path in _modules(root, package)
        if not any(_is_within(_module_name(path, root), ok) for ok in TRITON_IMPORTERS)
        for name in sorted(_imported_modules(path, root))
        if _is_within(name, "triton")
    ]


def edges(root: pathlib.Path, importer: str, imported: str) -> list[str]:
    """Each import by a module within `importer` of a module within `imported`, as text."""
    return [
        f"{path.relative_to(root)} imports {name}"
        for path in _modules(root, importer)
        for name in sorted(_imported_modules(path, root))
        if _is_within(name, imported)
    ]


def interface_bypasses(
    root: pathlib.Path, interfaces: tuple[tuple[str, str], ...] = NARROW_INTERFACES
) -> list[str]:
    """Imports by a module within each importer of a module inside its package's interface."""
    return [
        edge
        for importer, package in interfaces
        for edge in edges(root, importer, package)
        if not edge.endswith(f" imports {package}")
    ]


def forbidden_edges(
    root: pathlib.Path,
    forbidden: tuple[tuple[str, str], ...] = FORBIDDEN_EDGES,
    allowed: tuple[tuple[str, str], ...] = ALLOWED_EDGES,
) -> list[str]:
    """The imports that `forbidden` refuses and `allowed` does not excuse."""
    excused = {edge for importer, target in allowed for edge in edges(root, importer, target)}
    return [
        edge
        for importer, target in forbidden
        for edge in edges(root, importer, target)
        if edge not in excused
    ]


def import_cycles(root: pathlib.Path, package: str) -> list[list[str]]:
    """The sets of modules of `package` that import each other, directly or through others.

    Tarjan's strongly connected components over the package's own import graph; each set of two
    or more modules is a cycle, reported sorted.
    """
    paths = {_module_name(path, root): path for path in _modules(root, package)}
    graph = {
        module: sorted(name for name in _imported_modules(path, root) if name in paths)
        for module, path in paths.items()
    }
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in graph[module]:
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(cycles)


def modules_outside_folders(root: pathlib.Path, package: str) -> list[str]:
    """The modules of `package` in none of its FOLDER_RULES, so that no rule covers them."""
    folders = FOLDER_RULES[package]
    return [
        str(path.relative_to(root))
        for path in _modules(root, package)
        if _module_name(path, root) != package
        and not any(_is_within(_module_name(path, root), folder) for folder in folders)
    ]


def modules_without_docstring(root: pathlib.Path, package: str) -> list[str]:
    """The modules of `package` that do not open with a docstring saying what they own."""
    return [
        str(path.relative_to(root))
        for path in _modules(root, package)
        if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
    ]


@pytest.mark.parametrize("package", PACKAGES)
def test_package_respects_import_rules(package: str) -> None:
    violations = package_violations(ROOT, package)
    assert not violations, "\n".join(violations)


def test_only_the_kv_cache_the_service_and_the_front_end_import_kv_hashing() -> None:
    offenders = kv_hashing_importers_outside(ROOT)
    assert not offenders, offenders


def test_checker_reports_a_planted_kv_hashing_import_outside_its_importers(
    tmp_path: pathlib.Path,
) -> None:
    root = _plant(
        tmp_path,
        {
            "kv_hashing/__init__.py": "",
            "kv_hashing/block_hasher.py": "import xxhash\nfrom protocol.config import HashAlgo\n",
            "kv_hashing/planted.py": "import yaml\n",
            "engine_core/kv_cache/hashing.py": "from kv_hashing.block_hasher import BlockHasher\n",
            "engine_core/sched/request.py": "from kv_hashing import block_hasher\n",
            "api_server/routing/router.py": "from kv_hashing.block_hasher import BlockHasher\n",
            "engine_client/request.py": "import kv_hashing.block_hasher\n",
        },
    )
    assert kv_hashing_importers_outside(root) == [
        "engine_core/sched/request.py imports kv_hashing.block_hasher",
        "engine_client/request.py imports kv_hashing.block_hasher",
    ]
    assert package_violations(root, "kv_hashing") == [
        "kv_hashing/planted.py imports yaml, outside its rule"
    ]


def test_only_the_attention_backends_and_fused_kernels_import_triton() -> None:
    offenders = triton_importers_outside(ROOT)
    assert not offenders, offenders


def test_checker_reports_a_planted_triton_import_outside_its_importers(
    tmp_path: pathlib.Path,
) -> None:
    root = _plant(
        tmp_path,
        {
            "worker/__init__.py": "",
            "worker/attention_backends/__init__.py": "",
            "worker/attention_backends/kernels.py": "import triton.language as tl\n",
            "worker/model_runner.py": "def f() -> None:\n    from triton import jit\n",
            "worker/models/hf/fused_kernels.py": "import triton\nimport triton.language as tl\n",
            "worker/models/hf/layer_ops.py": (
                "def f() -> None:\n    from worker.models.hf.fused_kernels import FusedLayerOps\n"
            ),
            "worker/models/hf/decoder.py": "import triton.language as tl\n",
        },
    )
    assert triton_importers_outside(root) == [
        "worker/model_runner.py imports triton",
        "worker/models/hf/decoder.py imports triton.language",
    ]


def test_packages_keep_their_inner_edges() -> None:
    """Each folder of engine_core and of worker/models imports only the folders its rules allow
    it, server.py reaches the scheduler only through EngineCore, and sampling needs no model."""
    violations = forbidden_edges(ROOT)
    assert not violations, "\n".join(violations)


def test_the_openai_package_reaches_routing_only_through_its_interface() -> None:
    bypasses = interface_bypasses(ROOT)
    assert not bypasses, "\n".join(bypasses)


def test_checker_reports_a_planted_bypass_of_the_routing_interface(
    tmp_path: pathlib.Path,
) -> None:
    """serving may import what api_server.routing exports; a module inside it, even lazily and
    relatively, is a bypass; routing importing the protocol types, and the tokenizer importing
    either package, are forbidden edges."""
    root = _plant(
        tmp_path,
        {
            "api_server/__init__.py": "",
            "api_server/routing/__init__.py": "from api_server.routing.engine_pool import X\n",
            "api_server/routing/engine_pool.py": "",
            "api_server/routing/router.py": (
                "def f() -> None:\n    from ..openai.protocol import ChatRequest\n"
            ),
            "api_server/openai/__init__.py": "",
            "api_server/openai/protocol.py": "",
            "api_server/openai/serving.py": "from api_server.routing import EnginePool\n",
            "api_server/openai/engine_requests.py": (
                "def f() -> None:\n    from ..routing import engine_pool\n"
            ),
            "api_server/tokenizer/__init__.py": "",
            "api_server/tokenizer/chat_template.py": "import api_server.openai.protocol\n",
        },
    )
    assert interface_bypasses(root) == [
        "api_server/openai/engine_requests.py imports api_server.routing.engine_pool"
    ]
    assert forbidden_edges(root) == [
        "api_server/tokenizer/chat_template.py imports api_server.openai.protocol",
        "api_server/routing/router.py imports api_server.openai.protocol",
    ]


@pytest.mark.parametrize("package", FOLDER_RULES)
def test_every_module_lies_in_a_folder_with_rules(package: str) -> None:
    outside = modules_outside_folders(ROOT, package)
    assert not outside, outside


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_opens_with_what_it_owns(package: str) -> None:
    missing = modules_without_docstring(ROOT, package)
    assert not missing, missing


@pytest.mark.parametrize("package", ACYCLIC_PACKAGES)
def test_package_has_no_import_cycle(package: str) -> None:
    cycles = import_cycles(ROOT, package)
    assert not cycles, cycles


def _plant(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_reports_a_planted_kv_cache_to_sched_import(tmp_path: pathlib.Path) -> None:
    root = _plant(
        tmp_path,
        {
            "engine_core/__init__.py": "",
            "engine_core/kv_cache/__init__.py": "",
            "engine_core/kv_cache/block_pool.py": "from engine_core.sched.request import Request\n",
            "engine_core/kv_cache/manager.py": "def f() -> None:\n    from ..sched import queues\n",
            "engine_core/kv_cache/hashing.py": "import hashlib\n",
            "engine_core/sched/__init__.py": "",
            "engine_core/sched/request.py": "from ..kv_cache.hashing import BlockHasher\n",
            "engine_core/sched/queues.py": "",
            "engine_core/service/__init__.py": "",
            "engine_core/service/server.py": (
                "from engine_core.kv_cache.spec import plan_kv_cache\n"
                "from engine_core.sched import scheduler\n"
            ),
            "engine_core/sched/scheduler.py": "",
            "engine_core/kv_cache/spec.py": "",
        },
    )
    assert forbidden_edges(root) == [
        "engine_core/kv_cache/block_pool.py imports engine_core.sched.request",
        "engine_core/kv_cache/manager.py imports engine_core.sched.queues",
        "engine_core/service/server.py imports engine_core.sched.scheduler",
        "engine_core/service/server.py imports engine_core.kv_cache.spec",
    ]


def test_checker_reports_a_worker_side_import_of_the_client_router(tmp_path: pathlib.Path) -> None:
    """Only the service joins the worker side and the client side: startup may import both, the
    worker group may not import the router, even lazily and relatively."""
    root = _plant(
        tmp_path,
        {
            "engine_core/service/__init__.py": "",
            "engine_core/service/client_router.py": "",
            "engine_core/service/startup.py": (
                "from engine_core.service.client_router import ClientRouter\n"
                "from engine_core.workers.worker_group import WorkerGroup\n"
            ),
            "engine_core/workers/__init__.py": "",
            "engine_core/workers/worker_group.py": (
                "def f() -> None:\n    from ..service.client_router import ClientRouter\n"
            ),
            "engine_core/telemetry/__init__.py": "",
            "engine_core/telemetry/metrics.py": "from engine_core.workers import worker_group\n",
        },
    )
    assert forbidden_edges(root) == [
        "engine_core/telemetry/metrics.py imports engine_core.workers.worker_group",
        "engine_core/workers/worker_group.py imports engine_core.service.client_router",
    ]


def test_checker_reports_a_planted_import_between_fake_and_hf_models(
    tmp_path: pathlib.Path,
) -> None:
    """The registry may import both kinds of model; neither kind imports the other, even lazily and
    relatively, and neither the grids nor the sampler import a model."""
    root = _plant(
        tmp_path,
        {
            "worker/models/registry.py": (
                "from worker.models.fake.checksum import ChecksumModel\n"
                "from worker.models.hf.decoder import HFDecoder\n"
            ),
            "worker/models/fake/__init__.py": "",
            "worker/models/fake/checksum.py": "",
            "worker/models/fake/reference.py": "from worker.models import registry\n",
            "worker/models/fake/tiny_llama.py": "from ..hf.rope import Rotary\n",
            "worker/models/hf/__init__.py": "",
            "worker/models/hf/rope.py": "",
            "worker/models/hf/decoder.py": "def f() -> None:\n    from ..fake import checksum\n",
            "worker/numerics/fixed_point.py": "from worker.models.fake import checksum\n",
            "worker/sampler.py": "import worker.models.registry\n",
        },
    )
    assert forbidden_edges(root) == [
        "worker/models/hf/decoder.py imports worker.models.fake.checksum",
        "worker/models/fake/tiny_llama.py imports worker.models.hf.rope",
        "worker/numerics/fixed_point.py imports worker.models.fake.checksum",
        "worker/sampler.py imports worker.models.registry",
    ]


def _planted_file(name: str, leaf: str) -> str:
    """Where a planted module within `name` goes: `name` itself when it is a module today, else a
    module `leaf` inside the package."""
    path = name.replace(".", "/")
    return f"{path}/{leaf}.py" if (ROOT / path).is_dir() else f"{path}.py"


@pytest.mark.parametrize("edge", FORBIDDEN_EDGES, ids="->".join)
def test_checker_reports_each_forbidden_edge_on_a_planted_tree(
    tmp_path: pathlib.Path, edge: tuple[str, str]
) -> None:
    importer, imported = edge
    importer_file = _planted_file(importer, "planted_importer")
    imported_file = _planted_file(imported, "planted_target")
    imported_module = imported_file.removesuffix(".py").replace("/", ".")
    root = _plant(tmp_path, {importer_file: f"import {imported_module}\n", imported_file: ""})
    assert forbidden_edges(root) == [f"{importer_file} imports {imported_module}"]


@pytest.mark.parametrize(
    ("package", "name"),
    [(package, name) for package, names in FORBIDDEN.items() for name in sorted(names)],
)
def test_checker_reports_each_forbidden_package_import_on_a_planted_tree(
    tmp_path: pathlib.Path, package: str, name: str
) -> None:
    root = _plant(tmp_path, {f"{package}/planted.py": f"def f() -> None:\n    import {name}\n"})
    assert f"{package}/planted.py imports {name}" in package_violations(root, package)


def test_checker_reports_a_planted_protocol_import_outside_stdlib_and_msgspec(
    tmp_path: pathlib.Path,
) -> None:
    root = _plant(
        tmp_path,
        {
            "protocol/config.py": "import json\nimport msgspec\nfrom protocol import errors\n",
            "protocol/errors.py": "",
            "protocol/codec.py": "import yaml\n",
        },
    )
    assert package_violations(root, "protocol") == [
        "protocol/codec.py imports yaml, not stdlib or msgspec"
    ]


def test_checker_reports_a_planted_module_outside_the_folders(tmp_path: pathlib.Path) -> None:
    root = _plant(
        tmp_path,
        {
            "engine_core/__init__.py": "",
            "engine_core/core.py": "",
            "engine_core/kv_cache/block_pool.py": "",
            "engine_core/loose.py": "",
            "engine_core/gadgets/__init__.py": "",
        },
    )
    assert modules_outside_folders(root, "engine_core") == [
        "engine_core/gadgets/__init__.py",
        "engine_core/loose.py",
    ]


def test_checker_reports_a_planted_model_outside_fake_and_hf(tmp_path: pathlib.Path) -> None:
    """A new model goes into fake/ or hf/, never loose beside the registry."""
    root = _plant(
        tmp_path,
        {
            "worker/models/__init__.py": "",
            "worker/models/model.py": "",
            "worker/models/registry.py": "",
            "worker/models/fake/tiny_llama.py": "",
            "worker/models/hf/decoder.py": "",
            "worker/models/tiny_gpt.py": "",
        },
    )
    assert modules_outside_folders(root, "worker.models") == ["worker/models/tiny_gpt.py"]


def test_checker_reports_a_planted_module_without_docstring(tmp_path: pathlib.Path) -> None:
    root = _plant(
        tmp_path,
        {
            "engine_client/__init__.py": '"""The client library."""\n',
            "engine_client/errors.py": '# errors\n"""The errors a client raises."""\n',
            "engine_client/request.py": "import time\n",
            "engine_client/connection.py": '""" """\n',
        },
    )
    assert modules_without_docstring(root, "engine_client") == [
        "engine_client/connection.py",
        "engine_client/request.py",
    ]


def test_checker_reports_a_planted_deploy_cycle(tmp_path: pathlib.Path) -> None:
    root = _plant(
        tmp_path,
        {
            "deploy/__init__.py": "",
            "deploy/cli.py": "from deploy import commands\nfrom deploy.logs import setup\n",
            "deploy/commands.py": "def f() -> None:\n    import deploy.cli\n",
            "deploy/logs.py": "import logging\n",
        },
    )
    assert import_cycles(root, "deploy") == [["deploy.cli", "deploy.commands"]]
    (root / "deploy" / "commands.py").write_text("from deploy.logs import setup\n")
    assert import_cycles(root, "deploy") == []


def test_nothing_imports_deploy() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("protocol", "engine_core", "engine_client", "worker", "bench")
        for path in _modules(ROOT, package)
        if "deploy" in _imported_top_levels(path, ROOT)
    ]
    assert not offenders, offenders


def test_nothing_imports_the_offline_api() -> None:
    """kvserve/ sits on top of every package, as deploy/ does: importing it would start
    engines from inside the project."""
    offenders = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        if package != "kvserve"
        for path in _modules(ROOT, package)
        if "kvserve" in _imported_top_levels(path, ROOT)
    ]
    assert not offenders, offenders


def test_engine_and_worker_never_read_argv_or_environment() -> None:
    offenders = []
    for package in ("protocol", "engine_core", "engine_client", "worker"):
        for path in _modules(ROOT, package):
            text = path.read_text()
            if "os.environ" in text or "sys.argv" in text or "os.getenv" in text:
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def _bench_modules_imported(path: pathlib.Path, root: pathlib.Path) -> set[str]:
    """The `bench.X` modules `path` imports, as names relative to bench/ (`trace`, `replay`)."""
    return {
        name.removeprefix("bench.")
        for name in _imported_modules(path, root)
        if name.startswith("bench.")
    }


def test_benchmark_peers_never_import_kvserve() -> None:
    """A peer runs in vLLM's environment, where kvserve is not installed; the bench modules it
    shares (bench/trace.py, bench/replay.py, ...) must stay standard library only, transitively."""
    peers = sorted((ROOT / "bench" / "peers").glob("*.py"))
    shared: set[str] = set()
    pending = [name for path in peers for name in _bench_modules_imported(path, ROOT)]
    while pending:
        name = pending.pop()
        if name not in shared and not name.startswith("peers."):  # peers are checked below
            shared.add(name)
            path = ROOT / "bench" / f"{name.replace('.', '/')}.py"
            pending += _bench_modules_imported(path, ROOT)
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in peers
        for name in sorted(_imported_top_levels(path, ROOT) & set(PACKAGES))
    ]
    for name in sorted(shared):
        path = ROOT / "bench" / f"{name.replace('.', '/')}.py"
        imports = _imported_top_levels(path, ROOT) - {"bench"}
        offenders += [f"{path.relative_to(ROOT)} imports {other}" for other in imports - STDLIB]
    assert len(peers) >= 3 and {"trace", "replay", "scheduler_workloads"} <= shared, shared
    assert not offenders, offenders


def _attribute_reads(path: pathlib.Path, attribute: str, of: str | None = None) -> list[str]:
    """`file:line` of every `<expr>.<attribute>` in the module at `path`; with `of`, only where
    `<expr>` is a name or attribute called `of` (`core.scheduler`, not `config.scheduler`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == attribute
        and (of is None or _name_of(node.value) == of)
    ]


def _name_of(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def test_the_service_never_reaches_through_engine_core_to_the_scheduler() -> None:
    """Imports alone cannot see `core.scheduler.kv_cache_manager.block_pool`: the service asks
    EngineCore's accessors, so the scheduler and the pool can change behind them."""
    reads = [
        read
        for path in sorted((ROOT / "engine_core" / "service").glob("*.py"))
        for attribute in ("kv_cache_manager", "block_pool")
        for read in _attribute_reads(path, attribute)
    ] + [
        read
        for path in sorted((ROOT / "engine_core" / "service").glob("*.py"))
        for read in _attribute_reads(path, "scheduler", of="core")
    ]
    assert not reads, reads


def test_attribute_reads_are_found(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = tmp_path / "engine_core" / "service" / "server.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("def f(core):\n    return core.scheduler.kv_cache_manager\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _attribute_reads(planted, "scheduler", of="core") == ["engine_core/service/server.py:2"]
    assert _attribute_reads(planted, "scheduler", of="config") == []
