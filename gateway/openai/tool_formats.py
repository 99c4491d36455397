"""Which tool-call format a pool's chat template writes: `tool_format` of a template's source, `format_for` of a
pool's tokenizer. The formats: `gateway.openai.tools` (hermes, longcat, llama3_json), `gateway.openai.xml_tools`
(qwen3_xml), `gateway.openai.tagged_tools` (glm45, minimax_m2, seed_oss), `gateway.openai.deepseek_tools`
(deepseek_v3, deepseek_v31), `gateway.openai.dsml_tools` (deepseek_v32), `gateway.openai.mistral_tools` (mistral,
mistral_args), `gateway.openai.kimi_tools` (kimi_k2) and `gateway.openai.gemma4_tools` (gemma4)."""

from __future__ import annotations

from gateway.openai.deepseek_tools import FENCE, DeepseekFormat, writes_deepseek_calls
from gateway.openai.dsml_tools import DsmlFormat, writes_dsml_calls
from gateway.openai.gemma4_tools import Gemma4Format, writes_gemma4_calls
from gateway.openai.kimi_tools import KimiFormat, writes_kimi_calls
from gateway.openai.mistral_tools import mistral_format, writes_mistral_calls
from gateway.openai.tagged_tools import (MINIMAX_FORM, SEED_FORM, TaggedFormat, glm_form, writes_glm_calls,
                                        writes_minimax_calls, writes_seed_calls)
from gateway.openai.tool_specs import Tool
from gateway.openai.tools import HermesFormat, Llama3JsonFormat, LongcatFormat, ToolFormat
from gateway.openai.xml_tools import XmlFormat, writes_xml_calls


def tool_format(template: str, tools: list[Tool]) -> ToolFormat:
    """The format a chat template writes tool calls in (hermes when it writes none we read: `render` asks for it)."""
    return written_format(template, tools) or HermesFormat(tools)


def written_format(template: str, tools: list[Tool]) -> ToolFormat | None:
    """The format a chat template writes tool calls in, where it writes one we read (None: it writes none)."""
    if writes_mistral_calls(template):
        return mistral_format(template, tools)
    if writes_kimi_calls(template):
        return KimiFormat(tools)
    if writes_gemma4_calls(template):
        return Gemma4Format(tools)
    if LongcatFormat.start in template:
        return LongcatFormat(tools)
    if writes_dsml_calls(template):
        return DsmlFormat(tools)
    if writes_glm_calls(template):   # before hermes and the XML form: their calls are inside `<tool_call>` too
        return TaggedFormat(tools, glm_form(compact="\n<arg_key>" not in template))
    if writes_minimax_calls(template):
        return TaggedFormat(tools, MINIMAX_FORM)
    if writes_seed_calls(template):   # before the XML form: its functions' tags are Qwen3-Coder's
        return TaggedFormat(tools, SEED_FORM)
    if writes_deepseek_calls(template):
        return DeepseekFormat(tools, fenced=FENCE in template)
    if writes_xml_calls(template):
        return XmlFormat(tools)
    if "<tool_call>" in template:
        return HermesFormat(tools)
    if '"parameters"' in template and "tools" in template:
        return Llama3JsonFormat(tools)
    return None


def format_for(tokenizer, tools: list[Tool]) -> ToolFormat:
    """The tool-call format of a pool's tokenizer (its chat template)."""
    return tool_format(tokenizer.chat_template_source(use_tools=True), tools)
