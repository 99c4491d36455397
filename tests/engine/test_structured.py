"""Structured outputs in the engine: the constraint, the bitmask, and generation that always matches its schema.

The outputs are validated by the jsonschema package, a validator nobody here wrote.
"""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
import torch

from bench.schemas import SCHEMAS
from engine.model_config import ModelConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine import structured
from engine.structured import StructuredOutput, allowed_tokens, check
from tests.conftest import assert_all_free


def _engine(path, **kwargs) -> LLMEngine:
    block_bytes = ModelConfig.from_folder(path).kv_bytes_per_token(torch.float32) * 16
    kwargs.setdefault("dtype", "float32")   # the tests' expected tokens are float32's (a CPU's auto may differ)
    return LLMEngine.from_args(str(path), progress=False, num_blocks=(64 << 20) // block_bytes, **kwargs)


@pytest.fixture(scope="module")
def engine(builtin_path):
    return _engine(builtin_path)


def _chat(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "system", "content": "Answer in JSON."},
                                         {"role": "user", "content": text}])


def _assert_matches(schema: dict, text: str) -> None:
    """`text` is JSON valid under `schema`, by the jsonschema package (formats not asserted, as by default)."""
    jsonschema.validate(json.loads(text), schema)


# --- the constraint and the bitmask ----------------------------------------------------------------

def test_equal_schemas_share_one_key_and_bad_constraints_name_the_problem() -> None:
    a = StructuredOutput.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutput.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    assert a == b and a.key == b.key
    reordered = StructuredOutput.json_schema({"type": "object", "properties": {"y": {}, "x": {}}})
    assert reordered.key != StructuredOutput.json_schema({"type": "object", "properties": {"x": {}, "y": {}}}).key
    assert a.key != StructuredOutput("json_object").key
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("xml")
    with pytest.raises(ValueError, match="at most"):
        StructuredOutput("grammar", "x" * (1 << 20))


@pytest.mark.parametrize("constraint", [
    StructuredOutput.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}),
    StructuredOutput.json_schema({"type": "frobnicate"}),
    StructuredOutput("grammar", "start: undefined_rule"),
])
def test_check_refuses_what_the_library_cannot_build(constraint) -> None:
    with pytest.raises(ValueError) as info:
        check(constraint)
    assert str(info.value)


def _chain(n: int) -> dict:
    """A schema of `n` definitions, each an object whose one property refers to the next."""
    defs = {f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}}} for i in range(n)}
    defs[f"a{n}"] = {"type": "string"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}, "$defs": defs}


def test_a_schema_nested_past_the_librarys_stack_through_its_refs_is_refused_not_compiled() -> None:
    """1,000 definitions chained by $ref (75 KB, a body of 9 levels) segfaulted llguidance's compile, and the
    gateway with it; refused by depth (through the refs) before the library sees it. Recursion and a chain of 100
    (203 levels) compile."""
    from engine.structured import MAX_SCHEMA_DEPTH, schema_depth

    for lenient in (False, True):
        with pytest.raises(ValueError, match=f"nests more than {MAX_SCHEMA_DEPTH} levels deep following its \\$refs"):
            check(StructuredOutput.json_schema(_chain(1000), lenient=lenient))
    assert schema_depth(_chain(100)) == 203 and schema_depth(_chain(5000)) == MAX_SCHEMA_DEPTH + 1
    check(StructuredOutput.json_schema(_chain(100)))
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    assert schema_depth(tree) < 10   # its recursion counted once
    check(StructuredOutput.json_schema(tree))
    anchored = {f"a{i}": {"$anchor": f"n{i}", "type": "object", "properties": {"x": {"$ref": f"#n{i + 1}"}}}
                for i in range(1000)}   # the same chain through anchors (`#n1`): it segfaulted past the pointers' bound
    anchored["a1000"] = {"$anchor": "n1000", "type": "string"}
    with pytest.raises(ValueError, match="nests more than"):
        check(StructuredOutput.json_schema({"properties": {"x": {"$ref": "#n0"}}, "$defs": anchored}))
    with pytest.raises(ValueError, match=r"\$ref 'other\.json#/x': only a reference within the schema"):
        check(StructuredOutput.json_schema({"properties": {"x": {"$ref": "other.json#/x"}}}))   # not followed
    from gateway.openai.tool_specs import schema_error   # a tool's parameters take the same check

    assert "nests more than" in schema_error(json.dumps(_chain(1000)))


