"""pools.config.spec: the YAML schema, its validation errors (key path + bad value), routes and model names."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from engine.config import LatencySLO
from pools.config.yaml_file import load_config, parse_config
from pools.config.spec import DEFAULT_CPU_MEMORY, DeviceSpec, PoolSpec, RouteSpec, SpecError, parse_bytes
from pools.spiral import SpiralConfig

REPO = Path(__file__).resolve().parents[2]
DEFAULT_YAML = REPO / "config" / "pools.yaml"

BASE = {
    "gateway": {"host": "127.0.0.1", "port": 8000},
    "devices": {"default": {"device": "auto", "memory": "auto"}},
    "pools": [
        {"name": "chat", "model": "builtin:smollm2-135m-instruct",
         "route": {"min_prompt_tokens": 0, "max_prompt_tokens": 4096}, "kv_share": 0.4, "avg_len": 1024},
        {"name": "rag", "model": "builtin:smollm2-135m-instruct",
         "route": {"min_prompt_tokens": 4097}, "kv_share": 0.6, "avg_len": 6144},
        {"name": "remote", "upstream": "http://10.0.0.2:8000/v1", "model": "meta-llama/Llama-3-8B-Instruct",
         "route": {"min_prompt_tokens": 0}},
    ],
}


def _make_yaml(edit=None) -> str:
    data = copy.deepcopy(BASE)
    if edit:
        edit(data)
    return yaml.safe_dump(data, sort_keys=False)


def _set(path: str, value):
    """An edit that sets data[a][b]... (ints index lists) to value."""
    def edit(data):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        for p in parents:
            data = data[p]
        data[last] = value
    return edit


def _pop(path: str):
    def edit(data):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        for p in parents:
            data = data[p]
        del data[last]
    return edit


def _both(*edits):
    def edit(data):
        for e in edits:
            e(data)
    return edit


BAD = {
    "syntax error": ("pools:\n  - name: chat\n    kv_share: [0.4\n    model: x\n", ["line", "column"]),
    "duplicate YAML key": ("pools:\n  - name: chat\n    name: rag\n", ["line 3", "duplicate key 'name'"]),
    "YAML 1.1 octal": ("pools:\n  - name: chat\n    avg_len: 010\n", ["line 3", "reads as YAML 1.1's octal number"]),
    "YAML 1.1 base 60": ("pools:\n  - name: chat\n    avg_len: 1:30\n", ["line 3", "base 60 number"]),
    "YAML 1.1 base 60 float": ("pools:\n  - name: chat\n    kv_share: 0:0.5\n", ["line 3", "base 60 number"]),
    "an explicit int of nothing": ("gateway: {port: !!int ''}\n", ["line 1", "not an integer"]),
    "a hex int without digits": ("gateway:\n  port: 0x_\n", ["line 2", "not an integer"]),
    "a control character": ("pools: []\n# note \x1b[0m\n", ["line 2", "#x001b", "control character"]),
    "unknown top-level key": (_set("pool", []), ["pool: unknown key", "allowed keys: gateway, devices, pools"]),
    "unknown pool key": (_set("pools/0/kv_shar", 0.3), ["pools[0].kv_shar: unknown key", "0.3", "kv_share"]),
    "unknown device key": (_set("devices/default/vram", "80GiB"), ["devices.default.vram", "80GiB"]),
    "unknown route key": (_set("pools/0/route/max_tokens", 9), ["pools[0].route.max_tokens", "9"]),
    "string for int": (_set("pools/0/avg_len", "1024"), ["pools[0].avg_len", "got string '1024'"]),
    "bool for int": (_set("pools/0/block_size", True), ["pools[0].block_size", "got boolean True"]),
    "bool for fraction": (_set("pools/0/kv_share", True), ["pools[0].kv_share", "got boolean True"]),
    "kv_share out of range": (_set("pools/1/kv_share", 1.5), ["pools[1].kv_share", "<= 1.0", "1.5"]),
    "kv_share zero": (_set("pools/1/kv_share", 0), ["pools[1].kv_share", "got 0"]),
    "share sum above 1": (_set("pools/0/kv_share", 0.5), ["pools[1].kv_share", "1.1", "chat 0.5", "rag 0.6"]),
    "duplicate pool names": (_set("pools/1/name", "chat"), ["pools[1].name", "'chat'", "pools[0]"]),
    "overlapping routes": (_set("pools/1/route/min_prompt_tokens", 4000),
                           ["pools[1].route", "4000..", "0..4096", "'chat'", "'rag'", "smollm2-135m-instruct"]),
    "route min above max": (_set("pools/0/route/min_prompt_tokens", 5000),
                            ["pools[0].route.min_prompt_tokens", "5000", "4096"]),
    "negative route min": (_set("pools/0/route/min_prompt_tokens", -1), ["pools[0].route.min_prompt_tokens", "-1"]),
    "unknown device": (_set("pools/0/device", "gpu9"), ["pools[0].device", "'gpu9'", "default"]),
    "unknown preemption_mode": (_set("pools/0/preemption_mode", "evict"), ["pools[0].preemption_mode", "'evict'"]),
    "unknown victim_policy": (_set("pools/0/victim_policy", "random"), ["pools[0].victim_policy", "'random'"]),
    "swap without swap space": (_set("pools/0/preemption_mode", "swap"), ["pools[0].swap_space", "0"]),
    "auto without swap space": (_set("pools/0/preemption_mode", "auto"), ["pools[0].swap_space", "'auto' needs"]),
    "another unknown victim_policy": (_set("pools/0/victim_policy", "oldest"), ["pools[0].victim_policy", "'oldest'"]),
    "bad byte size": (_set("devices/default/memory", "80 gigs"), ["devices.default.memory", "80 gigs"]),
    "negative byte size": (_set("pools/0/swap_space", -5), ["pools[0].swap_space", "-5"]),
    "upstream with kv_share": (_set("pools/2/kv_share", 0.2), ["pools[2].kv_share", "0.2", "upstream"]),
    "upstream with block_size": (_set("pools/2/block_size", 16), ["pools[2].block_size", "16"]),
    "local with upstream key": (_set("pools/0/upstream_api_key_env", "sk-live-1"),   # the key pasted: not shown
                                ["pools[0].upstream_api_key_env", "only for upstream pools (got string of 9)"]),
    "bad upstream URL": (_set("pools/2/upstream", "ftp://10.0.0.2/v1"), ["pools[2].upstream", "ftp://10.0.0.2/v1"]),
    "upstream URL without host": (_set("pools/2/upstream", "http:///v1"), ["pools[2].upstream", "http:///v1"]),
    "different models on one device": (_set("pools/1/model", "/models/other"),
                                       ["pools[1].model", "'/models/other'", "'chat'", "device 'default'"]),
    "different block sizes on one device": (_set("pools/1/block_size", 32), ["pools[1].block_size", "32", "16"]),
    "block_size not 8/16/32": (_set("pools/0/block_size", 64), ["pools[0].block_size", "64"]),
    "both kv_share and kv_cache_bytes": (_set("pools/0/kv_cache_bytes", "1GiB"),
                                         ["pools[0].kv_share", "0.4", "1073741824"]),
    "neither kv_share nor kv_cache_bytes": (_pop("pools/0/kv_share"), ["pools[0].kv_share", "neither"]),
    "port out of range": (_set("gateway/port", 70000), ["gateway.port", "70000"]),
    "memory_utilization zero": (_set("devices/default/memory_utilization", 0),
                                ["devices.default.memory_utilization", "got 0"]),
    "tensor_parallel_size zero": (_set("devices/default/tensor_parallel_size", 0),
                                  ["devices.default.tensor_parallel_size", "0"]),
    "replicas zero": (_set("devices/default/replicas", 0), ["devices.default.replicas: must be >= 1, got 0"]),
    "replicas string": (_set("devices/default/replicas", "two"), ["devices.default.replicas", "'two'"]),
    "gpus on a cpu device": (_set("devices/default", {"device": "cpu", "gpus": [0]}),
                             ["devices.default.gpus", "'cpu'", "device: cuda"]),
    "collective timeout past a day": (_set("devices/default/collective_timeout_seconds", 1.0e+14),
                                      ["devices.default.collective_timeout_seconds: must be at most 86400 s"]),
    "an empty upstream": ("pools:\n  - name: remote\n    upstream:\n    model: m\n",
                          ["pools[0].upstream: is empty: an upstream pool needs its server's URL"]),
    "gpus with cuda:N": (_set("devices/default", {"device": "cuda:3", "gpus": [0]}),
                         ["devices.default.gpus", "device is 'cuda:3'", "set device: cuda"]),
    "a GPU listed twice": (_set("devices/default", {"device": "cuda", "replicas": 2, "gpus": [0, 0]}),
                           ["devices.default.gpus[1]: GPU 0 is listed twice (also gpus[0])"]),
    "gpus not a list": (_set("devices/default", {"device": "cuda", "gpus": 0}), ["devices.default.gpus", "got integer 0"]),
    "gpus fewer than ranks": (_set("devices/default", {"device": "cuda", "replicas": 2, "tensor_parallel_size": 2,
                                                       "gpus": [0, 1, 2]}),
                              ["devices.default.gpus: 3 GPUs listed", "replicas 2 x tensor_parallel_size 2 need 4"]),
    "negative gpu": (_set("devices/default", {"device": "cuda", "gpus": [-1]}), ["devices.default.gpus[0]", ">= 0"]),
    "cpu_threads zero": (_set("devices/default/cpu_threads", 0), ["devices.default.cpu_threads: must be >= 1"]),
    "bad device": (_set("devices/default/device", "tpu"), ["devices.default.device", "'tpu'"]),
    "bad dtype": (_set("devices/default/dtype", "int8"), ["devices.default.dtype", "'int8'"]),
    "avg_len zero": (_set("pools/0/avg_len", 0), ["pools[0].avg_len", "got 0"]),
    "max_num_batched_tokens zero": (_set("pools/0/max_num_batched_tokens", 0),
                                    ["pools[0].max_num_batched_tokens", "0"]),
    "empty pool list": (_set("pools", []), ["pools", "[]"]),
    "pools not a list": (_set("pools", {"name": "chat"}), ["pools", "got object"]),
    "missing model": (_pop("pools/0/model"), ["pools[0].model", "required"]),
    "api_keys not a list": (_set("gateway/api_keys", "secret"), ["gateway.api_keys", "string of 6"]),
    "bad pool name": (_set("pools/0/name", "chat pool"), ["pools[0].name", "'chat pool'"]),
    "min_share of 1": (_set("pools/1/min_share", 1), ["pools[1].min_share", "<= 0.9", "got 1"]),
    # the derived SLO grows as 1 / (1 - min_share): at 0.9999 it passed an hour and the device failed to start
    "min_share near 1": (_set("pools/1/min_share", 0.9999), ["pools[1].min_share", "<= 0.9", "got 0.9999"]),
    "upstream key env a key (its value not shown)": (_set("pools/2/upstream_api_key_env", "sk-live-1"),
                                                     ["pools[2].upstream_api_key_env: the name of an environment "
                                                      "variable", "a string of 9 characters"]),
    "cuda:N with placement ray (N dropped)": (_set("devices/default", {"device": "cuda:3", "placement": "ray"}),
                                              ["devices.default.device", "write cuda", "'cuda:3'"]),
    "a device name Ray's actor names could not tell apart": (
        lambda d: d["devices"].update({"a:0": {"device": "cpu"}}), ["devices: a device name", "'a:0'"]),
    "min_share string": (_set("pools/1/min_share", "20%"), ["pools[1].min_share", "'20%'"]),
    "min_share on an interactive pool": (lambda d: d["pools"][0].update(min_share=0.3, slo={"ttft_ms": 500}),
                                         ["pools[0].min_share: only for throughput pools", "slo"]),
    "slo not a mapping": (_set("pools/0/slo", 100), ["pools[0].slo", "100"]),
    "unknown slo key": (_set("pools/0/slo", {"p99_ms": 5}), ["pools[0].slo.p99_ms", "ttft_ms, itl_ms"]),
    "slo itl zero": (_set("pools/0/slo", {"ttft_ms": 500, "itl_ms": 0}), ["pools[0].slo.itl_ms", "got 0"]),
    "slo string": (_set("pools/0/slo", {"ttft_ms": "1s"}), ["pools[0].slo.ttft_ms", "'1s'"]),
    "slo on upstream": (_set("pools/2/slo", {"ttft_ms": 500}), ["pools[2].slo", "upstream"]),
    "death_spiral not a mapping": (_set("pools/0/death_spiral", 30), ["pools[0].death_spiral", "got integer 30"]),
    "unknown death_spiral key": (_set("pools/0/death_spiral", {"window": 30}),
                                 ["pools[0].death_spiral.window", "30", "window_seconds"]),
    "death_spiral window zero": (_set("pools/0/death_spiral", {"window_seconds": 0}),
                                 ["pools[0].death_spiral.window_seconds: must be > 0.0, got 0"]),
    # a quarter of it rounded to 0 (5e-324): a ZeroDivisionError on every tick, the pools after it never fed
    "death_spiral window under four stats periods": (_set("pools/0/death_spiral", {"window_seconds": 5.0e-324}),
                                                     ["pools[0].death_spiral.window_seconds: must be at least 1 s"]),
    "death_spiral rate string": (_set("pools/0/death_spiral", {"min_preemptions_per_s": "1/s"}),
                                 ["pools[0].death_spiral.min_preemptions_per_s", "'1/s'"]),
    "death_spiral negative tolerance": (_set("pools/1/death_spiral", {"tokens_tolerance": -0.5}),
                                        ["pools[1].death_spiral.tokens_tolerance", ">= 0", "-0.5"]),
    "death_spiral enabled string": (_set("pools/0/death_spiral", {"enabled": "off"}),
                                    ["pools[0].death_spiral.enabled", "'off'"]),
    "death_spiral on upstream": (_set("pools/2/death_spiral", False), ["pools[2].death_spiral", "upstream"]),
    "write_timeout zero": (_set("gateway/write_timeout", 0), ["gateway.write_timeout", "> 0", "got 0"]),
    "stall_seconds string": (_set("gateway/stall_seconds", "10s"), ["gateway.stall_seconds", "'10s'"]),
    "metrics_auth string": (_set("gateway/metrics_auth", "yes"), ["gateway.metrics_auth", "'yes'"]),
    "unknown limits key": (_set("gateway/limits", {"max_prompt": 5}), ["gateway.limits.max_prompt", "max_prompts"]),
    "limits max_prompts zero": (_set("gateway/limits", {"max_prompts": 0}),
                                ["gateway.limits.max_prompts", ">= 1", "got 0"]),
    "upstream max_connections zero": (_set("gateway/upstream", {"max_connections": 0}),
                                      ["gateway.upstream.max_connections", ">= 1", "got 0"]),
    "upstream read timeout string": (_set("gateway/upstream", {"read_timeout_seconds": "10m"}),
                                     ["gateway.upstream.read_timeout_seconds", "'10m'"]),
    "share_prefix_cache string": (_set("pools/0/share_prefix_cache", "no"), ["pools[0].share_prefix_cache", "'no'"]),
    "chat_template_kwargs sets messages": (_set("pools/1/chat_template_kwargs", {"enable_thinking": False,
                                                                               "messages": []}),
                                           ["pools[1].chat_template_kwargs.messages: is set by the gateway"]),
    "chat_template_kwargs sets add_generation_prompt": (
        _set("pools/0/chat_template_kwargs", {"add_generation_prompt": False}),
        ["pools[0].chat_template_kwargs.add_generation_prompt", "may not set messages, tools, documents"]),
    "chat_template_kwargs sets continue_final_message": (   # a request's field: every chat request failed
        _set("pools/0/chat_template_kwargs", {"continue_final_message": True}),
        ["pools[0].chat_template_kwargs.continue_final_message", "a chat request's field of that name"]),
    "chat_template_kwargs enable_thinking a string": (
        _set("pools/0/chat_template_kwargs", {"enable_thinking": "false"}),
        ["pools[0].chat_template_kwargs.enable_thinking: must be true or false", "got 'false'"]),
    "chat_template_kwargs not a mapping": (_set("pools/0/chat_template_kwargs", ["enable_thinking"]),
                                           ["pools[0].chat_template_kwargs", "expected an object"]),
    "chat_template_kwargs non-string key": (_set("pools/0/chat_template_kwargs", {1: True}),
                                            ["pools[0].chat_template_kwargs"]),
    "chat_template_kwargs on upstream": (_set("pools/2/chat_template_kwargs", {"enable_thinking": False}),
                                         ["pools[2].chat_template_kwargs", "upstream"]),
    "replicas past the cap (a loop over them hung)": (_set("devices/default/replicas", 10**12),
                                                      ["devices.default.replicas", "<= 1024"]),
    "autoscaled max past the cap": (_set("devices/default/replicas", {"min": 1, "max": 10**12}),
                                    ["devices.default.replicas.max", "<= 1024"]),
    "tensor_parallel_size past the cap": (_set("devices/default/tensor_parallel_size", 10**9),
                                          ["devices.default.tensor_parallel_size", "<= 1024"]),
    "memory past 64 bits (a float overflow later)": (_set("devices/default/memory", 10**400),
                                                     ["devices.default.memory", "at most 9223372036854775807 bytes"]),
    "memory with a unit past 64 bits": (_set("devices/default/memory", "1" + "0" * 400 + "GiB"),
                                        ["devices.default.memory", "at most"]),
    "kv_cache_bytes past 64 bits": (_both(_pop("pools/0/kv_share"), _set("pools/0/kv_cache_bytes", 2**64)),
                                    ["pools[0].kv_cache_bytes", "at most"]),
    "max_num_seqs past 64 bits, its digits cut": (_set("pools/0/max_num_seqs", 10**400),
                                                  ["pools[0].max_num_seqs: must be <= 9223372036854775807", "..."]),
    "route bound past 64 bits (every other count is held to them)": (
        _set("pools/0/route/max_prompt_tokens", 10**30),
        ["pools[0].route.max_prompt_tokens: must be <= 9223372036854775807"]),
    "upstream port out of range (a 500 on every request)": (_set("pools/2/upstream", "http://127.0.0.1:99999/v1"),
                                                            ["pools[2].upstream: not a valid URL", "Port out of range"]),
    "upstream port not a number": (_set("pools/2/upstream", "http://h:abc/v1"), ["pools[2].upstream: not a valid URL"]),
    "upstream malformed IPv6 host": (_set("pools/2/upstream", "http://[::1/v1"),
                                     ["pools[2].upstream: not a valid URL", "IPv6"]),
    "upstream URL with a query (the path would follow it)": (
        _set("pools/2/upstream", "http://h:8000/v1?api-version=2024-10-21"),
        ["pools[2].upstream: must have no query (?) or fragment (#)", "'http://h:8000/v1?<22 characters>'"]),
    "upstream URL with a key in it (never shown: errors go to logs)": (
        _set("pools/2/upstream", "https://u:sk-live-1@h:99999/v1?key=sk-live-1"),
        ["pools[2].upstream: not a valid URL", "'https://h:99999/v1?<13 characters>'"]),
    "upstream URL with an empty query": (_set("pools/2/upstream", "http://h/v1?"), ["pools[2].upstream", "query"]),
    "upstream URL with a fragment": (_set("pools/2/upstream", "http://h/v1#x"), ["pools[2].upstream", "fragment"]),
    "a blank API key (authentication silently off)": (_set("gateway/api_keys", ["  "]),
                                                       ["gateway.api_keys[0]: an API key must not be blank"]),
    "a tenant's blank API key": (_set("tenants", {"team": {"api_keys": [" "]}}),
                                 ["tenants.team.api_keys[0]: an API key must not be blank"]),
    "cpu_threads on a CUDA device (dropped)": (_set("devices/default", {"device": "cuda", "cpu_threads": 4}),
                                               ["devices.default.cpu_threads: only for a CPU device"]),
    "routes overlapping within max_model_len": (
        _both(_set("pools/0/route", {"min_prompt_tokens": 0}), _set("pools/0/max_model_len", 4098)),
        ["pools[1].route: 4097.. overlaps pools[0] 'chat' route 0..4097"]),
    "an alias bomb (a 627-byte file walked for ever)": (
        "\n".join(["a0: &a0 [x]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]),
        ["<text>: YAML aliases expand to more than 100,000 values"]),
    "an exponent without a dot (YAML 1.1 reads it as text)": (_set("pools/0/kv_share", "1e-1"),
        ["pools[0].kv_share: expected a number, got string '1e-1'", "write 1.0e-1"]),
    "a recursive alias at the top": ("&a [*a]\n", ["<text>: a YAML alias at line 1 names a value that contains it"]),
    "nesting past the recursion limit": ("pools: " + "[" * 3000 + "]" * 3000 + "\n", ["<text>: YAML nested too deep"]),
    "a path that is not there, with a colon": ("http://host/pools", ["http://host/pools: no such configuration file"]),
    "a pool name with a final newline (it broke every response's x-cliffguard-pool header)": (
        _set("pools/0/name", "chat\n"), ["pools[0].name: use letters, digits", r"'chat\n'"]),
    "a tenant name with a final newline (a metric label)": (
        _set("tenants", {"team\n": {"api_keys": ["sk-1"]}}), ["a tenant name uses letters, digits", r"'team\n'"]),
    "a blank served_model_name": (_set("pools/1/served_model_name", "  "),
                                  ["pools[1].served_model_name: the model name clients send: not blank", "'  '"]),
    "a served_model_name with a control character": (_set("pools/1/served_model_name", "long\t"),
                                                     ["pools[1].served_model_name", "no control characters",
                                                      r"'long\t'"]),
    "a device name with a final newline": (
        _set("devices/default/device", "cuda:0\n"), ["devices.default.device: must be auto, cpu, cuda or cuda:N",
                                                      r"'cuda:0\n'"]),
    "an upstream route no prompt can reach (min_prompt_tokens at max_model_len)": (
        _both(_set("pools/2/max_model_len", 4096), _set("pools/2/route/min_prompt_tokens", 4096)),
        ["pools[2].route.min_prompt_tokens: 4096 must be below max_model_len 4096; no prompt can reach this pool"]),
    "restart_backoff factor past 100 (its OverflowError ended the supervisor)": (
        _set("gateway/restart_backoff", {"factor": 100000}), ["gateway.restart_backoff.factor: must be <= 100"]),
    "stall_seconds under four heartbeats (the watchdog killed healthy workers)": (
        _set("gateway/stall_seconds", 0.01),
        ["gateway.stall_seconds: must be at least 2 s", "one every 0.5 s", "got 0.01"]),
    "step_timeout_seconds under four heartbeats": (_set("gateway/step_timeout_seconds", 1e-9),
                                                   ["gateway.step_timeout_seconds: must be at least 2 s", "1e-09"]),
    "write_timeout of a nanosecond (every client cut off)": (
        _set("gateway/write_timeout", 1e-9), ["gateway.write_timeout: must be at least 0.5 s", "1e-09"]),
    "swap_space of 8 EiB (the worker's swap block list filled its memory)": (
        _both(_set("pools/0/preemption_mode", "swap"), _set("pools/0/swap_space", 2**63 - 1)),
        ["pools[0].swap_space: must be at most 1125899906842624 bytes (1 PiB", "got 9223372036854775807"]),
    "an slo of an hour or more (its error said only > 0)": (_set("pools/0/slo", {"ttft_ms": 3_600_000}),
                                                             ["pools[0].slo.ttft_ms: must be a number of milliseconds "
                                                              "> 0 and < 3600000 (an hour), got 3600000"]),
}


@pytest.mark.parametrize("value, key", [({"team": {"api_key": ["sk-live-1"]}}, "tenants.team.api_key"),
                                        ({"team": ["sk-live-1"]}, "tenants.team"),
                                        ({"team": {"api_keys": "sk-live-1"}}, "tenants.team.api_keys"),
                                        ({"team": {"api_keys": [12345]}}, "tenants.team.api_keys[0]"),
                                        ([{"name": "team", "api_keys": ["sk-live-1"]}], "tenants"),
                                        ({"team": {"keys": ["sk-live-1"]}}, "tenants.team.keys")])
def test_a_config_error_never_shows_an_api_key(value, key):
    """A config error goes to the log: where the bad value may hold API keys (a key misspelt, a tenant written as
    a list, a key not a string) it names the key and the value's kind, never the value (it printed the keys)."""
    with pytest.raises(SpecError) as info:
        load_config(_make_yaml(_set("tenants", value)), env={})
    assert str(info.value).startswith(key) and "sk-live-1" not in str(info.value) and "12345" not in str(info.value)
    for misspelt in ("tenant", "gateway/api-keys", "pools/0/upstream_key"):   # misspelt keys
        with pytest.raises(SpecError) as info:
            load_config(_make_yaml(_set(misspelt, value)), env={})
        assert "unknown key" in str(info.value) and "sk-live-1" not in str(info.value)


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_yaml_names_key_and_value(case):
    source, expected = BAD[case]
    text = source if isinstance(source, str) else _make_yaml(source)
    with pytest.raises(SpecError) as info:
        load_config(text, env={})
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_a_route_capped_by_max_model_len_does_not_overlap_the_next():
    """A pool without max_prompt_tokens ends at max_model_len - 1: a route from there on is no overlap."""
    def capped(data):
        data["pools"][0]["route"] = {"min_prompt_tokens": 0}
        data["pools"][0]["max_model_len"] = 4097
    config = load_config(_make_yaml(capped), env={})
    assert config.pools[0].route.upper(config.pools[0].max_model_len) == 4096


