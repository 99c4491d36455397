"""pools.config.device_spec: `replicas` as a number or `{min, max}` (autoscaled), `placement: ray` and its
cluster address; and how `cliffguard capacity` (plan, JSON and the `--rate` verdict) shows them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from engine.model_config import ModelConfig
from engine.step_cost import LinearStepTime
from pools.capacity_plan import plan_capacity
from pools.config.yaml_file import load_config
from pools.config.device_spec import DEFAULT_SCALE_DOWN_IDLE_SECONDS, DEFAULT_SCALE_UP_WAIT_SECONDS
from pools.plan_report import format_plan, format_verdicts, plan_verdicts
from pools.config.spec import DeviceSpec, SpecError

REPO = Path(__file__).resolve().parents[2]
LLAMA70B_JSON = REPO / "config" / "examples" / "llama-3-70b" / "config.json"
TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)


def _make_yaml(**device) -> str:
    """One device `default` with `device` as its settings, one local pool on it."""
    return yaml.safe_dump({
        "devices": {"default": device},
        "pools": [{"name": "chat", "model": "builtin:smollm2-135m-instruct", "kv_share": 0.5}],
    }, sort_keys=False)


def _load_device(**device) -> DeviceSpec:
    return load_config(_make_yaml(**device), env={}).devices["default"]


# --- replicas ---------------------------------------------------------------------------------------

def test_a_number_of_replicas_is_fixed():
    device = _load_device(replicas=3)
    assert (device.replicas, device.min_replicas, device.autoscaled, device.initial_replicas) == (3, None, False, 3)
    assert (device.scale_up_wait_seconds, device.scale_down_idle_seconds) == (2.0, 60.0)
    assert (DEFAULT_SCALE_UP_WAIT_SECONDS, DEFAULT_SCALE_DOWN_IDLE_SECONDS) == (2.0, 60.0)
    assert DeviceSpec().replicas == 1 and not DeviceSpec().autoscaled


def test_a_min_max_mapping_is_autoscaled_and_plans_max_slots():
    device = _load_device(device="cuda", replicas={"min": 1, "max": 4}, tensor_parallel_size=2)
    assert (device.replicas, device.min_replicas, device.autoscaled, device.initial_replicas) == (4, 1, True, 1)
    assert (device.scale_up_wait_seconds, device.scale_down_idle_seconds) == (2.0, 60.0)
    assert device.claimed_gpus == tuple(range(8))    # every slot's GPUs, not only the min's
    timed = _load_device(replicas={"min": 2, "max": 8, "scale_up_wait_seconds": 0.5, "scale_down_idle_seconds": 300})
    assert (timed.min_replicas, timed.replicas, timed.scale_up_wait_seconds, timed.scale_down_idle_seconds) == (
        2, 8, 0.5, 300)
    same = _load_device(replicas={"min": 3, "max": 3})
    assert not same.autoscaled and same.initial_replicas == 3


def test_gpus_are_listed_for_every_slot():
    with pytest.raises(SpecError, match=r"^devices\.default\.gpus: 2 GPUs listed; replicas 4 x tensor_parallel_size"):
        _load_device(device="cuda", replicas={"min": 1, "max": 4}, gpus=[0, 1])
    assert _load_device(device="cuda", replicas={"min": 1, "max": 2}, gpus=[3, 1]).replica_gpus(1) == (1,)


REPLICA_ERRORS = {
    "string": ("x", "devices.default.replicas: expected an integer, got string 'x'"),
    "list": ([1, 8], "devices.default.replicas: expected an integer, got array [1, 8]"),
    "zero": (0, "devices.default.replicas: must be >= 1, got 0"),
    "min above max": ({"min": 3, "max": 2}, "devices.default.replicas.min: 3 is above max 2"),
    "min zero": ({"min": 0, "max": 2}, "devices.default.replicas.min: must be >= 1, got 0"),
    "max zero": ({"min": 1, "max": 0}, "devices.default.replicas.max: must be >= 1, got 0"),
    "min a float": ({"min": 1.5, "max": 2}, "devices.default.replicas.min: expected an integer, got number 1.5"),
    "max a bool": ({"min": 1, "max": True}, "devices.default.replicas.max: expected an integer, got boolean True"),
    "no max": ({"min": 1}, "devices.default.replicas.max: is required"),
    "no min": ({"max": 4}, "devices.default.replicas.min: is required"),
    "unknown key": ({"min": 1, "max": 2, "idle": 5}, "devices.default.replicas.idle: unknown key (value 5)"),
    "wait zero": ({"min": 1, "max": 2, "scale_up_wait_seconds": 0},
                  "devices.default.replicas.scale_up_wait_seconds: must be > 0.0, got 0"),
    "idle a string": ({"min": 1, "max": 2, "scale_down_idle_seconds": "1m"},
                      "devices.default.replicas.scale_down_idle_seconds: expected a number, got string '1m'"),
    "idle infinite": ({"min": 1, "max": 2, "scale_down_idle_seconds": float("inf")},
                      "devices.default.replicas.scale_down_idle_seconds: must be a finite number, got inf"),
}


@pytest.mark.parametrize("case", list(REPLICA_ERRORS), ids=list(REPLICA_ERRORS))
def test_replica_errors_name_the_key_and_the_value(case):
    value, expected = REPLICA_ERRORS[case]
    with pytest.raises(SpecError) as info:
        _load_device(replicas=value)
    assert str(info.value).startswith(expected), str(info.value)
    if case == "unknown key":
        assert "allowed keys: min, max, scale_up_wait_seconds, scale_down_idle_seconds" in str(info.value)


def test_the_dataclass_checks_its_own_fields():
    with pytest.raises(SpecError, match=r"^replicas\.min: 5 is above max 4$"):
        DeviceSpec(replicas=4, min_replicas=5)
    with pytest.raises(SpecError, match=r"^scale_up_wait_seconds: .* got -1"):
        DeviceSpec(replicas=4, min_replicas=1, scale_up_wait_seconds=-1)


# --- placement --------------------------------------------------------------------------------------

def test_placement_defaults_to_local_and_ray_takes_an_address():
    assert (_load_device().placement, _load_device().ray_address) == ("local", None)
    device = _load_device(device="cuda", placement="ray", ray_address="ray://head:10001", replicas={"min": 1, "max": 4})
    assert (device.placement, device.ray_address, device.autoscaled) == ("ray", "ray://head:10001", True)
    assert device.claimed_gpus == ()     # Ray assigns them on its nodes; none of this machine's


PLACEMENT_ERRORS = {
    "unknown placement": ({"placement": "k8s"}, "devices.default.placement: must be one of local, ray, got 'k8s'"),
    "address without ray": ({"ray_address": "auto"},
                            "devices.default.ray_address: only with placement: ray (placement is 'local'), got 'auto'"),
    "empty address": ({"placement": "ray", "ray_address": ""},
                      "devices.default.ray_address: must not be empty, got ''"),
    "address a number": ({"placement": "ray", "ray_address": 6379},
                         "devices.default.ray_address: expected a string, got integer 6379"),
    "gpus with ray": ({"device": "cuda", "placement": "ray", "gpus": [0, 1]},
                      "devices.default.gpus: not with placement: ray (Ray assigns each replica its GPUs), got [0, 1]"),
}


@pytest.mark.parametrize("case", list(PLACEMENT_ERRORS), ids=list(PLACEMENT_ERRORS))
def test_placement_errors_name_the_key_and_the_value(case):
    device, expected = PLACEMENT_ERRORS[case]
    with pytest.raises(SpecError) as info:
        _load_device(**device)
    assert str(info.value).startswith(expected), str(info.value)


def test_two_ray_devices_claim_no_gpu_of_this_machine():
    text = yaml.safe_dump({
        "devices": {"a": {"device": "cuda", "placement": "ray"}, "b": {"device": "cuda", "placement": "ray"}},
        "pools": [{"name": "chat", "model": "m1", "device": "a", "kv_share": 1.0},
                  {"name": "rag", "model": "m2", "device": "b", "kv_share": 1.0}]})
    assert set(load_config(text, env={}).devices) == {"a", "b"}


def test_the_ray_address_comes_from_the_yaml_then_the_environment():
    from_yaml = _load_device(placement="ray", ray_address="127.0.0.1:6379")
    assert from_yaml.resolved_ray_address({"RAY_ADDRESS": "ray://other:10001"}) == "127.0.0.1:6379"
    from_env = _load_device(placement="ray")
    assert from_env.resolved_ray_address({"RAY_ADDRESS": "auto"}) == "auto"
    for environ in ({}, {"RAY_ADDRESS": "  "}):
        with pytest.raises(SpecError, match=r"^devices\.default\.ray_address: placement is ray and no cluster "
                                            r"address: set ray_address or the RAY_ADDRESS environment variable$"):
            from_env.resolved_ray_address(environ)
    with pytest.raises(SpecError, match=r"^devices\.default\.placement: 'local'"):
        _load_device().resolved_ray_address({"RAY_ADDRESS": "auto"})


def test_serve_start_up_line_says_autoscaled_and_ray():
    config = load_config(_make_yaml(replicas={"min": 1, "max": 4}, placement="ray"), env={})
    (line,) = config.describe_service_classes()
    assert line.startswith("device default (1..4 replicas, autoscaled, on Ray): chat ")


# --- cliffguard capacity ----------------------------------------------------------------------------

def _llama_plan(**device):
    """Llama 3 70B on TP 4 of 80 GiB GPUs, with `device`'s extra settings."""
    text = yaml.safe_dump({
        "devices": {"h100": {"device": "cuda", "memory": "80GiB", "tensor_parallel_size": 4, **device}},
        "pools": [{"name": "chat", "model": "llama", "device": "h100", "kv_share": 1.0, "max_model_len": 8192}]})
    config = load_config(text, env={})
    return plan_capacity(config, {"llama": ModelConfig.from_hf_config(json.loads(LLAMA70B_JSON.read_text()))})