@pytest.mark.parametrize("name, schema, instance", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_check_accepts_the_bench_schemas(name, schema, instance) -> None:
    check(StructuredOutput.json_schema(schema))


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100, 130])
def test_bitmask_unpacks_bit_by_bit(vocab_size: int) -> None:
    words = (min(vocab_size, 96) + 31) // 32          # vocab_size 100, 130: a model vocabulary past the mask
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    got = allowed_tokens(bitmask, vocab_size, torch.device("cpu"))
    assert got.shape == (3, vocab_size) and got.dtype == torch.bool
    for row in range(3):
        for t in range(vocab_size):
            bit = t < 32 * words and (int(bitmask[row, t // 32]) >> (t % 32)) & 1 == 1
            assert bool(got[row, t]) == bit, (row, t)


# --- generation ------------------------------------------------------------------------------------

@pytest.mark.slow   # ~12 s a temperature; the suite's other grammar tests run schemas' rows in a batch, greedy and not
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_schema(engine, temperature) -> None:
    """All twenty bench schemas in one continuous batch, each row masked by its own grammar: every output
    that ends is valid under its schema, and one cut by max_tokens is still a prefix its grammar accepts
    (a 135M model can repeat inside a string until the limit: the grammar cannot make it stop)."""
    prompts = [_chat(engine, f"Give an example of {name.replace('_', ' ')}.") for name, _, _ in SCHEMAS]
    constraints = [StructuredOutput.json_schema(schema) for _, schema, _ in SCHEMAS]
    params = [SamplingParams(temperature=temperature, seed=7, max_tokens=160, frequency_penalty=0.5, structured=c)
              for c in constraints]
    outs = engine.generate(prompts, params)
    num_stopped = 0
    for (name, schema, _), constraint, out in zip(SCHEMAS, constraints, outs):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            _assert_matches(schema, completion.text)
            num_stopped += 1
        else:
            assert completion.finish_reason == "length", (name, completion.finish_reason)
            matcher = engine.grammars.matcher(engine.grammars.submit(constraint).result())
            assert all(matcher.accept(t) for t in completion.token_ids), (name, completion.text)
    assert num_stopped >= 15, num_stopped
    assert_all_free(engine)


def test_a_grammar_rows_logprobs_are_of_the_tokens_it_allows(engine) -> None:
    """A grammar row's logprobs come from the logits its grammar masked, as vLLM's do: greedy, the best of
    its top logprobs is the token chosen at every step (the raw logits listed tokens the grammar forbids
    above it, and reported a forced '{' as unlikely)."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    out = engine.generate([_chat(engine, "Describe a person.")], SamplingParams(
        temperature=0, max_tokens=24, logprobs=3, structured=StructuredOutput.json_schema(schema)))[0].outputs[0]
    assert out.top_logprobs and all(top[0][0] == token for token, top in zip(out.token_ids, out.top_logprobs))
    assert all(lp == top[0][1] for lp, top in zip(out.logprobs, out.top_logprobs))
    # where the grammar allows fewer tokens than asked ('{' first, then '"name"'), the forbidden ones are not
    # listed as alternatives with a logprob of -1e30: the list is shorter
    assert all(value > -1e4 for top in out.top_logprobs for _, value in top)
    assert min(len(top) for top in out.top_logprobs) < 3


def test_json_object_and_unconstrained_rows_share_a_batch(engine) -> None:
    prompt = _chat(engine, "Describe a cat.")
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = engine.generate([prompt], plain)[0].outputs[0].token_ids
    outs = engine.generate([prompt, prompt], [plain, SamplingParams(temperature=0, max_tokens=120,
                                                                     structured=StructuredOutput("json_object"))])
    assert outs[0].outputs[0].token_ids == alone        # the grammar row does not touch its neighbour
    assert isinstance(json.loads(outs[1].outputs[0].text), dict)


def test_a_grammar_complete_on_eos_adds_no_eos_text_whatever_else_is_asked(engine) -> None:
    """The EOS that completes a grammar ends the sequence as a stop token: its text (shown with
    skip_special_tokens off) is not the answer's unless include_stop_str_in_output, with min_tokens (which a
    grammar row does not wait for) or ignore_eos too; its id is kept."""
    prompt = _chat(engine, "How many legs does a cat have? Answer with a number.")
    grammar = StructuredOutput("grammar", 'start: "4" | "4 legs"')
    for extra, shown in (({}, False), ({"min_tokens": 3}, False), ({"ignore_eos": True}, False),
                         ({"include_stop_str_in_output": True}, True)):
        params = SamplingParams(temperature=0, max_tokens=40, structured=grammar, skip_special_tokens=False, **extra)
        out = engine.generate([prompt], params)[0].outputs[0]
        eos = out.token_ids[-1]
        assert out.finish_reason == "stop" and eos in engine.eos_token_ids, extra
        assert out.text.startswith("4") and out.text.endswith(engine.tokenizer.decode([eos], False)) == shown, extra


def test_a_token_that_completes_the_grammar_is_checked_for_stop_strings(engine) -> None:
    """A grammar completes on its last text token (nothing but EOS may follow): that token's text is checked
    for stop strings as any other's (its "}" was kept, stop_reason None)."""
    prompt = _chat(engine, "Give a JSON object with a set to 1.")
    schema = {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"], "additionalProperties": False}
    for stop, include, text in ((["}"], False, '{"a": 1'), (["}"], True, '{"a": 1}'), ([": 1}"], False, '{"a"')):
        params = SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput.json_schema(schema),
                                stop=stop, include_stop_str_in_output=include)
        out = engine.generate([prompt], params)[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", stop[0]), (stop, out)


def test_n_samples_each_follow_their_own_grammar(engine) -> None:
    """n samples fork after the prefill; each carries its own matcher from the grammar's start."""
    schema = dict(SCHEMAS[0][1])
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=60, frequency_penalty=0.5,
                            structured=StructuredOutput.json_schema(schema))
    out = engine.generate([_chat(engine, "Describe a person.")], params)[0]
    assert len(out.outputs) == 4 and len({s.text for s in out.outputs}) > 1
    for sample in out.outputs:
        assert sample.finish_reason == "stop", sample.text
        _assert_matches(schema, sample.text)


def test_the_grammar_cache_is_bounded_by_the_size_of_its_schemas(engine, monkeypatch) -> None:
    """Distinct large schemas evict the least recently used once their characters pass the bound (a built
    grammar's memory follows its schema's size), whatever their count; a recent one is still a hit, an
    evicted one is built again."""
    monkeypatch.setattr(structured, "MAX_CACHED_SPEC_CHARS", 4000)
    compiler = structured.GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, [0])
    builds = []
    build = compiler._build
    monkeypatch.setattr(compiler, "_build", lambda c: (builds.append(c), build(c))[1])
    schemas = [StructuredOutput.json_schema({"type": "object", "properties": {
        f"s{i}_{k}": {"type": "string", "description": "x" * 80} for k in range(10)}}) for i in range(8)]
    assert all(1000 < len(s.spec) < 1400 for s in schemas)
    futures = [compiler.submit(s) for s in schemas]
    assert all(f.result(60) is not None for f in futures)
    count, chars = compiler.cached
    assert chars <= 4000 and count == 3, compiler.cached      # 8 schemas asked, far under the count bound
    assert compiler.submit(schemas[-1]) is futures[-1]          # a hit
    assert compiler.submit(schemas[0]) is not futures[0]        # evicted by size: built anew
    assert compiler.submit(schemas[0]).result(60) is not None and len(builds) == 9
    compiler.close()


def _engine_with_held_builds(builtin_path, monkeypatch) -> tuple[LLMEngine, threading.Event]:
    """An engine whose grammar builds wait until the returned event is set."""
    engine = _engine(builtin_path)
    release = threading.Event()
    build = engine.grammars._build
    monkeypatch.setattr(engine.grammars, "_build", lambda c: (release.wait(30), build(c))[1])
    return engine, release


def test_a_grammar_being_built_holds_its_request_only(builtin_path, monkeypatch) -> None:
    """While a request's grammar builds, the engine steps the others; the request joins once it is built."""
    engine, release = _engine_with_held_builds(builtin_path, monkeypatch)
    prompt = _chat(engine, "Name a colour.")
    engine.add_request("json", prompt, SamplingParams(temperature=0, max_tokens=60,
                                                      structured=StructuredOutput("json_object")))
    engine.add_request("plain", prompt, SamplingParams(temperature=0, max_tokens=8))
    finished = {}
    while "plain" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "json" not in finished and "json" in engine.requests      # the plain one ran while json waited
    release.set()
    while "json" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert isinstance(json.loads(finished["json"].outputs[0].text), dict)
    assert_all_free(engine)


def test_a_slow_grammar_build_does_not_hold_back_another(builtin_path, monkeypatch) -> None:
    """Two builds run at once (GRAMMAR_THREADS): while one schema's build takes long, another schema's
    request is built, runs and finishes (one build thread queued it behind the slow one)."""
    engine = _engine(builtin_path)
    release, build = threading.Event(), engine.grammars._build
    slow = StructuredOutput.json_schema({"type": "object", "properties": {"slow": {"type": "integer"}}})
    monkeypatch.setattr(engine.grammars, "_build", lambda c: (c == slow and release.wait(30), build(c))[1])
    prompt = _chat(engine, "Name a colour.")
    engine.add_request("slow", prompt, SamplingParams(temperature=0, max_tokens=20, structured=slow))
    engine.add_request("quick", prompt, SamplingParams(temperature=0, max_tokens=20,
                                                       structured=StructuredOutput("json_object")))
    finished = {}
    while "quick" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "slow" not in finished and not release.is_set()
    release.set()
    while "slow" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert_all_free(engine)


def test_abort_and_failure_while_the_grammar_builds(builtin_path, monkeypatch) -> None:
    engine, release = _engine_with_held_builds(builtin_path, monkeypatch)
    prompt = _chat(engine, "x")
    engine.add_request("a", prompt, SamplingParams(max_tokens=5, structured=StructuredOutput("json_object")))
    out = engine.abort("a")
    assert out.finished and out.outputs[0].finish_reason == "abort" and "a" not in engine.requests
    release.set()
    broken = StructuredOutput.json_schema({"type": "frobnicate"})
    engine.add_request("b", prompt, SamplingParams(max_tokens=5, structured=broken))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "b" and outs[-1].finished and "grammar" in outs[-1].error
    assert_all_free(engine)


def test_a_grammar_that_fails_midway_ends_its_request_with_an_error_not_a_stop(engine) -> None:
    """500 optional properties pass the library's check, but the parser's row limit (2000 items) is passed
    once the object opens: the output ('{' and no more) is not what the schema asks, so the request ends
    with an error naming response_format (it ended 'stop', and the gateway answered it 200)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}
    check(StructuredOutput.json_schema(schema))   # the gateway's check passes it
    params = SamplingParams(temperature=0, max_tokens=20, structured=StructuredOutput.json_schema(schema))
    out = engine.generate([_chat(engine, "Give a JSON object.")], params)[0]
    assert out.error.startswith("response_format: the grammar could not follow the output"), out.error
    assert "max is 2000" in out.error and len(out.outputs[0].token_ids) < 20
    assert len(out.error) < 700 and "<grammar>" not in out.error   # the reason, not the parser's state and grammar
    assert_all_free(engine)
