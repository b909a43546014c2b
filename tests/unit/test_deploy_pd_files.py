"""The P/D variants of the deploy files (compose.pd.yaml, k8s/pd/pd.yaml) run commands the CLIs
accept and agree with each other: one prefill and one decode engine of one model and block size,
the prefill ranks serving transfers on every interface, CURVE wherever a socket leaves its
container, and a front end whose --engine-address flags reach both engines' client ports.
Files are only parsed; keys come from a keygen (test_deploy_files' fixture).
"""

from pathlib import Path

import yaml
from test_deploy_files import DEPLOY, KEYS_MOUNT, mounted_keys, parse, tcp_port  # noqa: F401

from deploy.commands import LAUNCH_WORKER_FLAGS, engine_config_from
from deploy.flags import build_config
from engine_core.net.address import is_loopback
from engine_core.net.curve import bound_addresses
from protocol.config import EngineConfig, WorkerConfig


def launched(argv: list[str]) -> tuple[EngineConfig, WorkerConfig]:
    """The engine and base worker configs of a `kvserve launch` command line."""
    namespace = parse(argv)
    assert namespace.command == "launch", argv
    engine = engine_config_from(namespace)
    worker = build_config(namespace, LAUNCH_WORKER_FLAGS, WorkerConfig)
    return engine, worker


def check_pair(engines: dict[str, list[str]], front_end: list[str], hosts: dict[str, str]) -> None:
    """`engines`: role -> launch argv; `hosts`: role -> the name other containers reach it by."""
    configs = {role: launched(argv) for role, argv in engines.items()}
    assert {role: engine.kv_role for role, (engine, _) in configs.items()} == {
        "prefill": "prefill",
        "decode": "decode",
    }
    prefill, prefill_worker = configs["prefill"]
    decode, decode_worker = configs["decode"]
    assert prefill.kv_transfer_address == "tcp://*", "decode ranks in other containers pull"
    assert prefill_worker.model == decode_worker.model
    for field in ("block_size", "kv_cache_memory_bytes"):
        assert getattr(prefill.cache, field) == getattr(decode.cache, field), field
    assert prefill.tp_size == decode.tp_size, "a pair must agree on the TP size"
    for engine, _ in configs.values():
        exposed = not all(is_loopback(address) for _, address in bound_addresses(engine))
        assert exposed and engine.curve is not None and not engine.allow_insecure
        assert engine.kv_events.enable_kv_cache_events, "the kv router follows KV events"
    serve = parse(front_end)
    assert serve.command == "serve" and serve.cfg_model == prefill_worker.model
    assert serve.curve_keys_dir == str(KEYS_MOUNT)
    expected = {
        f"tcp://{hosts[role]}:{tcp_port(configs[role][0].client_address)}" for role in hosts
    }
    assert set(serve.engine_address) == expected


def test_compose_pd_runs_a_prefill_and_a_decode_engine_behind_one_front_end() -> None:
    services = yaml.safe_load((DEPLOY / "compose" / "compose.pd.yaml").read_text())["services"]
    roles = {"prefill": "prefill", "decode": "decode"}
    check_pair(
        {role: services[name]["command"] for role, name in roles.items()},
        services["api"]["command"],
        roles,
    )
    for name, service in services.items():
        assert f"./keys:{KEYS_MOUNT}:ro" in service["volumes"], name


def _deployment_argv(documents: list[dict], name: str) -> list[str]:
    (deployment,) = [
        doc for doc in documents if doc["kind"] == "Deployment" and doc["metadata"]["name"] == name
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return [*container["command"], *container["args"]]


def test_k8s_pd_runs_a_prefill_and_a_decode_engine_behind_one_front_end() -> None:
    path = DEPLOY / "k8s" / "pd" / "pd.yaml"
    documents = list(yaml.safe_load_all(Path(path).read_text()))
    names = {"prefill": "kvserve-prefill", "decode": "kvserve-decode"}
    check_pair(
        {role: _deployment_argv(documents, name) for role, name in names.items()},
        _deployment_argv(documents, "kvserve-api"),
        names,
    )
    services = {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == "Service"}
    for role, name in names.items():
        ports = {port["name"]: port["port"] for port in services[name]["spec"]["ports"]}
        engine, _ = launched(_deployment_argv(documents, name))
        assert ports["client"] == tcp_port(engine.client_address), role
        deployment_labels = next(
            doc["spec"]["template"]["metadata"]["labels"]
            for doc in documents
            if doc["kind"] == "Deployment" and doc["metadata"]["name"] == name
        )
        assert services[name]["spec"]["selector"].items() <= deployment_labels.items()