def test_capacity_shows_an_autoscaled_device_and_its_placement():
    plan = _llama_plan(replicas={"min": 1, "max": 8}, placement="ray")
    text = format_plan(plan)
    header = text.splitlines()[0]
    assert "replicas 1..8 (autoscaled), each planned alike, placement: ray" in header, header
    whole = next(line for line in text.splitlines() if line.startswith("whole pool"))
    assert "(8 x " in whole and "at max)" in whole
    fixed = format_plan(_llama_plan(replicas=2)).splitlines()[0]
    assert "replicas=2 (each planned alike)" in fixed and "autoscaled" not in fixed and "placement" not in fixed


def test_capacity_json_keeps_replicas_and_adds_min_max_placement():
    (device,) = json.loads(json.dumps(_llama_plan(replicas={"min": 2, "max": 8}).to_dict()))["devices"]
    assert (device["replicas"], device["min_replicas"], device["max_replicas"]) == (8, 2, 8)
    assert device["autoscaled"] is True and device["placement"] == "local"
    (fixed,) = _llama_plan(replicas=3).to_dict()["devices"]
    assert (fixed["replicas"], fixed["min_replicas"], fixed["max_replicas"], fixed["autoscaled"]) == (3, 3, 3, False)


def _tiny_verdicts(replicas, rate: float) -> dict:
    """The TINY model's device (8 sequences per replica) at `rate` requests/s of 100 + 100 tokens."""
    text = yaml.safe_dump({
        "devices": {"gpu": {"device": "cuda", "memory": "1GiB", "dtype": "bfloat16", "replicas": replicas}},
        "pools": [{"name": "chat", "model": "tiny", "device": "gpu", "kv_share": 1.0, "max_num_seqs": 8,
                   "max_model_len": 1024, "avg_len": 256, "slo": None}]})
    plan = plan_capacity(load_config(text, env={}), {"tiny": TINY})
    step = {"gpu": LinearStepTime(a=0.01, b=0.0001, c=0.001, d=0.0)}
    return plan_verdicts(plan, step, {"chat": (rate, 100.0, 100.0)}, step_model="test")


def test_rate_verdict_judges_an_autoscaled_device_at_its_max():
    heavy = _tiny_verdicts({"min": 1, "max": 2}, 64.0)
    verdict = heavy["gpu"]
    fixed = _tiny_verdicts(2, 64.0)["gpu"]
    assert verdict["offered_load"] == pytest.approx(fixed["offered_load"])     # over the max's 2 replicas
    assert (verdict["replicas"], verdict["min_replicas"], verdict["max_replicas"]) == (2, 1, 2)
    assert verdict["autoscaled"] is True and verdict["placement"] == "local"
    needed = verdict["replicas_needed"]
    assert needed > 2
    line = format_verdicts(heavy)[0]
    assert "of 2 replica(s)' time (autoscaled: its max)" in line
    assert f"needs {needed} replicas, max is 2 ({needed} replicas would carry it at most 90% busy)" in line
    assert "needs" not in format_verdicts({"gpu": fixed})[0]     # a fixed device says it as before
    light = _tiny_verdicts({"min": 1, "max": 4}, 1.0)
    assert light["gpu"]["replicas_needed"] == 1
    assert "within capacity; it needs 1 of its 1..4 replicas (each at most 90% busy)" in format_verdicts(light)[0]