def test_merge_keys_may_be_overridden():
    """A `<<: *anchor` merge may be followed by a key it brought (the mapping's own wins; a key the mapping
    itself gives twice is still refused)."""
    text = """
pools:
  - &chat {name: chat, model: builtin:smollm2-135m-instruct, kv_share: 0.1, avg_len: 512,
           route: {max_prompt_tokens: 100}}
  - <<: *chat
    name: rag
    route: {min_prompt_tokens: 101}
"""
    config = load_config(text, env={})
    assert [p.name for p in config.pools] == ["chat", "rag"]
    assert [p.kv_share for p in config.pools] == [0.1, 0.1] and config.pools[1].route.min_prompt_tokens == 101
    with pytest.raises(SpecError, match="duplicate key 'name'"):
        load_config(text.replace("    name: rag\n", "    name: rag\n    name: again\n"), env={})


def test_a_gpu_claimed_by_two_devices_is_refused():
    def two_devices(data):
        data["devices"] = {"a": {"device": "cuda", "replicas": 2}, "b": {"device": "cuda:1"}}
        data["pools"][1]["device"] = "b"
        data["pools"][0]["device"] = "a"
        data["pools"][1]["model"] = "/models/other"
    with pytest.raises(SpecError, match=r"^devices\.b: GPU 1 is also device 'a''s"):
        load_config(_make_yaml(two_devices), env={})
    config = load_config(_make_yaml(lambda d: d["devices"]["default"].update(
        device="cuda:2", replicas=2, tensor_parallel_size=2)), env={})
    device = config.devices["default"]
    assert [device.replica_gpus(r) for r in range(2)] == [(2, 3), (4, 5)]


