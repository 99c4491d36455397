"""A pool's own chat template (`chat_template:` in the pool file, a Jinja file beside it): its chats render and count
as transformers renders them with that template, over HTTP (`/tokenize`, and a chat completion's prompt_tokens),
while a pool without one keeps its model folder's; a missing file or a template that does not compile stops the
gateway before it starts, naming the key (and the template's line)."""

from __future__ import annotations

import pytest

from tests.gateway.conftest import start_gateway

TEMPLATE = """{%- for message in messages -%}
[{{ message['role'] | upper }}] {{ message['content'] }}{{ eos_token }}
{% endfor -%}
{%- if add_generation_prompt %}[ASSISTANT] {% endif -%}
"""
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


def _pools(tiny_model, template: str | None) -> str:
    own = f", chat_template: {template}" if template else ""
    return f"""
devices:
  cpu: {{device: cpu, memory: 256MiB, dtype: float32}}
pools:
  - {{name: own, model: {tiny_model}, served_model_name: own, device: cpu, kv_cache_bytes: 128KiB, avg_len: 32,
     max_model_len: 256{own}}}
  - {{name: folder, model: {tiny_model}, served_model_name: folder, device: cpu, kv_cache_bytes: 128KiB, avg_len: 32,
     max_model_len: 256}}
"""


async def test_a_pools_own_template_renders_and_counts_its_chats(aiohttp_client, tmp_path, tiny_model):
    from transformers import AutoTokenizer

    (tmp_path / "brief.jinja").write_text(TEMPLATE)
    client, _ = await start_gateway(aiohttp_client, tmp_path, _pools(tiny_model, "brief.jinja"))   # beside the file
    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    for model, template in (("own", TEMPLATE), ("folder", None)):
        expected = hf.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
        r = await client.post("/tokenize", json={"model": model, "messages": MESSAGES})
        answer = await r.json()
        assert r.status == 200 and answer["tokens"] == expected, (model, answer)
        r = await client.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 2})
        assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] == len(expected)
    assert "[ASSISTANT]" in hf.decode(hf.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=True,
                                                             add_generation_prompt=True, return_dict=False))


@pytest.mark.parametrize("file,text,named", [
    ("absent.jinja", None, r"^pools\[0\]\.chat_template: cannot read .*absent\.jinja"),
    ("broken.jinja", "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}", r"^pools\[0\]\.chat_template: .*"
                                                                                     r"broken\.jinja: line 2: "),
    ("latin1.jinja", b"caf\xe9", r"^pools\[0\]\.chat_template: .*latin1\.jinja is not UTF-8 text"),
])
def test_a_template_the_gateway_cannot_use_is_refused_naming_the_key(tmp_path, tiny_model, file, text, named):
    from gateway.runtime import Gateway
    from pools.config.checks import SpecError
    from pools.config.yaml_file import load_config

    if isinstance(text, bytes):
        (tmp_path / file).write_bytes(text)
    elif text is not None:
        (tmp_path / file).write_text(text)
    (tmp_path / "pools.yaml").write_text(_pools(tiny_model, file))
    with pytest.raises(SpecError, match=named):
        Gateway.from_config(load_config(tmp_path / "pools.yaml"))
