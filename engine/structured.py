"""Structured outputs: what a request's output must match, and the grammar that enforces it token by token.

A request names its constraint with a `StructuredOutput` (a JSON object, a JSON schema, or a Lark grammar in
llguidance's dialect: the tool-call formats are written as one). The device worker turns it into a
`GrammarMatcher` per sequence: before each sampled token the matcher writes the set of tokens that keep the
output inside the grammar into a bitmask row, the sampler pushes every other token to -1e30, and the engine
feeds the chosen token back (`accept`). The grammar library is llguidance (docs/PERF.md has the comparison
with xgrammar and outlines-core that chose it): its matchers need no up-front compilation of token masks,
so a new schema costs the first request milliseconds, not the seconds a precomputed automaton can take.

`GrammarCompiler` owns the library's view of the tokenizer and builds matchers off the engine's thread
(GRAMMAR_THREADS of them); a request whose grammar is not ready yet waits outside the scheduler, so a slow
schema never stalls a step. Built grammars are cached by the constraint's hash, least recently used out past
a count and a size. The gateway checks a constraint with `check` (no tokenizer needed) and answers a 400
naming the field before the request reaches a device.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

log = logging.getLogger("cliffguard.engine")

KINDS = ("json_object", "json_schema", "grammar")
GRAMMAR_WAIT_SECONDS = 0.005   # an engine with nothing to run but grammars being built sleeps this long
MAX_SPEC_CHARS = 256 * 1024     # a schema or grammar larger than this is refused (it is compiled per request)
MAX_CACHED_GRAMMARS = 256
# ...and at most this many characters of schema or grammar among them: a built grammar holds about ten bytes
# per character of its source (a 230 KB schema: 2.3 MB), so 256 of the largest would hold 600 MB of the
# worker's memory; these hold about 80 MB
MAX_CACHED_SPEC_CHARS = 8 << 20
MAX_ERROR_CHARS = 500   # of the library's reason a matcher reports (`GrammarMatcher.error`)
GRAMMAR_THREADS = 2   # builds at once: a schema that takes seconds to build does not hold back every other
# How constrained JSON is written (llguidance's JSON compile options; a Lark grammar's %json{...} takes the
# same under "x-guidance").
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# How deep a schema may nest, in JSON levels, following its local `$ref`s: llguidance 1.9 compiles a schema by
# recursion on its thread's stack, and a ~75 KB chain of 1,000 definitions, each referring to the next, overflowed
# it (a segfault, no exception: it took the gateway down); 900 compiled. A request's own JSON nests 64 at most.
MAX_SCHEMA_DEPTH = 256
_INSTANCES = ("enum", "const", "default", "examples", "$defs", "definitions")   # values, or reached by `$ref` only


class SpecTooLarge(ValueError):
    """A schema or grammar past MAX_SPEC_CHARS."""


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. kind "json_object": any JSON object; "json_schema": `spec` is the schema as
    JSON text; "grammar": `spec` is a Lark grammar (llguidance's dialect, `%json{...}` embeds a schema)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output: spec must be a string, got {type(self.spec).__name__}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise SpecTooLarge(f"structured output: at most {MAX_SPEC_CHARS} characters of schema or grammar, "
                             f"got {len(self.spec)}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, lenient: bool = False) -> StructuredOutput:
        """The schema as compact JSON text. Key order is kept: the output writes an object's properties in
        the order the schema lists them (as OpenAI's strict mode does), so a reordered schema is another
        constraint. The schema `true` (any value) is `{}`; `false` (no value) is refused (`grammar_text`).
        `lenient` (a schema not marked strict): keywords the library cannot enforce (`uniqueItems`, `not`, a
        `format` it lacks) are left unenforced, not refused, as OpenAI leaves them. A client's own `x-guidance`
        (the library's options, which would loosen how JSON is written) is dropped."""
        schema = {} if schema is True else schema
        if isinstance(schema, dict):
            schema = {k: v for k, v in schema.items() if k != "x-guidance"} | (
                {"x-guidance": {"lenient": True}} if lenient else {})
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @property
    def key(self) -> str:
        """The cache key: a hash of kind and spec (a lone surrogate, which JSON may carry, hashed as it is:
        the grammar library then refuses it, a 400)."""
        return hashlib.blake2b(f"{self.kind}\0{self.spec}".encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON "top-level grammar" form) for this constraint. JSON is written
        compactly, with json.dumps' separators and no other whitespace: a model that may put whitespace
        anywhere can pad forever (small models do), and every JSON parser reads the compact form."""
        import llguidance

        try:
            self.spec.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"holds a lone surrogate ({self.spec[exc.start]!r}), which is no Unicode text") from None
        if self.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(self.spec)
        if self.spec == "false":
            raise ValueError("the schema false allows no value")
        if self.kind == "json_schema" and (depth := schema_depth(json.loads(self.spec))) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"nests more than {MAX_SCHEMA_DEPTH} levels deep following its $refs ({depth} "
                             "reached): flatten it, or use a recursive $ref (a definition that refers to itself)")
        schema = {"type": "object"} if self.kind == "json_object" else self.spec
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def schema_depth(schema: Any, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """How deep `schema` nests in JSON levels, each `$ref` / `$dynamicRef` followed where it stands (`#`, a JSON
    pointer `#/$defs/x`, an anchor `#name`); a reference back into its own chain (recursion, which the library
    compiles as a rule) counts once. Counting stops past `limit` (so does the walk: a longer chain costs no
    more). ValueError for a reference that is not local (nothing here can follow it, so nothing bounds it)."""
    memo: dict[str, int] = {}   # a reference's depth below where it stands
    active: set[str] = set()
    anchors: dict[str, Any] = {}
    stack = [schema]
    while stack:   # every `$anchor` / `$dynamicAnchor` (a `#name` reference's target), iteratively: any nesting
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(name := node.get(key), str):
                    anchors.setdefault(name, node)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))

    def target(ref: str) -> Any:
        if not ref.startswith("#"):
            raise ValueError(f"$ref {ref[:80]!r}: only a reference within the schema (#, #/$defs/..., #anchor) "
                             "is supported")
        if ref != "#" and not ref.startswith("#/"):
            return anchors.get(ref[1:])
        node = schema
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def depth(node: Any, level: int) -> int:
        if level > limit or not isinstance(node, (dict, list)):
            return level
        if isinstance(node, list):
            return max((depth(item, level + 1) for item in node), default=level + 1)
        deepest = level + 1
        for ref in (node.get("$ref"), node.get("$dynamicRef")):
            if isinstance(ref, str) and ref not in active:
                if ref not in memo and (found := target(ref)) is not None:
                    active.add(ref)
                    memo[ref] = depth(found, level) - level
                    active.discard(ref)
                deepest = max(deepest, level + memo.get(ref, 0))
        for key, value in node.items():
            if key not in _INSTANCES and isinstance(value, (dict, list)):
                deepest = max(deepest, depth(value, level + 1))
        return deepest

    return depth(schema, 0)


def check(constraint: StructuredOutput) -> None:
    """Raise ValueError with the library's reason when it cannot enforce `constraint` (no tokenizer needed)."""
    import llguidance

    try:
        grammar = constraint.grammar_text()
    except (ValueError, TypeError) as exc:
        raise ValueError(str(exc)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error.strip())


class GrammarMatcher:
    """One sequence's position in its grammar. Not thread-safe: the engine's thread uses it, between steps."""

    def __init__(self, matcher: Any, executor: Any) -> None:
        self._matcher = matcher      # llguidance.LLMatcher
        self._executor = executor    # the compiler's llguidance.LLExecutor: fills a batch's rows in parallel

    def accept(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it (the matcher is then in error)."""
        return self._matcher.consume_token(token)

    def advance(self, token: int, request_id: str) -> bool:
        """`accept` the sampled token; True when the output must end here: the grammar is complete (or,
        were the mask ever bypassed, broken: logged)."""
        if not self.accept(token) or self.is_stopped:
            if self.error is not None:
                log.warning("request %s: the grammar refused token %d: %s", request_id, token, self.error)
            return True
        return False

    @property
    def is_stopped(self) -> bool:
        """Nothing but end-of-sequence may follow (the output is complete), or the matcher is in error."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """The library's reason, its first line: what follows is its parser's state and the whole grammar
        (13 KB for a schema of 500 properties), which an error message and a log line do without."""
        if not self._matcher.is_error():
            return None
        return (self._matcher.get_error() or "error").split("\n", 1)[0][:MAX_ERROR_CHARS]


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32 on the CPU: bit t % 32 of word t // 32 allows token t."""
    return torch.empty(num_rows, (vocab_size + 31) // 32, dtype=torch.int32)


def fill_bitmask(matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
    """Row i of `bitmask` := the tokens matchers[i] allows next (the rows are computed in parallel)."""
    # bitmask: [len(matchers), num_words] int32, contiguous, CPU
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
    assert bitmask.shape[0] == len(matchers), (bitmask.shape, len(matchers))
    if not matchers:
        return
    matchers[0]._executor.unsafe_compute_mask_ptr([(m._matcher, i) for i, m in enumerate(matchers)],
                                                  bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The bitmask unpacked: [num_rows, vocab_size] bool on `device`, True where the token is allowed
    (ids past the bitmask's words, e.g. a model's padded vocabulary, are not)."""
    words = bitmask.to(device, non_blocking=True)                                     # [num_rows, num_words]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts).bitwise_and_(1).bool().view(words.shape[0], -1)  # [num_rows, 32*words]
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(words.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=device)
    return torch.cat([bits, pad], dim=1)


class GrammarCompiler:
    """Builds grammar matchers for one engine: the library's view of the tokenizer (built on first use,
    about a second for a 50k vocabulary), a cache of built grammars by constraint hash (LRU, at most
    MAX_CACHED_GRAMMARS), and GRAMMAR_THREADS background threads that build them (the library releases the
    GIL), so the engine's step never waits on a new schema, and one schema taking seconds to build (an
    object of thousands of properties) does not hold back the next. Owned by the engine; `submit` and
    `matcher` are called from the engine's thread only. The cache is bounded by count and by the characters
    of the constraints it holds (MAX_CACHED_SPEC_CHARS), the memory of a built grammar following its size."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._source = tokenizer    # read (as tokenizer.json text) on a grammar thread, at the first build
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._thread = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="grammar")
        self._first_use = threading.Lock()   # the builds' first one makes the tokenizer's view
        self._cache: OrderedDict[str, tuple[Future, int]] = OrderedDict()   # key -> (build, spec's characters)
        self._cached_chars = 0
        self._tokenizer = None      # llguidance.LLTokenizer, built on a grammar thread
        self._executor = None       # llguidance.LLExecutor

    def submit(self, constraint: StructuredOutput) -> Future:
        """A future of the built grammar for `constraint` (done at once when cached); its exception is a
        ValueError with the library's reason when the grammar cannot be built."""
        key = constraint.key
        future, chars = self._cache.pop(key, (None, 0))
        self._cached_chars -= chars
        if future is None or (future.done() and future.exception() is not None):   # a failed build is retried
            future = self._thread.submit(self._build, constraint)
        self._cache[key] = (future, len(constraint.spec))
        self._cached_chars += len(constraint.spec)
        while len(self._cache) > 1 and (len(self._cache) > MAX_CACHED_GRAMMARS
                                        or self._cached_chars > MAX_CACHED_SPEC_CHARS):
            self._cached_chars -= self._cache.popitem(last=False)[1][1]
        return future

    @property
    def cached(self) -> tuple[int, int]:
        """(grammars, characters of their constraints) in the cache."""
        return len(self._cache), self._cached_chars

    def matcher(self, built: Any) -> GrammarMatcher:
        """A fresh matcher at the start of a built grammar (a copy: built grammars are shared)."""
        return GrammarMatcher(built.deep_copy(), self._executor)

    def _build(self, constraint: StructuredOutput) -> Any:
        import llguidance

        with self._first_use:
            if self._tokenizer is None:
                self._executor = llguidance.LLExecutor()
                self._tokenizer = llguidance.LLTokenizer(self._source.to_json(), n_vocab=self._vocab_size,
                                                         eos_token=self._eos_token_ids)
        matcher = llguidance.LLMatcher(self._tokenizer, constraint.grammar_text(), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class PendingGrammars:
    """The requests whose grammar is being built, by request id: they wait outside their scheduler.
    The engine's, on its thread."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self._compiler = compiler
        self._futures: dict[str, Future] = {}

    def __bool__(self) -> bool:
        return bool(self._futures)

    def add(self, request_id: str, constraint: StructuredOutput) -> None:
        self._futures[request_id] = self._compiler.submit(constraint)

    def discard(self, request_id: str) -> bool:
        """Forget a request (aborted); True if it was waiting here."""
        return self._futures.pop(request_id, None) is not None

    def ready(self) -> list[tuple[str, Any, str | None]]:
        """(request id, built grammar or None, error or None) of each request whose build ended; they
        leave the waiting room."""
        done = [(rid, f) for rid, f in self._futures.items() if f.done()]
        out = []
        for request_id, future in done:
            del self._futures[request_id]
            error = future.exception()
            out.append((request_id, None if error else future.result(), None if error is None else str(error) or
                        type(error).__name__))
        return out

    def wait(self) -> None:
        """Sleep until a build ends, GRAMMAR_WAIT_SECONDS at most (the engine has nothing else to run)."""
        concurrent.futures.wait(list(self._futures.values()), timeout=GRAMMAR_WAIT_SECONDS,
                                return_when=concurrent.futures.FIRST_COMPLETED)