def test_error_message_starts_with_the_key_path():
    with pytest.raises(SpecError, match=r"^pools\[1\]\.kv_share: must be <= 1\.0, got 1\.5$"):
        load_config(_make_yaml(_set("pools/1/kv_share", 1.5)), env={})


def test_syntax_error_points_at_line_and_column_and_shows_the_line_without_its_values():
    """The line is quoted with its keys and YAML's punctuation, its values masked (a value may be an API key,
    as in a tab-indented `api_keys` line), so the caret still points at the error."""
    with pytest.raises(SpecError) as info:
        load_config("pools:\n  - name: chat\n    kv_share: : 1\n", env={})
    assert "line 3, column" in str(info.value) and "kv_share: : *" in str(info.value)
    for text, shown in (("gateway:\n\tapi_keys: [sk-live-4f9a2c]\n", "\tapi_keys: [**-****-******]"),
                        ("gateway:\n  api_keys: [01234567]\n", "  api_keys: [********]")):
        with pytest.raises(SpecError) as info:
            load_config(text, env={})
        assert "line 2" in str(info.value) and shown in str(info.value) and "4f9a2c" not in str(info.value) \
            and "1234567" not in str(info.value), str(info.value)


def test_a_gateway_section_written_as_null_takes_its_defaults():
    sections = ("api_keys", "allowed_hosts", "limits", "stored_responses", "restart_backoff", "batches", "upstream")
    pools = "pools:\n  - {name: chat, model: 'builtin:smollm2-135m-instruct', kv_share: 1.0}\n"
    text = "gateway:\n" + "".join(f"  {key}: null\n" for key in sections) + pools
    assert load_config(text, env={}).gateway == load_config(pools, env={}).gateway


