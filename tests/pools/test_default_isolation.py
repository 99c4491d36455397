"""Isolation by default (pools.config.yaml_file.default_isolation): on a device of two or more local pools where no
pool names an `slo`, the strictly shortest route's pool is interactive with `LatencySLO()`; `slo: null`
opts a pool out. Also what `cliffguard capacity` and `serve` say about each pool's class."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from engine.config import LatencySLO
from engine.model_config import ModelConfig
from pools.capacity_plan import engine_configs, plan_capacity
from pools.plan_report import format_plan
from pools.config.yaml_file import parse_config
from pools.config.spec import PoolSpec, SpecError

REPO = Path(__file__).resolve().parents[2]
LLAMA70B_JSON = REPO / "config" / "examples" / "llama-3-70b" / "config.json"
MODEL = "builtin:smollm2-135m-instruct"

CHAT = {"name": "chat", "model": MODEL, "route": {"max_prompt_tokens": 512}, "kv_share": 0.4, "avg_len": 256,
        "max_model_len": 1024}
RAG = {"name": "rag", "model": MODEL, "route": {"min_prompt_tokens": 513}, "kv_share": 0.6, "avg_len": 900,
       "max_model_len": 1024}


def _make_data(*pools: dict, devices: dict | None = None) -> dict:
    return {"devices": devices or {"default": {"device": "cpu", "memory": "2GiB"}},
            "pools": [copy.deepcopy(p) for p in pools]}


def _classes(data: dict) -> dict[str, tuple[LatencySLO | None, str | None]]:
    config = parse_config(data, env={})
    return {p.name: (p.slo, p.slo_source) for p in config.pools}


def test_no_slo_makes_the_shortest_route_interactive():
    assert _classes(_make_data(CHAT, RAG)) == {"chat": (LatencySLO(), "default"), "rag": (None, "absent")}
    assert LatencySLO() == LatencySLO(ttft_ms=1000, itl_ms=100)


def test_the_order_of_the_pools_does_not_matter():
    assert _classes(_make_data(RAG, CHAT))["chat"] == (LatencySLO(), "default")


@pytest.mark.parametrize("pool", [0, 1])
def test_an_slo_on_any_pool_of_the_device_turns_the_default_off(pool):
    data = _make_data(CHAT, RAG)
    data["pools"][pool]["slo"] = {"ttft_ms": 2000, "itl_ms": 50}
    classes = _classes(data)
    assert classes[data["pools"][pool]["name"]] == (LatencySLO(ttft_ms=2000, itl_ms=50), "yaml")
    assert classes[data["pools"][1 - pool]["name"]] == (None, "absent")


def test_slo_null_on_rag_still_defaults_chat():
    assert _classes(_make_data(CHAT, {**RAG, "slo": None})) == {"chat": (LatencySLO(), "default"),
                                                                 "rag": (None, "opted_out")}


def test_slo_null_on_chat_leaves_no_interactive_pool():
    """chat still has the shortest route, so rag is not promoted in its place."""
    assert _classes(_make_data({**CHAT, "slo": None}, RAG)) == {"chat": (None, "opted_out"), "rag": (None, "absent")}


def test_a_min_share_marks_a_throughput_pool_that_isolation_by_default_leaves_as_it_is():
    """`min_share` is a throughput pool's key: the shortest route's pool that sets it is not made interactive
    (the file was refused: 'min_share: only for throughput pools; this pool has an slo (isolation by default
    ...)'), and, as with `slo: null` there, rag is not promoted in its place."""
    assert _classes(_make_data({**CHAT, "min_share": 0.1}, RAG)) == {"chat": (None, "absent"), "rag": (None, "absent")}
    assert _classes(_make_data(CHAT, {**RAG, "min_share": 0.1})) == {"chat": (LatencySLO(), "default"),
                                                                     "rag": (None, "absent")}


@pytest.mark.parametrize("chat_route,rag_route", [
    ({"max_prompt_tokens": 512}, {"min_prompt_tokens": 513, "max_prompt_tokens": 512 + 512}),   # 512 vs 1023 cap
    ({"max_prompt_tokens": 1023}, {"min_prompt_tokens": 0, "max_prompt_tokens": 4096}),         # both capped at 1023
])
def test_uppers_compare_after_the_max_model_len_cap(chat_route, rag_route):
    """`route.upper(max_model_len)`: a route beyond max_model_len - 1 counts as max_model_len - 1."""
    data = _make_data({**CHAT, "route": chat_route}, {**RAG, "route": rag_route, "served_model_name": "other"})
    chat_upper = min(chat_route["max_prompt_tokens"], 1023)
    expected = (LatencySLO(), "default") if chat_upper < 1023 else (None, "absent")
    assert _classes(data)["chat"] == expected


def test_a_tie_defaults_nothing():
    data = _make_data(CHAT, {**RAG, "route": {"max_prompt_tokens": 512}, "served_model_name": "other"})
    assert _classes(data) == {"chat": (None, "absent"), "rag": (None, "absent")}


def test_unbounded_routes_tie():
    """No max_prompt_tokens and no max_model_len on either pool: both unbounded, nothing defaulted."""
    chat = {k: v for k, v in CHAT.items() if k not in ("route", "max_model_len")}
    rag = {**{k: v for k, v in RAG.items() if k not in ("route", "max_model_len")}, "served_model_name": "other"}
    assert _classes(_make_data(chat, rag)) == {"chat": (None, "absent"), "rag": (None, "absent")}


def test_an_unbounded_route_is_longer_than_any_bound():
    rag = {k: v for k, v in RAG.items() if k != "max_model_len"}   # the model's context: unknown here
    assert _classes(_make_data(CHAT, rag))["chat"] == (LatencySLO(), "default")


