"""What the gateway shows to whom: /metrics behind the API key with `gateway.metrics_auth`, and an
upstream's password never in an answer (in-process, an upstream-only gateway; nothing listens upstream)."""

from __future__ import annotations

from gateway.app import create_app
from gateway.runtime import Gateway
from gateway.upstream.relay import redact
from pools.config.yaml_file import load_config
from tests.gateway.conftest import chat_pool_yaml, start_gateway

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


def _cache_yaml(model, share: bool) -> str:
    return chat_pool_yaml(model, gateway="{api_keys: [sk-a, sk-b]}", max_model_len=256,
                          extra=f"    share_prefix_cache: {str(share).lower()}\n")


async def test_the_prefix_cache_is_partitioned_per_tenant_unless_the_pool_shares_it(aiohttp_client, tmp_path,
                                                                                     tiny_model):
    prompt = list(range(100, 180))   # 80 token ids: 4 full blocks of 16 can be reused
    for share, hits_for_b in ((False, 0), (True, 64)):
        client, gateway = await start_gateway(aiohttp_client, tmp_path, _cache_yaml(tiny_model, share))
        pool = gateway.pools["chat"]

        async def send(key: str) -> int:
            """The pool's prefix-hit tokens after `key` sent the prompt."""
            r = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": pool.model_name, "prompt": prompt, "max_tokens": 1})
            assert r.status == 200, await r.text()
            return (await pool.client.stats()).pools["chat"].num_prefix_hits

        assert await send("sk-a") == 0
        assert await send("sk-b") == hits_for_b, share       # another tenant: a hit only when shared
        assert await send("sk-a") == hits_for_b + 64          # the same tenant always hits its own
        await client.close()