def test_default_config_loads():
    config = load_config(REPO / "config" / "pools.yaml", env={})
    assert [p.name for p in config.pools] == ["chat", "rag"]
    chat, rag = config.pools
    assert chat.model_name == rag.model_name == "smollm2-135m-instruct"
    assert chat.route == RouteSpec(0, 4096) and rag.route == RouteSpec(4097, None)
    assert (chat.kv_share, rag.kv_share, chat.avg_len, rag.avg_len) == (0.4, 0.6, 1024, 6144)
    assert chat.max_model_len == rag.max_model_len == 8192
    assert chat.slo == LatencySLO(ttft_ms=1000, itl_ms=100) and rag.slo is None   # interactive, throughput
    assert config.devices == {"default": DeviceSpec()}
    assert config.gateway.max_body_bytes == 8 << 20 and config.gateway.api_keys == ()


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match="nope.yaml: no such configuration file"):
        load_config(missing)


def test_a_binary_file_names_the_path(tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_bytes(b"pools:\n  - name: \xff\xfe\n")
    with pytest.raises(SpecError, match=rf"^{re.escape(str(path))}: not a UTF-8 text file \(byte 0xff at offset 17\)"):
        load_config(path)


def test_the_spec_and_the_engine_share_one_definition_of_each_choice():
    """Block sizes, preemption modes and victim policies: the YAML accepts exactly what the engine runs."""
    import engine.config
    import kernels
    from pools.config import spec

    assert engine.config.BLOCK_SIZES is kernels.BLOCK_SIZES
    for name in ("BLOCK_SIZES", "PREEMPTION_MODES", "VICTIM_POLICIES"):
        assert not hasattr(spec, name)   # imported where needed, never copied
    base = yaml.safe_load(DEFAULT_YAML.read_text())
    for size in (4, 8, 16, 32, 64):
        data = copy.deepcopy(base)
        for pool in data["pools"]:
            pool["block_size"] = size
        ok = size in kernels.BLOCK_SIZES
        try:
            parse_config(data, env={})
        except SpecError as exc:
            assert not ok and "block_size" in str(exc)
        else:
            assert ok
    for mode in engine.config.PREEMPTION_MODES:
        data = copy.deepcopy(base)
        data["pools"][0].update(preemption_mode=mode, swap_space="64MiB")
        assert parse_config(data, env={}).pools[0].preemption_mode == mode
    for policy in engine.config.VICTIM_POLICIES:
        data = copy.deepcopy(base)
        data["pools"][0]["victim_policy"] = policy
        assert parse_config(data, env={}).pools[0].victim_policy == policy


def test_errors_in_a_file_name_the_file(tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_text(_make_yaml(_set("gateway/port", 0)))
    with pytest.raises(SpecError) as info:
        load_config(path, env={})
    assert str(info.value).startswith("gateway.port: must be >= 1, got 0") and str(path) in str(info.value)


def test_api_keys_from_yaml_and_env():
    text = _make_yaml(_set("gateway/api_keys", ["k1", "k2"]))
    config = load_config(text, env={"CLIFFGUARD_API_KEYS": " k3, ,k1,k4 "})
    assert config.gateway.api_keys == ("k1", "k2", "k3", "k4")
    text = _make_yaml(_set("gateway/api_keys_env", "MY_KEYS"))
    config = load_config(text, env={"MY_KEYS": "a,b", "CLIFFGUARD_API_KEYS": "ignored"})
    assert config.gateway.api_keys == ("a", "b")
    # a variable rendered from an empty secret: set, but no key in it (authentication was silently off)
    for blank in (" ", ",", " , "):
        with pytest.raises(SpecError, match=r"gateway\.api_keys_env: the variable MY_KEYS is set but names no"):
            load_config(text, env={"MY_KEYS": blank})
    assert load_config(text, env={"MY_KEYS": ""}).gateway.api_keys == ()   # empty: no keys, as unset
    # a key pasted where its variable's name goes: it was accepted with authentication off, and shown in errors
    for pasted in ("sk-live-abc123", " ", "MY KEYS"):
        with pytest.raises(SpecError, match=r"^gateway\.api_keys_env: the name of an environment variable") as info:
            load_config(_make_yaml(_set("gateway/api_keys_env", pasted)), env={})
        assert "sk-live" not in str(info.value)


@pytest.mark.parametrize("key, value", [("gateway/host", " "), ("gateway/host", "localhost "),
                                        ("pools/0/model", " "), ("pools/2/tokenizer", "builtin "),
                                        ("pools/2/upstream", "http://admin:hunter2@h/v1 ")])
def test_a_blank_or_padded_host_model_or_url_is_refused_by_name(key, value):
    """`host: ' '` failed later as `--host: cannot resolve`, a padded upstream URL sent every request to
    `/v1%20/chat/completions`: refused at load, naming the key (an upstream's password not shown)."""
    with pytest.raises(SpecError) as info:
        load_config(_make_yaml(_set(key, value)), env={})
    path = re.sub(r"/(\d+)/", r"[\1].", key).replace("/", ".")
    assert str(info.value).startswith(f"{path}: must not be blank or begin or end with a space")
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("section", ["", "pools/0", "pools/2", "gateway", "devices/default"])
def test_a_key_that_is_not_a_string_is_named_and_its_mapping_never_shown(section):
    """YAML 1.1 reads `on:`, `yes:` as booleans: the error printed the whole mapping around the key (an upstream's
    password, the API keys) and named no key."""
    def bad_key(data):
        data.setdefault("gateway", {})["api_keys"] = ["sk-live-secret"]
        target = data
        for part in filter(None, section.split("/")):
            target = target[int(part)] if part.isdigit() else target.setdefault(part, {})
        target[True] = 1
    with pytest.raises(SpecError) as info:
        load_config(_make_yaml(bad_key), env={})
    message = str(info.value)
    assert "key True is not a string (YAML 1.1 reads on, off, yes and no as booleans" in message, message
    assert "sk-live" not in message and "builtin" not in message


def test_serve_refuses_an_upstream_key_variable_that_is_not_set(tmp_path, capsys):
    """An upstream pool's `upstream_api_key_env` unset or blank where `serve` runs: every request would go without
    the key and be answered 502, the process never gaining the variable; `capacity` needs no secret."""
    from gateway.cli import main

    config = load_config(_make_yaml(_set("pools/2/upstream_api_key_env", "REMOTE_KEY")), env={})
    for env in ({}, {"REMOTE_KEY": " "}):
        with pytest.raises(SpecError, match=r"^pools\[2\]\.upstream_api_key_env: the variable REMOTE_KEY is not set"):
            config.check_upstream_keys(env)
    config.check_upstream_keys({"REMOTE_KEY": "sk-x"})
    with_user = _both(_set("pools/2/upstream_api_key_env", "REMOTE_KEY"), _set("pools/2/upstream", "http://u:p@h/v1"))
    load_config(_make_yaml(with_user), env={}).check_upstream_keys({})   # its credentials go without a key
    path = tmp_path / "pools.yaml"
    path.write_text(_make_yaml(_set("pools/2/upstream_api_key_env", "REMOTE_KEY_UNSET_HERE")))
    assert main(["serve", "--config", str(path), "--data-dir", str(tmp_path / "data"), "--port", "0"]) != 0
    assert "pools[2].upstream_api_key_env: the variable REMOTE_KEY_UNSET_HERE is not set" in capsys.readouterr().err


def test_omitted_sections_get_defaults():
    config = parse_config({"pools": [{"name": "p", "model": "builtin:smollm2-135m-instruct", "kv_share": 1}]},
                          env={})
    assert config.devices == {"default": DeviceSpec()}
    assert config.gateway.port == 8000 and config.pools[0].device == "default"


def test_death_spiral_thresholds_defaults_and_off():
    config = load_config(_make_yaml(_both(
        _set("pools/0/death_spiral", {"window_seconds": 60, "min_preemptions_per_s": 2, "clear_seconds": 120}),
        _set("pools/1/death_spiral", False))), env={})
    chat, rag, remote = config.pools
    assert chat.death_spiral == SpiralConfig(window_seconds=60, min_preemptions_per_s=2, clear_seconds=120)
    assert chat.death_spiral.clear_after_seconds == 120
    assert not rag.death_spiral.enabled
    assert load_config(_make_yaml(), env={}).pools[0].death_spiral == SpiralConfig()   # omitted: the defaults
    for same in (True, None, {}):
        assert load_config(_make_yaml(_set("pools/0/death_spiral", same)), env={}).pools[0].death_spiral == \
            SpiralConfig()
    with pytest.raises(SpecError, match="^death_spiral: expected SpiralConfig"):
        PoolSpec(name="p", model="m", kv_share=0.5, death_spiral={"window_seconds": 3})


def test_upstream_pool():
    remote = load_config(_make_yaml(_both(_set("pools/2/tokenizer", "/models/llama3"),
                                          _set("pools/2/upstream_api_key_env", "REMOTE_KEY"))), env={}).pools[2]
    assert remote.is_upstream and remote.upstream == "http://10.0.0.2:8000/v1"
    assert remote.model_name == "meta-llama/Llama-3-8B-Instruct"
    assert (remote.tokenizer, remote.upstream_api_key_env, remote.kv_share) == ("/models/llama3", "REMOTE_KEY", None)


def test_routes_of_different_models_may_overlap_and_gaps_are_allowed():
    edit = _both(_set("pools/2/route", {"min_prompt_tokens": 0, "max_prompt_tokens": 100}),
                 _set("pools/1/route/min_prompt_tokens", 5000))
    config = load_config(_make_yaml(edit), env={})
    assert config.pools[1].route.describe() == "5000.."


def test_served_model_name_separates_routes():
    edit = _both(_set("pools/1/route/min_prompt_tokens", 0), _set("pools/1/served_model_name", "long"))
    config = load_config(_make_yaml(edit), env={})
    assert [p.model_name for p in config.pools] == ["smollm2-135m-instruct", "long", "meta-llama/Llama-3-8B-Instruct"]


def test_relative_model_path_is_found_beside_the_yaml():
    config = load_config(REPO / "config" / "examples" / "llama3-70b-8xh100.yaml", env={})
    model = Path(config.pools[0].model)
    assert (model / "config.json").is_file() and model.name == "llama-3-70b"
    assert config.pools[0].model_name == "meta-llama/Meta-Llama-3-70B-Instruct"
    assert config.devices["h100x8"].memory_bytes is None   # auto: each GPU's measured total where it is served


def test_a_model_or_tokenizer_under_home_is_the_users_home(tmp_path, monkeypatch):
    """`model: ~/models/x` (and an upstream pool's `tokenizer`) is under the user's home, as a shell reads it: the
    engine took `~` for a folder of that name in the working directory ('no such folder')."""
    monkeypatch.setenv("HOME", str(tmp_path))
    data = {"pools": [{"name": "local", "model": "~/models/x", "kv_share": 1.0,
                       "route": {"max_prompt_tokens": 100}},
                      {"name": "far", "upstream": "http://127.0.0.1:9/v1", "model": "m", "tokenizer": "~/tok",
                       "route": {"min_prompt_tokens": 101}}]}
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump(data))
    local, far = load_config(path, env={}).pools
    assert (local.model, far.tokenizer) == (str(tmp_path / "models" / "x"), str(tmp_path / "tok"))


@pytest.mark.parametrize("value,expected", [
    (4096, 4096), ("4096", 4096), ("80GiB", 80 << 30), ("512 MiB", 512 << 20), ("1.5GB", 1_500_000_000),
    ("8MiB", 8 << 20), ("2gib", 2 << 30), ("1 KB", 1000), ("0.5KiB", 512), ("3Gi", 3 << 30), ("0", 0), (2.0, 2),
])
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["80 gigs", "GiB", "-1GiB", "1e9", True, None, [1], 1.5, -3])
def test_parse_bytes_rejects(value):
    with pytest.raises(SpecError, match="^size: "):
        parse_bytes(value, "size")


