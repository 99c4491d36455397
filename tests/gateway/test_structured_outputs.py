"""Structured outputs through the unchanged `openai` SDK against a live `cliffguard serve` (builtin SmolLM2):
`chat.completions.parse(response_format=<pydantic model>)` for twenty varied models, whole and streamed, the
json_object mode, completions with a schema, and the 400s for what the grammar library refuses."""

from __future__ import annotations

import asyncio
import enum
import json
from typing import Literal

import aiohttp
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "smollm2-135m-instruct"


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str
    age: int


class Score(BaseModel):
    score: float = Field(ge=0, le=1)
    count: int = Field(ge=1, le=100)


class Sentiment(BaseModel):
    sentiment: Literal["positive", "negative", "neutral"]
    confidence: float


class Tags(BaseModel):
    tags: list[str] = Field(min_length=1, max_length=5)


class Address(BaseModel):
    street: str
    city: str
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    name: str
    address: Address


class Item(BaseModel):
    sku: str
    qty: int = Field(ge=1)


class Order(BaseModel):
    items: list[Item]


class Book(BaseModel):
    title: str
    subtitle: str | None = None
    year: int | None = None


class Flags(BaseModel):
    done: bool
    urgent: bool


class Code(BaseModel):
    code: str = Field(min_length=3, max_length=8)


class Paint(BaseModel):
    colour: Colour
    litres: float = Field(gt=0, le=20)


class Value(BaseModel):
    value: int | str


class Point(BaseModel):
    x: float
    y: float


class Segment(BaseModel):
    a: Point
    b: Point


class Matrix(BaseModel):
    rows: list[list[int]]


class Versioned(BaseModel):
    version: Literal[2]
    level: Literal[1, 2, 3]


class Employee(BaseModel):
    first_name: str
    last_name: str
    age: int = Field(ge=0, le=150)
    emails: list[str]
    role: Literal["admin", "user", "guest"]
    active: bool


class Line(BaseModel):
    description: str
    amount: float


class Invoice(BaseModel):
    number: str = Field(pattern=r"^INV-[0-9]{4}$")
    total: float = Field(ge=0)
    currency: Literal["EUR", "USD", "GBP"]
    lines: list[Line]


class Weather(BaseModel):
    location: str
    unit: Literal["celsius", "fahrenheit"]


class Counts(BaseModel):
    counts: dict[str, int]


class Node(BaseModel):
    label: str
    children: list[Node]


SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (Person, "Describe a person called Ada who is 36."),
    (Score, "Rate this answer between 0 and 1 and count its words: 'blue'."),
    (Sentiment, "How does 'I love this' sound?"),
    (Tags, "Tag a post about serving language models."),
    (Customer, "Make up a customer and their address."),
    (Order, "Order two apples and one pear."),
    (Book, "Name a famous novel."),
    (Flags, "Is the task done? Is it urgent?"),
    (Code, "Invent a short product code."),
    (Paint, "Choose a paint colour and an amount."),
    (Value, "Give me a value."),
    (Segment, "A line from the origin to (3, 4)."),
    (Matrix, "A 2 by 2 identity matrix."),
    (Versioned, "Fill in the version and the level."),
    (Employee, "Describe an employee."),
    (Invoice, "Write an invoice for a cup of tea."),
    (Weather, "Weather in Paris, please."),
    (Counts, "Count the letters of 'abba'."),
    (Node, "A tree with a root and one leaf."),
    (Person, "Who wrote Hamlet? Give name and age at death."),
]


# A 135M model left to itself repeats (an array that never closes, a string of "1111..."): the grammar keeps
# every token valid, but only the model decides to finish. A frequency penalty, as an app using a small model
# would send, lets all twenty finish.
SAMPLING = {"temperature": 0.7, "frequency_penalty": 0.5, "max_tokens": 300}


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": prompt}]


def _assert_all_parsed(choices, schemas=SCHEMAS) -> None:
    """Each choice (one per schema of `schemas`) ended on its own and parsed into its pydantic model."""
    for (model, _), choice in zip(schemas, choices, strict=True):
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, model), (model.__name__, choice.message.content)


