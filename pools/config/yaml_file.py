"""The pool file: YAML (a path or the text itself) into a `pools.config.spec.CliffguardConfig`.

`load_config` reads and checks every key (`SpecError` naming the key path and the bad value), fills
the defaults (`memory: auto`, `api_keys_env`, paths beside the file), and applies isolation by
default (`default_isolation`: several local pools on a device and no `slo` anywhere). The schema, key
by key, is in `config/README.md`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

from engine.config import ConfigError, LatencySLO
from pools.config.gateway_spec import DEFAULT_API_KEYS_ENV, Backoff, GatewaySpec, RequestLimits, RetentionSpec
from pools.config.spec import CliffguardConfig, DeviceSpec, PoolSpec, RouteSpec, parse_bytes
from pools.spiral import SpiralConfig
from pools.tenants import parse_tenants
from pools.config.checks import SpecError, check_mapping, check_str, load_yaml, read_text, show, within

# --- keys -----------------------------------------------------------------------------------------

_TOP_KEYS = ("gateway", "devices", "pools", "tenants")
_GATEWAY_KEYS = ("host", "port", "api_keys", "api_keys_env", "max_body_bytes", "restart_backoff", "write_timeout",
                 "stall_seconds", "step_timeout_seconds", "device_wait_seconds", "max_response_buffer_bytes",
                 "max_buffered_bytes", "metrics_auth", "limits", "stored_responses")
_LIMITS_KEYS = tuple(f.name for f in dataclasses.fields(RequestLimits))
_BACKOFF_KEYS = tuple(f.name for f in dataclasses.fields(Backoff))
_RETENTION_KEYS = tuple(f.name for f in dataclasses.fields(RetentionSpec))
_DEVICE_KEYS = ("device", "memory", "memory_utilization", "dtype", "tensor_parallel_size", "replicas", "gpus",
                "cpu_threads", "placement", "ray_address")
_REPLICAS_KEYS = ("min", "max", "scale_up_wait_seconds", "scale_down_idle_seconds")   # `replicas: {min, max}`
_ROUTE_KEYS = ("min_prompt_tokens", "max_prompt_tokens")
_COMMON_POOL_KEYS = ("name", "model", "route", "served_model_name", "max_model_len")
_LOCAL_POOL_KEYS = ("device", "kv_share", "kv_cache_bytes", "avg_len", "block_size", "max_num_batched_tokens",
                    "max_num_seqs", "preemption_mode", "victim_policy", "swap_space", "enable_prefix_caching",
                    "share_prefix_cache", "slo", "max_queue_seconds", "min_share", "death_spiral")
_SLO_KEYS = ("ttft_ms", "itl_ms")
_SPIRAL_KEYS = tuple(f.name for f in dataclasses.fields(SpiralConfig))   # the detector's own fields
_UPSTREAM_POOL_KEYS = ("upstream", "upstream_api_key_env", "tokenizer")
_BYTE_KEYS = {"kv_cache_bytes": "kv_cache_bytes", "swap_space": "swap_space_bytes"}


def _beside(base_dir: Path | None, spec: str) -> str:
    """A relative model/tokenizer path is looked up beside the YAML file first, then left as written
    (the working directory, or a hub id for an upstream tokenizer)."""
    if base_dir is None or spec.startswith("builtin:") or PurePath(spec).is_absolute() or spec.startswith("~"):
        return spec
    candidate = base_dir / spec
    return os.path.normpath(candidate) if candidate.exists() else spec


def _parse_gateway(raw: Any, env: Mapping[str, str]) -> GatewaySpec:
    raw = check_mapping("gateway", {} if raw is None else raw, _GATEWAY_KEYS)
    keys: list[str] = []
    api_keys = raw.get("api_keys", [])
    if api_keys is None:
        api_keys = []
    if not isinstance(api_keys, list):
        raise SpecError(f"gateway.api_keys: must be a list of strings, got {show(api_keys)}")
    for i, key in enumerate(api_keys):
        check_str(f"gateway.api_keys[{i}]", key)
        keys.append(key.strip())
    env_name = raw.get("api_keys_env", DEFAULT_API_KEYS_ENV)
    check_str("gateway.api_keys_env", env_name, optional=True)
    if env_name:
        keys += [k.strip() for k in env.get(env_name, "").split(",") if k.strip()]
    kwargs: dict[str, Any] = {k: raw[k] for k in ("host", "port", "write_timeout", "stall_seconds",
                                                  "step_timeout_seconds", "device_wait_seconds", "metrics_auth")
                              if k in raw}
    for key, spec_type, spec_keys in (("limits", RequestLimits, _LIMITS_KEYS),
                                      ("stored_responses", RetentionSpec, _RETENTION_KEYS)):
        if raw.get(key) is not None:
            section = check_mapping(f"gateway.{key}", raw[key], spec_keys)
            with within("gateway"):
                kwargs[key] = spec_type(**section)
    for key in ("max_body_bytes", "max_response_buffer_bytes", "max_buffered_bytes"):
        if key in raw:
            kwargs[key] = parse_bytes(raw[key], f"gateway.{key}")
    if raw.get("restart_backoff") is not None:
        backoff = check_mapping("gateway.restart_backoff", raw["restart_backoff"], _BACKOFF_KEYS)
        with within("gateway"):
            kwargs["restart_backoff"] = Backoff(**backoff)
    with within("gateway"):
        return GatewaySpec(api_keys=tuple(dict.fromkeys(keys)), api_keys_env=env_name, **kwargs)


def _parse_devices(raw: Any) -> dict[str, DeviceSpec]:
    if raw is None:
        return {"default": DeviceSpec()}
    if not isinstance(raw, dict):
        raise SpecError(f"devices: must be a mapping of device name to settings, got {show(raw)}")
    devices = {}
    for name, body in raw.items():
        key = f"devices.{name}"
        if not isinstance(name, str) or not name:
            raise SpecError(f"devices: device names must be non-empty strings, got {show(name)}")
        body = check_mapping(key, {} if body is None else body, _DEVICE_KEYS)
        kwargs = {k: v for k, v in body.items() if k not in ("memory", "gpus", "cpu_threads", "replicas")}
        if "replicas" in body:
            kwargs.update(_replicas_fields(key, body["replicas"]))
        if body.get("gpus") is not None:
            if not isinstance(body["gpus"], list):
                raise SpecError(f"{key}.gpus: must be a list of GPU indices, got {show(body['gpus'])}")
            kwargs["gpus"] = tuple(body["gpus"])
        if body.get("cpu_threads", "auto") != "auto":
            kwargs["cpu_threads"] = body["cpu_threads"]
        memory = body.get("memory", "auto")
        if memory not in ("auto", None):
            kwargs["memory_bytes"] = parse_bytes(memory, f"{key}.memory")
            if kwargs["memory_bytes"] == 0:
                raise SpecError(f"{key}.memory: must be > 0 bytes (or auto), got {memory!r}")
        with within(key):
            devices[name] = DeviceSpec(name=name, **kwargs)
    return devices


def _replicas_fields(key: str, raw: Any) -> dict[str, Any]:
    """`replicas: N` (fixed) or `replicas: {min, max, scale_up_wait_seconds, scale_down_idle_seconds}`
    (autoscaled) -> DeviceSpec fields: `replicas` is the max, the slots planned; DeviceSpec checks the values."""
    if not isinstance(raw, dict):
        return {"replicas": raw}
    check_mapping(f"{key}.replicas", raw, _REPLICAS_KEYS)
    for bound in ("min", "max"):
        if raw.get(bound) is None:
            raise SpecError(f"{key}.replicas.{bound}: required in the mapping form (e.g. `replicas: {{min: 1, "
                            f"max: 4}}`), got nothing")
    timings = {k: raw[k] for k in _REPLICAS_KEYS[2:] if k in raw}
    return {"replicas": raw["max"], "min_replicas": raw["min"], **timings}


def _parse_pool(i: int, raw: Any, base_dir: Path | None) -> PoolSpec:
    key = f"pools[{i}]"
    all_keys = _COMMON_POOL_KEYS + _UPSTREAM_POOL_KEYS + _LOCAL_POOL_KEYS
    raw = check_mapping(key, raw, all_keys)
    is_upstream = "upstream" in raw
    for name, value in raw.items():
        if is_upstream and name in _LOCAL_POOL_KEYS:
            raise SpecError(f"{key}.{name}: not allowed on an upstream pool (got {value!r}); an upstream pool "
                            f"takes only: {', '.join(_COMMON_POOL_KEYS + _UPSTREAM_POOL_KEYS)}")
        if not is_upstream and name in _UPSTREAM_POOL_KEYS:
            raise SpecError(f"{key}.{name}: only for upstream pools (got {value!r}); "
                            "set `upstream: http://host:port/v1` or remove it")
    for required in ("name", "model"):
        if raw.get(required) is None:
            raise SpecError(f"{key}.{required}: required, got nothing")
    kwargs = {k: v for k, v in raw.items() if k not in _BYTE_KEYS and k not in ("route", "slo", "death_spiral")}
    if raw.get("slo") is not None:
        slo = check_mapping(f"{key}.slo", raw["slo"], _SLO_KEYS)
        try:
            kwargs["slo"] = LatencySLO(**slo)
        except ConfigError as exc:
            raise SpecError(f"{key}.{exc}") from None
    if not is_upstream:   # `slo: null` (opted out of the default) differs from no `slo` key
        kwargs["slo_source"] = "yaml" if "slo" in kwargs else "opted_out" if "slo" in raw else "absent"
    if raw.get("death_spiral") is not None:
        kwargs["death_spiral"] = _parse_spiral(f"{key}.death_spiral", raw["death_spiral"])
    for yaml_key, field_name in _BYTE_KEYS.items():
        if yaml_key in raw:
            kwargs[field_name] = parse_bytes(raw[yaml_key], f"{key}.{yaml_key}")
    route = check_mapping(f"{key}.route", {} if raw.get("route") is None else raw["route"], _ROUTE_KEYS)
    with within(f"{key}.route"):
        kwargs["route"] = RouteSpec(**route)
    if not is_upstream and isinstance(kwargs.get("model"), str):
        kwargs["model"] = _beside(base_dir, kwargs["model"])
    if isinstance(kwargs.get("tokenizer"), str):
        kwargs["tokenizer"] = _beside(base_dir, kwargs["tokenizer"])
    with within(key):
        return PoolSpec(**kwargs)


def _parse_spiral(key: str, raw: Any) -> SpiralConfig:
    """`death_spiral`: a mapping of thresholds, or `false` (detection off) / `true` (the defaults)."""
    if isinstance(raw, bool):
        return SpiralConfig(enabled=raw)
    if not isinstance(raw, dict):
        raise SpecError(f"{key}: must be a mapping ({', '.join(_SPIRAL_KEYS)}) or false, got {show(raw)}")
    check_mapping(key, raw, _SPIRAL_KEYS)
    try:
        return SpiralConfig(**raw)
    except ValueError as exc:   # its message starts with `death_spiral.<field>`
        raise SpecError(f"{key.rpartition('.')[0]}.{exc}") from None


def parse_config(data: Any, *, env: Mapping[str, str] = os.environ,
                 base_dir: str | os.PathLike | None = None) -> CliffguardConfig:
    """The dict of a YAML file -> CliffguardConfig, or SpecError naming the key path and the bad value.

    `env`: where `gateway.api_keys_env` is looked up. `base_dir`: the YAML file's folder; relative model
    paths are looked up there first.
    """
    if data is None:
        raise SpecError("pools: the configuration is empty; at least one pool is required")
    if not isinstance(data, dict):
        raise SpecError(f"(top level): must be a mapping with keys {', '.join(_TOP_KEYS)}, got {show(data)}")
    check_mapping("", data, _TOP_KEYS)
    base = Path(base_dir) if base_dir is not None else None
    pools_raw = data.get("pools")
    if pools_raw is None:
        raise SpecError("pools: missing; at least one pool is required")
    if not isinstance(pools_raw, list):
        raise SpecError(f"pools: must be a list of pools, got {show(pools_raw)}")
    if not pools_raw:
        raise SpecError("pools: at least one pool is required, got []")
    gateway = _parse_gateway(data.get("gateway"), env)
    tenants = parse_tenants(data.get("tenants"))
    tenant_keys = tuple(k for t in tenants.values() for k in t.api_keys)
    if tenant_keys:   # a tenant's keys are accepted keys
        gateway = dataclasses.replace(gateway, api_keys=tuple(dict.fromkeys(gateway.api_keys + tenant_keys)))
    devices = _parse_devices(data.get("devices"))
    pools = default_isolation(tuple(_parse_pool(i, raw, base) for i, raw in enumerate(pools_raw)))
    return CliffguardConfig(gateway=gateway, devices=devices, pools=pools, tenants=tenants)


def default_isolation(pools: tuple[PoolSpec, ...]) -> tuple[PoolSpec, ...]:
    """Isolation by default: `pools` with, on each device that has two or more local pools and where
    none has an `slo`, the pool of the strictly shortest route made interactive with `LatencySLO()`.

    Two pools on one device without an SLO get no compute isolation: rag's prefill chunks fill every
    step and multiply chat's inter-token latency. The pool the user routes the shortest prompts to is
    the one a person waits on, so it gets the default targets. "Shortest" is the smallest
    `route.upper(max_model_len)` (unbounded counts as infinite), strictly below every other pool's on
    the device; a tie defaults nothing, since there is no telling which pool is the chat pool. A pool
    whose YAML says `slo: null` (`slo_source` `opted_out`) is never defaulted but still counts in
    the comparison. Only pools read from YAML (`slo_source` `absent`) are changed.
    """
    by_device: dict[str, list[int]] = {}
    for i, pool in enumerate(pools):
        if not pool.is_upstream:
            by_device.setdefault(pool.device, []).append(i)
    result = list(pools)
    for members in by_device.values():
        if len(members) < 2 or any(pools[i].slo is not None for i in members):
            continue
        uppers = {i: _route_upper(pools[i]) for i in members}
        shortest = min(members, key=uppers.__getitem__)
        if any(uppers[i] <= uppers[shortest] for i in members if i != shortest):
            continue
        if pools[shortest].slo_source == "absent":
            with within(f"pools[{shortest}]"):
                result[shortest] = dataclasses.replace(pools[shortest], slo=LatencySLO(), slo_source="default")
    return tuple(result)


def _route_upper(pool: PoolSpec) -> float:
    upper = pool.route.upper(pool.max_model_len)
    return math.inf if upper is None else upper


def _is_path(value: str | os.PathLike) -> bool:
    if not isinstance(value, str):
        return True
    if "\n" in value:
        return False
    return value.strip().endswith((".yaml", ".yml", ".json")) or ":" not in value or Path(value).is_file()


def load_config(path_or_text: str | os.PathLike, *, env: Mapping[str, str] = os.environ) -> CliffguardConfig:
    """A YAML file (a path) or YAML text (a string with a newline, or one line holding a `key:`) ->
    CliffguardConfig. Every problem is a SpecError: the key path and the bad value, the line and column
    of a YAML syntax error, or the path of a missing file. Errors in a file end with `(in <path>)`."""
    if _is_path(path_or_text):
        path = Path(path_or_text).expanduser()
        text = read_text(path)
        data = load_yaml(text, str(path))
        try:
            return parse_config(data, env=env, base_dir=path.parent)
        except SpecError as exc:
            raise SpecError(f"{exc} (in {path})") from None
    text = str(path_or_text)
    return parse_config(load_yaml(text, "<text>"), env=env)