@pytest.mark.parametrize("model,name", [
    ("builtin:smollm2-135m-instruct", "smollm2-135m-instruct"),
    ("/models/Meta-Llama-3-8B-Instruct/", "Meta-Llama-3-8B-Instruct"),
    ("/models/qwen2-0_5b-instruct-q8_0.gguf", "qwen2-0_5b-instruct-q8_0"),
    ("models/Mistral.GGUF", "Mistral"),
])
def test_model_name_is_derived_from_model(model, name):
    assert PoolSpec(name="p", model=model, kv_share=0.5).model_name == name
    assert PoolSpec(name="p", model=model, kv_share=0.5, served_model_name="x").model_name == "x"


def test_route_admits():
    chat, rag = RouteSpec(0, 4096), RouteSpec(4097)
    assert chat.admits(0, 8192) and chat.admits(4096, 8192) and not chat.admits(4097, 8192)
    assert not rag.admits(4096, 8192) and rag.admits(4097, 8192) and rag.admits(8191, 8192)
    assert not rag.admits(8192, 8192)  # no room for a generated token
    assert not chat.admits(4000, 4000) and chat.admits(3999, 4000)
    assert rag.admits(10**6) and rag.upper() is None and rag.upper(8192) == 8191


def test_dataclasses_validate_on_construction():
    with pytest.raises(SpecError, match="^kv_share: must be <= 1.0, got 2.0"):
        PoolSpec(name="p", model="m", kv_share=2.0)
    with pytest.raises(SpecError, match="^max_prompt_tokens: expected an integer"):
        RouteSpec(0, "10")
    with pytest.raises(SpecError, match="^memory: must be at least 1 byte, got 0"):
        DeviceSpec(memory_bytes=0)
    assert DeviceSpec().memory_bytes is None and DEFAULT_CPU_MEMORY == 4 << 30


