"""The deploy files (k8s, compose, systemd, Dockerfile) run commands the CLIs accept, and their
ports and addresses agree: the workers reach the engine's worker port, the ranks are 0..tp-1 with
one rendezvous, probes and Prometheus hit the engine's metrics port, and an engine reachable from
other hosts has CURVE keys, as its workers do. Files are only parsed; keys come from a keygen.
"""

import argparse
import configparser
import contextlib
import io
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

import deploy.keys
from deploy.cli import core_parser, worker_config_from, worker_parser
from deploy.commands import add_subcommands, engine_config_from
from engine_core.net.address import is_loopback
from engine_core.net.curve import bound_addresses
from protocol.config import CurveKeys, EngineConfig, WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
LEADER_ADDRESS = "kvserve-0.kvserve.default"  # a stand-in for what LeaderWorkerSet injects
KEYS_MOUNT = Path("/etc/kvserve/keys")  # where every deploy file mounts the keygen folder


@pytest.fixture(autouse=True)
def mounted_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--curve-keys-dir reads the keys a real keygen wrote, wherever a deploy file mounts them."""
    deploy.keys.keygen(tmp_path / "keys")
    load = deploy.keys.load_curve_keys

    def load_mounted(folder: Path, role: deploy.keys.Role) -> CurveKeys:
        assert folder == KEYS_MOUNT, f"--curve-keys-dir {folder}: expected {KEYS_MOUNT}"
        return load(tmp_path / "keys", role)

    monkeypatch.setattr(deploy.keys, "load_curve_keys", load_mounted)


def kvserve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return parser


def parse(argv: list[str]) -> EngineConfig | WorkerConfig | argparse.Namespace:
    """The config a command line builds, through the parser of its console script."""
    program, *args = argv
    parsers = {
        "kvserve-core": core_parser,
        "kvserve-worker": worker_parser,
        "kvserve": kvserve_parser,
    }
    name = Path(program).name
    assert name in parsers, f"{program}: expected one of {sorted(parsers)}"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            namespace = parsers[name]().parse_args(args)
    except SystemExit:
        pytest.fail(f"{name} refused {shlex.join(args)}: {stderr.getvalue().strip()}")
    if name == "kvserve-core":
        return engine_config_from(namespace)
    if name == "kvserve-worker":
        return worker_config_from(namespace, {})
    return namespace


def tcp_port(address: str) -> int:
    assert address.startswith("tcp://"), f"{address}: expected a tcp:// address across hosts"
    return int(address.rpartition(":")[2])


def tcp_host(address: str) -> str:
    return address.removeprefix("tcp://").rpartition(":")[0]


def check_group(engine: EngineConfig, workers: list[WorkerConfig], engine_host: str) -> None:
    """Ranks 0..tp-1 once each, all at the engine's worker port, with one rendezvous."""
    assert sorted(w.rank for w in workers) == list(range(engine.tp_size))
    assert {w.tp_size for w in workers} == {engine.tp_size}
    for worker in workers:
        assert tcp_port(worker.engine_address) == tcp_port(engine.worker_address), worker
        assert tcp_host(worker.engine_address) in (engine_host, "127.0.0.1"), worker
    assert len({(w.master_addr, w.master_port) for w in workers}) == 1, "two rendezvous"
    check_curve(engine, workers)


def check_curve(engine: EngineConfig, workers: list[WorkerConfig]) -> None:
    """An engine bound beyond loopback has keys (never --insecure here), and so do its workers;
    an engine without keys has workers without keys."""
    is_exposed = not all(is_loopback(address) for _, address in bound_addresses(engine))
    assert not engine.allow_insecure, "a deploy file runs --insecure"
    assert (engine.curve is not None) == is_exposed, f"exposed {is_exposed}, keys {engine.curve}"
    for worker in workers:
        assert (worker.curve is None) == (engine.curve is None), f"rank {worker.rank}"
        if engine.curve is not None:
            assert worker.curve.server_public_key == engine.curve.public_key, worker.rank
            assert worker.curve.public_key in engine.curve.authorized_keys, worker.rank