def test_a_single_pool_on_a_device_is_not_defaulted():
    assert _classes(_make_data({**CHAT, "kv_share": 1.0})) == {"chat": (None, "absent")}


def test_upstream_pools_do_not_count():
    remote = {"name": "remote", "upstream": "http://10.0.0.2:8000/v1", "model": "other",
              "route": {"max_prompt_tokens": 10}}
    classes = _classes(_make_data({**RAG, "route": {}, "kv_share": 1.0}, remote))
    assert classes == {"rag": (None, "absent"), "remote": (None, None)}


def test_each_device_is_decided_on_its_own():
    devices = {"a": {"device": "cpu", "memory": "2GiB"}, "b": {"device": "cpu", "memory": "2GiB"},
               "c": {"device": "cpu", "memory": "2GiB"}}
    other = "builtin:other"
    pools = [
        {**CHAT, "device": "a"}, {**RAG, "device": "a"},                                    # defaulted
        {**CHAT, "name": "chat-b", "model": other, "device": "b", "route": {"max_prompt_tokens": 100}},
        {**RAG, "name": "rag-b", "model": other, "device": "b", "route": {"min_prompt_tokens": 101},
         "slo": {"ttft_ms": 500, "itl_ms": 80}},                                            # the user chose
        {**CHAT, "name": "alone", "model": "builtin:third", "device": "c", "kv_share": 1.0},  # one pool
    ]
    assert _classes(_make_data(*pools, devices=devices)) == {
        "chat": (LatencySLO(), "default"), "rag": (None, "absent"),
        "chat-b": (None, "absent"), "rag-b": (LatencySLO(ttft_ms=500, itl_ms=80), "yaml"),
        "alone": (None, "absent")}


def test_slo_source_is_not_a_yaml_key():
    with pytest.raises(SpecError, match=r"pools\[0\]\.slo_source"):
        parse_config(_make_data({**CHAT, "slo_source": "default"}, RAG), env={})


def test_code_built_pools_keep_what_they_are_given():
    """PoolSpec(...) without YAML: no source, no default; a source must agree with the slo."""
    pool = PoolSpec(name="chat", model=MODEL, kv_share=0.5)
    assert pool.slo is None and pool.slo_source is None and pool.service_class == "throughput"
    assert PoolSpec(name="chat", model=MODEL, kv_share=0.5, slo=LatencySLO()).service_class == "interactive"
    with pytest.raises(SpecError, match="slo_source: 'default' needs an slo, got slo None"):
        PoolSpec(name="chat", model=MODEL, kv_share=0.5, slo_source="default")
    with pytest.raises(SpecError, match="slo_source: must be one of absent, default, opted_out, yaml"):
        PoolSpec(name="chat", model=MODEL, kv_share=0.5, slo_source="yes")


def test_the_engine_gets_the_same_slo_as_from_an_explicit_one(builtin_path):
    """The default is the same LatencySLO in each device's EngineConfig as writing it out on chat."""
    model = {MODEL: ModelConfig.from_folder(builtin_path)}

    def engine_slos(data: dict) -> list[LatencySLO | None]:
        config = parse_config(data, env={})
        engine = engine_configs(config, plan_capacity(config, model))["default"]
        return [pool.slo for pool in engine.pools]

    explicit = engine_slos(_make_data({**CHAT, "slo": {"ttft_ms": 1000, "itl_ms": 100}}, RAG))
    assert engine_slos(_make_data(CHAT, RAG)) == explicit == [LatencySLO(), None]


def test_serve_start_up_lines_name_each_class():
    config = parse_config(_make_data(CHAT, RAG), env={})
    assert config.describe_service_classes() == [
        "device default: chat interactive (slo from the device's measured step at start; default: no slo in the "
        "YAML), rag throughput, min_share 0.2"]
    config = parse_config(_make_data({**CHAT, "slo": {"ttft_ms": 800, "itl_ms": 60}}, {**RAG, "min_share": 0.3}),
                          env={})
    assert config.describe_service_classes() == ["device default: chat interactive (slo ttft 800 ms, itl 60 ms), "
                                                 "rag throughput, min_share 0.3"]
    (line,) = parse_config(_make_data({**CHAT, "slo": None}, RAG), env={}).describe_service_classes()
    assert line.startswith("device default: chat throughput (slo: null), rag throughput (no interactive pool: "
                           "no compute isolation")


def test_capacity_names_the_classes():
    """`cliffguard capacity` prints `format_plan` and, with --json, `to_dict` of this plan."""
    devices = {"default": {"device": "cuda", "memory": "80GiB", "tensor_parallel_size": 8}}
    config = parse_config(_make_data(CHAT, {**RAG, "slo": None}, devices=devices), env={})
    plan = plan_capacity(config, {MODEL: ModelConfig.from_hf_config(json.loads(LLAMA70B_JSON.read_text()))},
                         vram_bytes=80 << 30)
    text = format_plan(plan)
    table = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert table["class"].split(None, 1)[1].split() == ["interactive", "(default)", "throughput", "(slo:", "null)"]
    assert table["slo"].split(None, 1)[1].split() == ["from", "the", "measured", "step", "-"]
    assert "\ninteractive (default): the strictly shortest route" in text
    pools = json.loads(json.dumps(plan.to_dict()))["pools"]   # what --json prints
    assert [(p["service_class"], p["slo"], p["slo_source"]) for p in pools] == [
        ("interactive", {"ttft_ms": 1000.0, "itl_ms": 100.0}, "default"), ("throughput", None, "opted_out")]
