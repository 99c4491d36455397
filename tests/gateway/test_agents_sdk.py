"""The OpenAI Agents SDK (`openai-agents`, unpatched) runs a one-tool agent loop against a live
`cliffguard serve` (builtin SmolLM2) through the Responses API: the model calls the tool, the SDK runs
it and sends its result back, the model answers."""

from __future__ import annotations

import pytest

agents = pytest.importorskip("agents")   # the test extra installs it

MODEL = "smollm2-135m-instruct"


async def test_a_one_tool_agent_loop_runs_through_the_responses_api(live_builtin_server) -> None:
    from openai import AsyncOpenAI

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 18 degrees and sunny in {city}."

    client = AsyncOpenAI(base_url=live_builtin_server.url + "/v1", api_key="agents-key", max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Answer with the get_weather tool.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        # the first turn must call the tool; the SDK sets tool_choice back to auto after it ran
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                            max_tokens=200))
    result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4,
                                     run_config=agents.RunConfig(tracing_disabled=True))
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert calls and calls[0]   # the SDK ran our function with the model's argument
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str) and result.final_output
    responses = result.raw_responses
    assert len(responses) >= 2 and all(r.response_id for r in responses)
    # each turn was kept: the SDK's ids are responses the gateway can give back
    kept = await client.responses.retrieve(responses[-1].response_id)
    assert kept.output_text == result.final_output
