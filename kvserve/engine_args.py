"""The engine and worker configs an `LLM(...)` call describes, built as `kvserve launch` builds
them from its flags: the same typed configs, the same bounds, the same model checks. Keyword
overrides are config field names (vLLM's, where the concept is the same). No processes here.
"""

from pathlib import Path

import msgspec

from deploy.commands import LAUNCH_WORKER_FIELDS, check_kv_budget, check_model_name
from protocol.config import CacheConfig, EngineConfig, SchedulerConfig, WorkerConfig

# Engine fields that are not simple values, or that the LLM sets itself
ENGINE_FIELDS_SET_HERE = {"tp_size", "client_address", "worker_address", "cache", "scheduler"}
ENGINE_FIELDS_NOT_OFFERED = {"kv_events", "curve", "allow_insecure"}
WORKER_FIELDS_SET_HERE = {"model", "dtype", "seed"}


def _section_of(name: str) -> str:
    """Which config a keyword override sets: cache, scheduler, engine or worker."""
    if name in CacheConfig.__struct_fields__:
        return "cache"
    if name in SchedulerConfig.__struct_fields__:
        return "scheduler"
    not_engine = ENGINE_FIELDS_SET_HERE | ENGINE_FIELDS_NOT_OFFERED
    if name in EngineConfig.__struct_fields__ and name not in not_engine:
        return "engine"
    if name in LAUNCH_WORKER_FIELDS and name not in WORKER_FIELDS_SET_HERE:
        return "worker"
    offered = sorted(
        {*CacheConfig.__struct_fields__, *SchedulerConfig.__struct_fields__}
        | (set(EngineConfig.__struct_fields__) - not_engine)
        | (set(LAUNCH_WORKER_FIELDS) - WORKER_FIELDS_SET_HERE)
    )
    raise TypeError(f"LLM got an unknown keyword argument {name!r}: expected one of {offered}")


def offline_configs(
    model: str,
    tp_size: int,
    dtype: str,
    max_model_len: int | None,
    seed: int,
    ipc_folder: Path,
    overrides: dict[str, object],
) -> tuple[EngineConfig, WorkerConfig]:
    """The engine's config (its sockets under `ipc_folder`) and the base worker config; a
    ValueError naming the value when a bound or the model check refuses it."""
    engine: dict = {
        "tp_size": tp_size,
        "client_address": f"ipc://{ipc_folder}/client.sock",
        "worker_address": f"ipc://{ipc_folder}/worker.sock",
        "cache": {},
        "scheduler": {"max_model_len": max_model_len},
    }
    worker: dict = {"model": model, "dtype": dtype, "seed": seed}
    for name, value in overrides.items():
        match _section_of(name):
            case "cache" | "scheduler" as section:
                engine[section][name] = value
            case "engine":
                engine[name] = value
            case "worker":
                worker[name] = value
    try:
        engine_config = msgspec.convert(engine, EngineConfig)
        base_worker = msgspec.convert(worker, WorkerConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"LLM arguments: {exc}") from None
    check_model_name(base_worker, tp_size)
    check_kv_budget(engine_config, base_worker)
    return engine_config, base_worker
