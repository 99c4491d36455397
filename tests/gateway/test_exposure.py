"""What the gateway shows to whom: /metrics behind the API key with `gateway.metrics_auth`, and an
upstream's password never in an answer (in-process, an upstream-only gateway; nothing listens upstream)."""

from __future__ import annotations

from gateway.app import create_app
from gateway.runtime import Gateway
from gateway.upstream import redact
from pools.spec import load_config

SECRET = "s3cr3t-password"


def _gateway(tmp_path, metrics_auth: bool) -> Gateway:
    path = tmp_path / "front.yaml"
    path.write_text(f"""
gateway: {{api_keys: [sk-test], metrics_auth: {str(metrics_auth).lower()}}}
pools:
  - name: remote
    upstream: http://admin:{SECRET}@127.0.0.1:9/v1
    model: upstream-model
    served_model_name: front
    tokenizer: builtin:smollm2-135m-instruct
    max_model_len: 512
""")
    return Gateway.from_config(load_config(path, env={}))


async def test_metrics_need_the_key_only_with_metrics_auth(aiohttp_client, tmp_path):
    for metrics_auth, anonymous in ((False, 200), (True, 401)):
        client = await aiohttp_client(create_app(_gateway(tmp_path, metrics_auth)))
        assert (await client.get("/metrics")).status == anonymous
        keyed = await client.get("/metrics", headers={"Authorization": "Bearer sk-test"})
        assert keyed.status == 200 and "cliffguard_" in await keyed.text()
        assert (await client.get("/health")).status == 200   # liveness stays open


async def test_an_upstream_password_appears_in_no_answer(aiohttp_client, tmp_path):
    client = await aiohttp_client(create_app(_gateway(tmp_path, False)))
    auth = {"Authorization": "Bearer sk-test"}
    models = await (await client.get("/v1/models", headers=auth)).text()
    assert "127.0.0.1:9" in models and SECRET not in models and "admin" not in models
    r = await client.post("/v1/chat/completions", headers=auth,
                          json={"model": "front", "messages": [{"role": "user", "content": "hi"}]})
    body = await r.text()
    assert r.status == 502 and "unreachable" in body, body
    assert SECRET not in body and "admin" not in body


def test_redact_drops_user_and_password():
    assert redact(f"https://admin:{SECRET}@example.com:8443/v1") == "https://example.com:8443/v1"
    assert redact("http://127.0.0.1:9/v1") == "http://127.0.0.1:9/v1"