def script_names() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def test_a_flag_the_cli_does_not_know_fails_the_check() -> None:
    with pytest.raises(pytest.fail.Exception, match="kvserve-worker refused --no-such-flag"):
        parse(["kvserve-worker", "--no-such-flag", "1"])


def test_every_deploy_command_is_an_installed_console_script() -> None:
    commands = [c["command"][0] for c in compose_services().values() if "command" in c]
    commands += [c["command"][0] for c in lws_containers(leader=True) + lws_containers()]
    commands += [shlex.split(exec_start(name, "0"))[0] for name in SYSTEMD_UNITS]
    assert {Path(c).name for c in commands if c.startswith("kvserve")} <= script_names()


# Kubernetes


def k8s_documents() -> list[dict]:
    paths = sorted((DEPLOY / "k8s").glob("*.yaml"))
    return [doc for path in paths for doc in yaml.safe_load_all(path.read_text())]


def k8s_kind(kind: str) -> dict:
    (document,) = [doc for doc in k8s_documents() if doc["kind"] == kind]
    return document


def lws_containers(leader: bool = False) -> list[dict]:
    template = k8s_kind("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    return template["leaderTemplate" if leader else "workerTemplate"]["spec"]["containers"]


def k8s_argv(container: dict, worker_index: int) -> list[str]:
    """The container's command line as Kubernetes expands the LeaderWorkerSet variables."""
    env = {"LWS_LEADER_ADDRESS": LEADER_ADDRESS, "LWS_WORKER_INDEX": str(worker_index)}
    argv = [*container["command"], *container.get("args", [])]
    for name, value in env.items():
        argv = [arg.replace(f"$({name})", value) for arg in argv]
    return argv


def test_the_leaderworkerset_runs_one_tp_group_across_its_pods() -> None:
    group_size = k8s_kind("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["size"]
    engine, rank_0 = (parse(k8s_argv(c, 0)) for c in lws_containers(leader=True))
    workers = [parse(k8s_argv(c, idx)) for idx in range(1, group_size) for c in lws_containers()]
    assert isinstance(engine, EngineConfig) and engine.tp_size == group_size
    check_group(engine, [rank_0, *workers], LEADER_ADDRESS)
    assert {w.master_addr for w in workers} == {LEADER_ADDRESS}


def test_a_failed_rank_pod_restarts_alone_so_the_engine_recovers_its_requests() -> None:
    """Recreating the whole group on a pod restart would restart the engine in the leader pod
    and fail every request that rank recovery (DESIGN.md §8) would have carried over."""
    template = k8s_kind("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    assert template["restartPolicy"] == "None"
    engine = parse(k8s_argv(lws_containers(leader=True)[0], 0))
    assert isinstance(engine, EngineConfig) and engine.max_worker_restarts > 0


def test_k8s_probes_service_and_servicemonitor_reach_the_metrics_port() -> None:
    engine_container = lws_containers(leader=True)[0]
    engine = parse(k8s_argv(engine_container, 0))
    assert isinstance(engine, EngineConfig) and engine.metrics_port is not None
    assert engine.metrics_host == "0.0.0.0", "the kubelet's probes come from outside the pod"
    named_ports = {p["name"]: p["containerPort"] for p in engine_container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        http_get = engine_container[probe]["httpGet"]
        assert http_get["path"] == "/health"
        assert named_ports.get(http_get["port"], http_get["port"]) == engine.metrics_port
    assert named_ports["metrics"] == engine.metrics_port
    assert named_ports["workers"] == tcp_port(engine.worker_address)
    assert named_ports["client"] == tcp_port(engine.client_address)
    assert named_ports["kv-events"] == tcp_port(engine.kv_events.endpoint)
    service, monitor = k8s_kind("Service"), k8s_kind("ServiceMonitor")
    service_ports = {p["name"]: named_ports[p["targetPort"]] for p in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert service_ports[endpoint["port"]] == engine.metrics_port
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    leader_labels = k8s_kind("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert service["spec"]["selector"].items() <= leader_labels["metadata"]["labels"].items()


def test_every_kvserve_pod_mounts_the_key_secret() -> None:
    template = k8s_kind("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        spec = template[role]["spec"]
        secrets = {v["name"] for v in spec["volumes"] if "secret" in v}
        for container in spec["containers"]:
            mounted = {m["name"] for m in container["volumeMounts"] if m.get("readOnly")}
            assert secrets and secrets <= mounted, f"{role}/{container['name']}"


# Docker Compose


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]


def test_compose_runs_an_engine_and_its_ranks_against_it() -> None:
    services = compose_services()
    engine = parse(services["engine"]["command"])
    workers = {
        name: parse(service["command"])
        for name, service in services.items()
        if service.get("command", [""])[0] == "kvserve-worker"
    }
    assert isinstance(engine, EngineConfig) and len(workers) == engine.tp_size == 2
    check_group(engine, list(workers.values()), "engine")
    rank_0_service = next(name for name, worker in workers.items() if worker.rank == 0)
    assert {w.master_addr for w in workers.values()} == {rank_0_service}
    assert f"{engine.metrics_port}:{engine.metrics_port}" in services["engine"]["ports"]
    assert engine.metrics_host == "0.0.0.0", "Prometheus scrapes from its own container"
    for name, service in services.items():
        if "--curve-keys-dir" in service.get("command", []):
            assert f"./keys:{KEYS_MOUNT}:ro" in service["volumes"], name


def test_prometheus_scrapes_the_engines_metrics_port() -> None:
    services = compose_services()
    engine = parse(services["engine"]["command"])
    mounts = [v.split(":") for v in services["prometheus"]["volumes"]]
    (config_file,) = [DEPLOY / "compose" / source for source, _, *_ in mounts]
    scrape = yaml.safe_load(config_file.read_text())["scrape_configs"]
    (job,) = scrape
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"engine:{engine.metrics_port}"]


# systemd

SYSTEMD_UNITS = ("kvserve-core.service", "kvserve-worker@.service")


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string((DEPLOY / "systemd" / name).read_text())
    return parser


def exec_start(name: str, instance: str) -> str:
    return unit(name)["Service"]["ExecStart"].replace("%i", instance)


def test_systemd_units_restart_always_and_agree_on_addresses() -> None:
    for name in SYSTEMD_UNITS:
        assert unit(name)["Service"]["Restart"] == "always", name
    engine = parse(shlex.split(exec_start("kvserve-core.service", "")))
    assert isinstance(engine, EngineConfig)
    workers = [
        parse(shlex.split(exec_start("kvserve-worker@.service", str(rank))))
        for rank in range(engine.tp_size)
    ]
    check_group(engine, workers, tcp_host(engine.worker_address))
    assert "kvserve-core.service" in unit("kvserve-worker@.service")["Unit"]["After"].split()


# Dockerfile


def test_the_dockerfile_is_the_cpu_build_and_runs_a_command_the_cli_accepts() -> None:
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    instructions = [line for line in lines if line and not line.startswith(("#", " "))]
    assert instructions[0].startswith("FROM python:") and instructions[0].endswith("-slim")
    runs = " ".join(line for line in lines if line.startswith("RUN"))
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs and "torch" in runs
    assert "pip install ." in runs
    (cmd,) = [line.removeprefix("CMD ") for line in instructions if line.startswith("CMD ")]
    parse(yaml.safe_load(cmd))  # the JSON form of CMD is a YAML list


def test_the_dockerfile_copies_every_package_pyproject_installs() -> None:
    """A package left out of the image installs nothing: `kvserve-api` then fails on its first
    import of the client library (engine_client, once part of engine_core)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        pattern.removesuffix("*")
        for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copies = {
        line.split()[1]
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and not line.split()[1].endswith((".toml", ".md"))
    }
    assert "engine_client" in packages
    assert packages <= copies, sorted(packages - copies)