def test_a_pools_chat_template_kwargs_load_and_default_to_none():
    config = load_config(_make_yaml(_set("pools/0/chat_template_kwargs", {"enable_thinking": False})), env={})
    assert config.pools[0].chat_template_kwargs == {"enable_thinking": False}
    assert config.pools[1].chat_template_kwargs is None
    with pytest.raises(SpecError, match=r"^chat_template_kwargs\.tools: is set by the gateway"):
        PoolSpec(name="p", model="m", kv_share=0.5, chat_template_kwargs={"tools": []})


def test_gateway_fault_timers_limits_and_cache_sharing_load():
    config = load_config(_make_yaml(_both(
        _set("gateway/write_timeout", 5), _set("gateway/stall_seconds", 2.5), _set("gateway/metrics_auth", True),
        _set("gateway/limits", {"max_prompts": 8, "max_messages": 16}), _set("pools/0/share_prefix_cache", True))),
        env={"CLIFFGUARD_API_KEYS": "k1"})
    gateway = config.gateway
    assert (gateway.write_timeout, gateway.stall_seconds, gateway.metrics_auth) == (5, 2.5, True)
    # metrics_auth with no key to ask for would leave /metrics open: refused, naming where keys come from
    with pytest.raises(SpecError, match=r"^gateway\.metrics_auth: asks /metrics for an API key, and no API key"):
        load_config(_make_yaml(_set("gateway/metrics_auth", True)), env={})
    assert (gateway.limits.max_prompts, gateway.limits.max_choices, gateway.limits.max_messages) == (8, 1024, 16)
    assert config.pools[0].share_prefix_cache and not config.pools[1].share_prefix_cache