@pytest.fixture(scope="module")
def async_sdk(live_builtin_server):
    return lambda: openai.AsyncOpenAI(base_url=live_builtin_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.slow   # ~8 s; every schema's grammar is held to it in tests/engine/test_structured.py, parse above
async def test_parse_returns_a_valid_object_for_twenty_schemas(async_sdk):
    client = async_sdk()

    async def parse(model: type[BaseModel], prompt: str):
        completion = await client.chat.completions.parse(model=MODEL, messages=_messages(prompt),
                                                         response_format=model, **SAMPLING, seed=1)
        return completion.choices[0]

    _assert_all_parsed(await asyncio.gather(*(parse(model, prompt) for model, prompt in SCHEMAS)))


async def test_streamed_parse_gives_valid_objects_for_five_schemas(async_sdk):
    # every fourth of the twenty (the SDK parses each partial object client-side, O(n^2) in the chunks:
    # all twenty took 44 s of the suite); the server's grammars for all twenty are checked non-streamed
    client = async_sdk()

    async def stream(model: type[BaseModel], prompt: str):
        async with client.chat.completions.stream(model=MODEL, messages=_messages(prompt), response_format=model,
                                                  **SAMPLING, seed=5) as events:
            async for _ in events:
                pass
            return (await events.get_final_completion()).choices[0]

    _assert_all_parsed(await asyncio.gather(*(stream(model, prompt) for model, prompt in SCHEMAS[::4])), SCHEMAS[::4])


async def test_json_object_mode_and_completions_with_a_schema(async_sdk):
    client = async_sdk()
    chat = await client.chat.completions.create(model=MODEL, messages=_messages("Describe a cat."), max_tokens=120,
                                                response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    schema = Weather.model_json_schema()
    completion = await client.completions.create(
        model=MODEL, prompt="The weather report as JSON:", max_tokens=60, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}})
    Weather.model_validate_json(completion.choices[0].text)


async def test_what_the_grammar_library_refuses_is_a_400_naming_response_format(async_sdk):
    client = async_sdk()
    broken = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=_messages("x"), max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "broken", "schema": broken}})
    assert info.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=_messages("x"), max_tokens=5,
                                             response_format={"type": "xml"})
    assert info.value.body["param"] == "response_format.type"
    async with aiohttp.ClientSession() as http:   # JSON's escape of a lone surrogate, which no SDK can encode
        async with http.post(f"{client.base_url}chat/completions", data=json.dumps(
                {"model": MODEL, "messages": _messages("x"), "max_tokens": 5, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "s", "schema": {"const": "\ud800"}}}})) as answer:
            error = (await answer.json())["error"]
    assert answer.status == 400 and error["param"] == "response_format" and "lone surrogate" in error["message"]
    for response_format, param in [
            ({"type": "json_schema", "json_schema": {"name": "f", "schema": False}}, "response_format"),
            ({"type": "json_object", "schema": {"type": "object"}}, "response_format.schema"),   # not silently dropped
            ({"type": "text", "strict": True}, "response_format.strict")]:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=_messages("x"), max_tokens=5,
                                                 response_format=response_format)
        assert info.value.body["param"] == param, (response_format, info.value.body)
    any_value = {"type": "json_schema", "json_schema": {"name": "t", "schema": True}}
    anything = await client.chat.completions.create(model=MODEL, messages=_messages("A number."), max_tokens=8,
                                                    temperature=0, response_format=any_value)
    assert anything.choices[0].message.content
    # Past the parser's limits once the output began (500 optional properties: a row of over 2000 items after
    # "{"): an error naming the field, not a 200 'stop' with "{" for an answer. Greedy, the model writes "{";
    # sampled, it may write "{}" (one token), a whole answer that never meets the row.
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=_messages("x"), max_tokens=20, temperature=0,
                                             response_format={"type": "json_schema",
                                                              "json_schema": {"name": "wide", "schema": wide}})
    assert info.value.body["param"] == "response_format" and "max is 2000" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input="x", max_output_tokens=20, temperature=0,   # greedy: "{"
                                      text={"format": {"type": "json_schema", "name": "wide", "schema": wide}})
    assert info.value.body["param"] == "text.format"
    # The server is unharmed: a plain request still works.
    ok = await client.chat.completions.create(model=MODEL, messages=_messages("Hi"), max_tokens=3)
    assert ok.choices[0].message.content


async def test_a_response_echoes_its_text_format_as_asked(async_sdk):
    """The Response's text.format is the request's own (its name, strict and description), not a made-up
    {"name": "response", "strict": true}; text.verbosity is accepted, another key of text is a 400."""
    client = async_sdk()
    asked = {"type": "json_schema", "name": "my_format", "strict": False, "description": "a city",
             "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    response = await client.responses.create(model=MODEL, input="A city as JSON.", max_output_tokens=4,
                                             temperature=0, text={"format": asked, "verbosity": "low"})
    assert response.text.format.model_dump(by_alias=True, exclude_none=True) == asked
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input="x", max_output_tokens=4, text={"bogus": 1})
    assert info.value.body["param"] == "text.bogus"
