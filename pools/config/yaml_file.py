"""The pool file: YAML (a path or the text itself) into a `pools.config.spec.CliffguardConfig`.

`load_config` reads and checks every key (`SpecError` naming the key path and the bad value), fills
the defaults (`memory: auto`, `api_keys_env`, paths beside the file), and applies isolation by
default (`default_isolation`: several local pools on a device and no `slo` anywhere). The schema, key
by key, is in `config/README.md`.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Annotated, Any

import msgspec

from engine.config import LatencySLO
from pools.config.checks import (SpecError, engine_rules, from_yaml, is_label, load_yaml, read_text, shown_at,
                                  within)
from pools.config.device_spec import DeviceSpec, ReplicaRange
from pools.config.gateway_spec import GatewaySpec
from pools.config.spec import CliffguardConfig, PoolSpec, SloSpec
from pools.tenants import parse_tenants


class ConfigFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The file's top level; each section is then read by its own model (a device, a pool, a tenant at a
    time, so that an error names it)."""

    gateway: dict[str, Any] | None = None
    devices: dict[str, Any] | None = None
    pools: Annotated[list[Any], msgspec.Meta(min_length=1)]
    tenants: dict[str, Any] | None = None


def _beside(base_dir: Path | None, spec: str, key: str) -> str:
    """A relative model/tokenizer path is looked up beside the YAML file first, then left as written
    (the working directory, or a hub id for an upstream tokenizer); `~/...` is the user's home, as a shell's.
    A name no file system can hold (a component past its limit) is a SpecError naming `key`; one that cannot
    be looked up there (no permission) is not there."""
    if spec.startswith("~"):
        return os.path.expanduser(spec)
    if base_dir is None or spec.startswith("builtin:") or PurePath(spec).is_absolute():
        return spec
    candidate = base_dir / spec
    try:
        found = candidate.exists()
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise SpecError(key, f"not a path this machine can open ({exc.strerror}), got {spec[:80]!r}"
                                 f"{'...' if len(spec) > 80 else ''}") from None
        found = False
    return os.path.normpath(candidate) if found else spec