def test_the_watchdog_and_write_timeout_floors_are_allowed():
    """The floors themselves load: four heartbeats for the watchdog's timeouts, half a second for writes."""
    from engine.worker import HEARTBEAT_INTERVAL

    gateway = load_config(_make_yaml(_both(
        _set("gateway/stall_seconds", 4 * HEARTBEAT_INTERVAL), _set("gateway/step_timeout_seconds", 2),
        _set("gateway/write_timeout", 0.5))), env={}).gateway
    assert (gateway.stall_seconds, gateway.step_timeout_seconds, gateway.write_timeout) == (2, 2, 0.5)


@pytest.mark.parametrize("written", ["1e300", "1.0e300", "3e2", "2.5E2", ".5e1"])
def test_the_exponent_hint_is_text_yaml_reads_as_that_number(written):
    """YAML 1.1 reads `1e300` and `1.0e300` as strings; the error's hint is what PyYAML reads as the number
    (a dot in the mantissa and a sign on the exponent: `1.0e+300`; it said `1.0e300`, text again)."""
    text = ("gateway: {{restart_backoff: {{max_seconds: {}}}}}\n"
            "pools: [{{name: p, model: builtin:smollm2-135m-instruct, kv_share: 1}}]\n")
    with pytest.raises(SpecError, match=r"^gateway\.restart_backoff\.max_seconds: expected a number") as info:
        load_config(text.format(written), env={})
    hint = re.search(r"write (\S+)\)$", str(info.value)).group(1)
    assert load_config(text.format(hint), env={}).gateway.restart_backoff.max_seconds == float(written)


def test_a_model_path_too_long_for_the_file_system_names_the_pool(tmp_path):
    """Looking a 300-character relative path up beside the file raised OSError (ENAMETOOLONG): a traceback
    from `cliffguard capacity` and `serve`. It is a SpecError naming the key."""
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump({"pools": [{"name": "p", "model": "m" * 300, "kv_share": 1}]}))
    with pytest.raises(SpecError, match=r"^pools\[0\]\.model: not a path this machine can open \(File name too long\), "
                                        r"got 'mmm"):
        load_config(path, env={})
    name = "x" * 300
    one_line = f"pools: [{{name: p, model: builtin:smollm2-135m-instruct, kv_share: 1, served_model_name: {name}}}]"
    assert load_config(one_line, env={}).pools[0].model_name == name   # YAML text, not a path to look up
