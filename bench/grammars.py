"""`cliffguard bench grammars`: grammar libraries side by side on this machine, with our tokenizer.

For each library installed (llguidance, which cliffguard uses; xgrammar and outlines-core if present), on the
twenty schemas of `bench.schemas`:
- **compile**: time from the schema text to a matcher ready for its first mask (no cache), median and max;
- **support**: schemas it compiles, and whether it then accepts the schema's instance token by token;
- **mask, batch 1**: time per token to fill one row of the allowed-token bitmask, then accept the token,
  walking the instance's tokens (the work a decode step adds to one constrained row);
- **mask, batch 32**: the same for 32 matchers (the twenty schemas, cycled) advancing in lockstep, per step,
  with the library's batched fill where it has one, for as many steps as the longest instance has tokens (a
  row at its instance's end starts it again), so each step has all 32 rows.
All timings are on one process, one after the other; the tokenizer is the model's (`--model`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.schemas import SCHEMAS
from pools.cli_types import positive_int

LIBRARIES = ("llguidance", "xgrammar", "outlines-core")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2-135m-instruct",
                   help="HF model folder, .gguf file or builtin:smollm2-135m-instruct (default)")
    p.add_argument("--libraries", default=",".join(LIBRARIES),
                   help=f"comma-separated, of {', '.join(LIBRARIES)} (those not installed are skipped)")
    p.add_argument("--batch", type=positive_int, default=32, help="matchers advancing together in the batched figure")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


class _Lib:
    """One library behind the four operations the benchmark times."""

    name: str

    def compile(self, schema: str) -> Any: ...            # schema text -> a matcher factory (compiled grammar)
    def matcher(self, compiled: Any) -> Any: ...          # a fresh matcher at the start state
    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None: ...
    def accept(self, matcher: Any, token: int) -> bool: ...

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for row, m in enumerate(matchers):
            self.fill(m, bitmask, row)


class _LLGuidance(_Lib):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import llguidance

        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: str) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])


class _XGrammar(_Lib):
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=True, strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class _OutlinesCore(_Lib):
    name = "outlines-core"

    def __init__(self, token_bytes: list[bytes], eos: int) -> None:
        import outlines_core

        self.oc = outlines_core
        self.eos = eos
        table: dict[bytes, list[int]] = {}
        for token_id, text in enumerate(token_bytes):
            if token_id != eos and text:
                table.setdefault(text, []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(eos, table)

    def compile(self, schema: str) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(schema)
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        matcher.write_mask_into(v.data_ptr(), v.numel(), 4)

    def accept(self, matcher: Any, token: int) -> bool:
        if token == self.eos:
            return True   # its mask allowed end-of-sequence here; its index has no transition for it
        try:
            matcher.advance(token)
        except ValueError:   # outlines-core raises on a token its index has no transition for
            return False
        return True


def _token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's bytes: byte-level BPE symbols mapped back to the bytes they stand for (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    symbol_to_byte = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            symbol_to_byte[chr(256 + extra)] = b
            extra += 1
    out = []
    for token_id in range(vocab_size):
        symbol = tokenizer.id_to_token(token_id) or ""
        if all(c in symbol_to_byte for c in symbol):
            out.append(bytes(symbol_to_byte[c] for c in symbol))
        else:
            out.append(symbol.encode())   # a special token: its text
    return out


def _make_libs(names: list[str], tokenizer, vocab_size: int, eos: int) -> tuple[list[_Lib], list[str]]:
    libs, skipped = [], []
    tokenizer_json = tokenizer.to_json()
    for name in names:
        try:
            if name == "llguidance":
                libs.append(_LLGuidance(tokenizer_json, vocab_size, eos))
            elif name == "xgrammar":
                from transformers import PreTrainedTokenizerFast
                from tokenizers import Tokenizer as RawTokenizer

                hf = PreTrainedTokenizerFast(tokenizer_object=RawTokenizer.from_str(tokenizer_json))
                libs.append(_XGrammar(hf, vocab_size, eos))
            elif name == "outlines-core":
                libs.append(_OutlinesCore(_token_bytes(tokenizer, vocab_size), eos))
            else:
                raise ValueError(f"--libraries: unknown library {name!r}; known: {', '.join(LIBRARIES)}")
        except ImportError as exc:
            skipped.append(f"{name} ({exc})")
    return libs, skipped


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def measure(lib: _Lib, instances: list[tuple[str, str, list[int]]], vocab_size: int, batch: int) -> dict[str, Any]:
    """compile, support, per-token mask time at batch 1 and `batch` for one library."""
    compiled, compile_s, failures = {}, [], {}
    for name, schema, tokens in instances:
        try:
            compiled[name], seconds = _timed(lambda: lib.compile(schema))
            compile_s.append(seconds)
        except Exception as exc:  # noqa: BLE001 - a library's refusal is a finding, not a crash
            failures[name] = f"compile: {type(exc).__name__}: {str(exc)[:120]}"
    bitmask = torch.full((max(batch, 1), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    one_s, num_tokens = 0.0, 0
    for name, _, tokens in instances:
        if name not in compiled:
            continue
        m = lib.matcher(compiled[name])
        started = time.perf_counter()
        for t in tokens:
            num_tokens += 1   # the tokens walked: one the library rejects ends its instance
            lib.fill(m, bitmask, 0)
            allowed = bool((int(bitmask[0, t // 32]) >> (t % 32)) & 1)
            if not allowed or not lib.accept(m, t):
                failures[name] = f"rejected the instance at token {t}"
                break
        one_s += time.perf_counter() - started
    # batch: matchers over the compiled schemas, cycled, each walking its instance, as many steps as the longest
    # has tokens; a row at its instance's end starts it again (untimed), so every step has `batch` rows (the
    # figure covered only the shortest instance's steps, each JSON's opening).
    walkers = [(name, tokens) for name, _, tokens in instances
               if tokens and name in compiled and name not in failures]
    batch_step_s, num_steps = 0.0, 0
    if walkers:
        rows = [walkers[i % len(walkers)] for i in range(batch)]
        matchers = [lib.matcher(compiled[name]) for name, _ in rows]
        positions = [0] * batch
        for _ in range(max(len(tokens) for _, tokens in rows)):
            for i, (name, tokens) in enumerate(rows):
                if positions[i] == len(tokens):
                    matchers[i], positions[i] = lib.matcher(compiled[name]), 0
            started = time.perf_counter()
            lib.fill_batch(matchers, bitmask)
            for i, (m, (_, tokens)) in enumerate(zip(matchers, rows)):
                lib.accept(m, tokens[positions[i]])
            batch_step_s += time.perf_counter() - started
            num_steps += 1
            positions = [p + 1 for p in positions]
    return {
        "library": lib.name, "num_schemas": len(instances), "compiled": len(compiled),
        "accepted": len(compiled) - len([f for f in failures if f in compiled]),
        "compile_ms_median": 1e3 * statistics.median(compile_s) if compile_s else None,
        "compile_ms_max": 1e3 * max(compile_s) if compile_s else None,
        "mask_us_per_token_batch1": 1e6 * one_s / num_tokens if num_tokens else None,
        f"mask_us_per_step_batch{batch}": 1e6 * batch_step_s / num_steps if num_steps else None,
        "failures": failures,
    }


def run(args: argparse.Namespace) -> int:
    from engine.model_config import ModelConfig
    from engine.tokenizer import Tokenizer
    from engine.weights import resolve_model

    folder = resolve_model(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    vocab_size = ModelConfig.from_folder(folder).vocab_size
    eos = sorted(tokenizer.eos_token_ids)[0]
    instances = [(name, json.dumps(schema), tokenizer.encode(json.dumps(instance), add_special_tokens=False) + [eos])
                 for name, schema, instance in SCHEMAS]
    libs, skipped = _make_libs([x.strip() for x in args.libraries.split(",") if x.strip()], tokenizer,
                               vocab_size, eos)
    results = [measure(lib, instances, vocab_size, args.batch) for lib in libs]
    if args.json:
        print(json.dumps({"results": results, "skipped": skipped}, indent=2))
        return 0
    batch_key = f"mask_us_per_step_batch{args.batch}"
    print(f"{'library':<14} {'compiled':>9} {'accepted':>9} {'compile ms (med/max)':>21} "
          f"{'mask us/token b1':>17} {'mask us/step b' + str(args.batch):>18}")
    for r in results:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{r['library']:<14} {r['compiled']:>5}/{r['num_schemas']:<3} {r['accepted']:>5}/{r['num_schemas']:<3} "
              f"{fmt(r['compile_ms_median'], '.1f'):>10}/{fmt(r['compile_ms_max'], '.1f'):<10} "
              f"{fmt(r['mask_us_per_token_batch1'], '.0f'):>17} {fmt(r[batch_key], '.0f'):>18}")
        for name, why in r["failures"].items():
            print(f"    {name}: {why}")
    for s in skipped:
        print(f"skipped: {s}")
    return 0