def _without_nulls(raw: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """`raw` less the `keys` written as null: those sections then take their defaults."""
    return {k: v for k, v in raw.items() if v is not None or k not in keys}


def _parse_gateway(raw: dict[str, Any] | None, env: Mapping[str, str]) -> GatewaySpec:
    """The `gateway` section, its `api_keys` merged with those of the `api_keys_env` variable."""
    gateway = from_yaml(_without_nulls(raw or {}, ("api_keys", "allowed_hosts", "limits", "stored_responses",
                                                   "restart_backoff", "batches", "upstream")),
                        GatewaySpec, "gateway")
    keys = [k.strip() for k in gateway.api_keys]
    for i, key in enumerate(keys):
        if not key:   # dropped, it could leave no key: authentication silently off
            raise SpecError(f"gateway.api_keys[{i}]", f"an API key must not be blank, got {gateway.api_keys[i]!r}")
    if gateway.api_keys_env:
        value = env.get(gateway.api_keys_env, "")
        if value and not (found := [k.strip() for k in value.split(",") if k.strip()]):   # " " or ",": a secret
            raise SpecError("gateway.api_keys_env", f"the variable {gateway.api_keys_env} is set but names no API "
                            "key (blanks and commas only): authentication would be off")   # rendered empty
        keys += found if value else []
    return gateway.replace(api_keys=tuple(dict.fromkeys(k for k in keys if k)))


def _parse_device(name: str, raw: Any) -> DeviceSpec:
    """`devices.<name>`: `memory` and `cpu_threads` may be `auto` (None), `replicas` a number or a mapping
    `{min, max, ...}` (autoscaled: `replicas` is the max, the slots planned)."""
    key = f"devices.{name}"
    if not is_label(name):   # Ray's actors are named cliffguard:<device>:<slot>: "a:0" would read as device a's
        raise SpecError(f"devices: a device name uses letters, digits, '_', '.' and '-', starting with a letter or "
                        f"digit; got {name!r}")
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        return from_yaml(raw, DeviceSpec, key)
    raw = {k: v for k, v in raw.items() if k not in ("memory", "cpu_threads") or v not in ("auto", None)}
    derived: dict[str, Any] = {}
    if isinstance(raw.get("replicas"), dict):
        derived = from_yaml(raw.pop("replicas"), ReplicaRange, f"{key}.replicas").device_fields()
    return from_yaml(raw, DeviceSpec, key, name=name, **derived)


def _parse_pool(i: int, raw: Any, base_dir: Path | None) -> PoolSpec:
    """`pools[i]`: a local or (with an `upstream` key) an upstream pool, each refusing the other's keys;
    `slo` (a mapping, or null: opted out) sets `slo_source`, `death_spiral` may be true or false."""
    key = f"pools[{i}]"
    if not isinstance(raw, dict):
        return from_yaml(raw, PoolSpec, key)
    upstream = "upstream" in raw
    if upstream and raw["upstream"] is None:
        raise SpecError(f"{key}.upstream", "is empty: an upstream pool needs its server's URL (http://host:port/v1); "
                                           "remove the key for a pool on a local device")
    for name, value in raw.items():
        if upstream and name in PoolSpec.LOCAL_KEYS:
            raise SpecError(f"{key}.{name}", f"not allowed on an upstream pool (got {shown_at(value, name)}); an "
                                             "upstream pool has no local KV cache")
        if not upstream and name in PoolSpec.UPSTREAM_KEYS:
            raise SpecError(f"{key}.{name}", f"only for upstream pools (got {shown_at(value, name)}); "
                                             "set `upstream: http://host:port/v1` or remove it")
    raw = _without_nulls(raw, ("route", "death_spiral"))
    if isinstance(raw.get("death_spiral"), bool):
        raw["death_spiral"] = {"enabled": raw["death_spiral"]}
    if isinstance(raw.get("slo"), dict):
        slo = from_yaml(raw["slo"], SloSpec, f"{key}.slo")
        with within(key), engine_rules():
            raw["slo"] = LatencySLO(ttft_ms=slo.ttft_ms, itl_ms=slo.itl_ms)
    for name in ("tokenizer", "chat_template") if upstream else ("model", "chat_template"):
        if isinstance(raw.get(name), str):
            raw[name] = _beside(base_dir, raw[name], f"{key}.{name}")
    if upstream:
        return from_yaml(raw, PoolSpec, key)
    source = "yaml" if raw.get("slo") is not None else "opted_out" if "slo" in raw else "absent"
    return from_yaml(raw, PoolSpec, key, slo_source=source)


def parse_config(data: Any, *, env: Mapping[str, str] = os.environ,
                 base_dir: str | os.PathLike | None = None) -> CliffguardConfig:
    """The dict of a YAML file -> CliffguardConfig, or SpecError naming the key path and the bad value.

    `env`: where `gateway.api_keys_env` is looked up. `base_dir`: the YAML file's folder; relative model
    paths are looked up there first.
    """
    if data is None:
        raise SpecError("pools", "the configuration is empty; at least one pool is required")
    top = from_yaml(data, ConfigFile, "")
    base = Path(base_dir) if base_dir is not None else None
    gateway = _parse_gateway(top.gateway, env)
    tenants = parse_tenants(top.tenants)
    tenant_keys = tuple(k for t in tenants.values() for k in t.api_keys)
    if tenant_keys:   # a tenant's keys are accepted keys
        gateway = gateway.replace(api_keys=tuple(dict.fromkeys(gateway.api_keys + tenant_keys)))
    if gateway.metrics_auth and not gateway.api_keys:   # no key to ask for: /metrics would stay open, silently
        raise SpecError("gateway.metrics_auth", "asks /metrics for an API key, and no API key is configured "
                        f"(gateway.api_keys, the {gateway.api_keys_env or 'api_keys_env'} variable, the tenants')")
    devices = ({"default": DeviceSpec()} if top.devices is None
               else {name: _parse_device(name, body) for name, body in top.devices.items()})
    pools = default_isolation(tuple(_parse_pool(i, raw, base) for i, raw in enumerate(top.pools)))
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
    the comparison, and so does one that sets `min_share` (a throughput pool's key: the file says what it is).
    Only pools read from YAML (`slo_source` `absent`) are changed.
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
        if pools[shortest].slo_source == "absent" and pools[shortest].min_share is None:
            with within(f"pools[{shortest}]"):
                result[shortest] = pools[shortest].replace(slo=LatencySLO(), slo_source="default")
    return tuple(result)


def _route_upper(pool: PoolSpec) -> float:
    upper = pool.route.upper(pool.max_model_len)
    return math.inf if upper is None else upper


def _is_path(value: str | os.PathLike) -> bool:
    if not isinstance(value, str):
        return True
    if "\n" in value:
        return False
    return value.strip().endswith((".yaml", ".yml", ".json")) or ":" not in value or os.path.isfile(value)


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
    data = load_yaml(text, "<text>")
    if isinstance(data, str) and "\n" not in text.strip():   # one line, no `key:`: a path that is not there
        raise SpecError(f"{text.strip()}: no such configuration file")
    return parse_config(data, env=env)
