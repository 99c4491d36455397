"""What the gateway shows to whom: /metrics behind the API key with `gateway.metrics_auth`, an upstream's
password never in an answer, a gateway without keys closed to other sites' pages and to names rebound to
loopback (in-process, an upstream-only gateway; nothing listens upstream)."""

from __future__ import annotations

from gateway.app import create_app
from gateway.runtime import Gateway
from gateway.upstream.relay import redact
from pools.config.yaml_file import load_config
from tests.gateway.conftest import chat_pool_yaml, start_gateway

SECRET = "s3cr3t-password"


def _gateway(tmp_path, metrics_auth: bool, gateway: str = "api_keys: [sk-test], ") -> Gateway:
    path = tmp_path / "front.yaml"
    path.write_text(f"""
gateway: {{{gateway}metrics_auth: {str(metrics_auth).lower()}}}
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
            return (await pool.client.stats(check=True)).pools["chat"].num_prefix_hits

        assert await send("sk-a") == 0
        assert await send("sk-b") == hits_for_b, share       # another tenant: a hit only when shared
        assert await send("sk-a") == hits_for_b + 64          # the same tenant always hits its own
        await client.close()


async def test_a_gateway_without_keys_refuses_other_sites_pages_and_names_rebound_to_loopback(aiohttp_client,
                                                                                          tmp_path, caplog,
                                                                                          monkeypatch):
    """`gateway.browser_guard`: a cross-site page's simple request (text/plain JSON, no preflight) is refused
    before any work, as is a request over loopback naming a host not of this machine; the gateway's own
    pages, SDKs (no Origin), local names and `allowed_hosts` pass; with API keys the key decides."""
    from gateway import browser_guard

    monkeypatch.setattr(browser_guard, "_WARNED", set())   # the names logged so far in this process
    chat = '{"model": "front", "messages": [{"role": "user", "content": "hi"}]}'
    client = await aiohttp_client(create_app(_gateway(tmp_path, False, gateway="")))
    own = f"http://{client.host}:{client.port}"
    for headers, param in (({"Origin": "http://evil.example"}, "origin"), ({"Origin": "null"}, "origin"),
                           ({"Sec-Fetch-Site": "cross-site"}, "origin"), ({"Sec-Fetch-Site": "same-site"}, "origin"),
                           ({"Host": "evil.example:8000"}, "host"), ({"Host": "evil.example"}, "host")):
        r = await client.post("/v1/chat/completions", data=chat, headers={"Content-Type": "text/plain", **headers})
        assert r.status == 403 and (await r.json())["error"]["param"] == param, headers
        assert (await client.get("/health", headers=headers)).status == 200   # the probes say nothing
    assert (await client.post("/v1/chat/completions", data=chat, headers={"Origin": own})).status == 502  # served
    for host in ("localhost:8000", "LocalHost", "app.localhost", "[::1]:8000", "10.1.2.3:80", "gpu-box.internal"):
        assert (await client.get("/v1/models", headers={"Host": host})).status == 200, host
    assert (await client.get("/v1/models", headers={"Sec-Fetch-Site": "same-origin", "Origin": own})).status == 200
    linked = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}   # a link from another site's page
    assert (await client.get("/dashboard", headers=linked)).status == 200
    behind_tls = {"Sec-Fetch-Site": "same-origin", "Origin": "https://gw.example"}   # a proxy set Host to ours
    assert (await client.get("/v1/models", headers=behind_tls)).status == 200
    assert (await client.get("/v1/models", headers={"Origin": own.replace("http:", "https:")})).status == 200
    for allowed, status in (("[evil.example]", 200), ('["*"]', 200), ("[other.example]", 403),
                            ("['evil.example.:8443']", 200)):
        client = await aiohttp_client(create_app(_gateway(tmp_path, False, gateway=f"allowed_hosts: {allowed}, ")))
        assert (await client.get("/v1/models", headers={"Host": "Evil.Example:8000"})).status == status, allowed
    refused = [r.getMessage() for r in caplog.records if "gateway.allowed_hosts" in r.getMessage()]
    assert len(refused) == 1 and "'evil.example'" in refused[0]   # once a name, however many requests
    client = await aiohttp_client(create_app(_gateway(tmp_path, False)))   # keys: no page knows one
    evil = {"Origin": "http://evil.example", "Host": "evil.example"}
    assert (await client.get("/v1/models", headers=evil)).status == 401


def test_the_names_etc_hosts_gives_a_loopback_address_are_this_machines(tmp_path):
    from gateway.browser_guard import local_name, machine_names

    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost localhost.localdomain localhost4\n127.0.1.1 box.example.org box # FQDN\n"
                     "::1 ip6-localhost ip6-loopback\n10.0.0.5 lan-name\nnot-an-address x\n")
    names = machine_names(hosts)
    assert {"localhost.localdomain", "localhost4", "box.example.org", "box", "ip6-localhost"} <= names
    assert "lan-name" not in names and "x" not in names
    assert local_name("127.0.0.1") and local_name("app.localhost") and not local_name("evil.example")
