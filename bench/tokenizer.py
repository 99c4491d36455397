"""`cliffguard bench tokenizer`: HF tokenizers vs our TokenCounter (tiktoken path), on one corpus, in one run.

The corpus is built deterministically from a seed: chat-rendered conversations of various lengths (short questions,
multi-turn chats, long pasted documents) whose messages hold prose, Python source from the standard library, JSON,
shell and multilingual Unicode (accents, CJK, emoji, RTL scripts), plus some of the same texts outside a chat. Both
sides encode every text, one call per text, on one thread; each figure is the best of `--repeats` passes. The ids
of both sides are compared text by text, and the run fails (exit 1) if they differ.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import sys
import time
from collections.abc import Callable

_STDLIB_MODULES = ("argparse", "json.decoder", "textwrap", "string", "fractions", "heapq", "bisect", "calendar",
                   "shlex", "difflib", "statistics", "dataclasses")
_PROSE = [
    "The quick brown fox jumps over the lazy dog; it's 5 o'clock and we'll see what they'd say.",
    "Explain why the sky is blue, in two paragraphs, for a curious ten-year-old.",
    "Summarise the following document and list its three main claims with page numbers.",
    "I've attached the logs below. What went wrong between 02:14:07 and 02:15:30 UTC?",
    "Translate to French: 'The meeting moved to Thursday, 10:30, room 4B.'",
]
_UNICODE = [
    "Crème brûlée, naïve façade, Ångström, Straße, Ærøskøbing, São Paulo, Łódź, Dvořák.",
    "日本語のテキストを要約してください。東京は日本の首都です。",
    "请把下面的中文翻译成英文：今天天气很好，我们去公园散步吧。",
    "한국어 문장도 포함합니다. 서울은 대한민국의 수도입니다.",
    "Привет, мир! Это тест токенизатора с кириллицей.",
    "مرحبا بالعالم، هذا اختبار للنص العربي من اليمين إلى اليسار.",
    "שלום עולם, זהו מבחן של טקסט בעברית.",
    "Emoji: 👋🏽 👨\u200d👩\u200d👧\u200d👦 🇫🇷 ❤️ ✨ 🚀🔥💯 and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√∞ ≤ ≥.",
    "Combining marks: e\u0301 a\u0308 n\u0303, Devanagari क्षत्रिय, Thai ภาษาไทย.",
]
_SNIPPETS = [
    '{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "max_tokens": 256}',
    'for f in *.log; do grep -E "ERROR|WARN" "$f" | sort | uniq -c | sort -rn | head -n 20; done',
    "SELECT id, name, created_at FROM users WHERE created_at > '2024-01-01' ORDER BY id DESC LIMIT 100;",
    "2024-05-01T12:00:00Z INFO request_id=8f3a2c latency_ms=1234 status=200 bytes=53421\n" * 3,
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:smollm2-135m-instruct",
                   help="HF model folder, .gguf file or builtin:smollm2-135m-instruct (default)")
    p.add_argument("--corpus-size", type=int, default=400, help="number of texts in the corpus")
    p.add_argument("--repeats", type=int, default=3, help="passes over the corpus per side; the best one counts")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the sampler (default 0)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def make_corpus(tokenizer, corpus_size: int, seed: int) -> list[str]:
    """`corpus_size` texts, deterministic for a seed: ~70% chat-rendered prompts, the rest raw code/prose/Unicode."""
    rng = random.Random(seed)
    sources = [inspect.getsource(__import__(name, fromlist=["_"])) for name in _STDLIB_MODULES]

    def code() -> str:
        source = rng.choice(sources)
        start = rng.randrange(len(source))
        return source[start:start + rng.choice([300, 1500, 6000, 20000])]

    def content() -> str:
        kind = rng.random()
        if kind < 0.35:
            return " ".join(rng.choices(_PROSE, k=rng.randint(1, 6)))
        if kind < 0.6:
            return rng.choice(_PROSE) + "\n\n```python\n" + code() + "\n```"
        if kind < 0.85:
            return " ".join(rng.choices(_UNICODE, k=rng.randint(1, 8)))
        return rng.choice(_PROSE) + "\n" + "\n".join(rng.choices(_SNIPPETS, k=rng.randint(1, 4)))

    corpus = []
    for _ in range(corpus_size):
        if rng.random() < 0.7:
            num_turns = rng.choice([1, 1, 2, 3, 6])
            messages = [{"role": "system", "content": "You are a concise assistant."}] if rng.random() < 0.5 else []
            for turn in range(num_turns):
                messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": content()})
            if messages[-1]["role"] != "user":
                messages.append({"role": "user", "content": content()})
            corpus.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        else:
            corpus.append(content())
    return corpus


def _best_seconds(fn: Callable[[str], object], corpus: list[str], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for text in corpus:
            fn(text)
        best = min(best, time.perf_counter() - started)
    return best


def run(args: argparse.Namespace) -> int:
    from engine.tokenizer import Tokenizer
    from engine.weights import resolve_model
    from pools.tokencount import TokenCounter

    if args.corpus_size < 1 or args.repeats < 1:
        raise ValueError(f"--corpus-size and --repeats must be >= 1, got {args.corpus_size} and {args.repeats}")
    folder = resolve_model(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    started = time.perf_counter()
    counter = TokenCounter(tokenizer)
    build_s = time.perf_counter() - started
    corpus = make_corpus(tokenizer, args.corpus_size, args.seed)
    num_bytes = sum(len(text.encode("utf-8")) for text in corpus)

    def hf_encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    expected = [hf_encode(text) for text in corpus]  # also the warm-up of both sides
    got = [counter.encode(text) for text in corpus]
    mismatches = [i for i, (want, have) in enumerate(zip(expected, got)) if want != have]
    mismatches += [i for i, want in enumerate(expected) if counter.count(corpus[i]) != len(want)]
    num_tokens = sum(map(len, expected))

    sides = {"hf_encode": hf_encode, "counter_encode": counter.encode, "counter_count": counter.count}
    result = {"model": args.model, "backend": counter.backend, "fallback_reason": counter.fallback_reason,
              "counter_build_s": build_s, "num_texts": len(corpus), "num_tokens": num_tokens, "num_bytes": num_bytes,
              "identical": not mismatches, "num_mismatches": len(set(mismatches))}
    for name, fn in sides.items():
        seconds = _best_seconds(fn, corpus, args.repeats)
        result[name] = {"seconds": seconds, "tok_per_s": num_tokens / seconds, "mb_per_s": num_bytes / seconds / 1e6}
    for name in ("counter_encode", "counter_count"):
        result[name]["ratio"] = result["hf_encode"]["seconds"] / result[name]["seconds"]

    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"corpus: {len(corpus)} texts, {num_bytes / 1e6:.2f} MB, {num_tokens} tokens (seed {args.seed}); "
              f"TokenCounter backend {counter.backend}"
              + (f" ({counter.fallback_reason})" if counter.fallback_reason else "")
              + f", built in {build_s:.2f} s; one thread, best of {args.repeats}")
        print(f"{'side':<46} {'tokens/s':>12} {'MB/s':>8} {'vs HF':>7}")
        labels = {"hf_encode": "HF tokenizers  Tokenizer.encode",
                  "counter_encode": f"TokenCounter.encode ({counter.backend})",
                  "counter_count": f"TokenCounter.count ({counter.backend})"}
        for name, label in labels.items():
            r = result[name]
            ratio = f"{r['ratio']:6.2f}x" if "ratio" in r else ""
            print(f"{label:<46} {r['tok_per_s']:12,.0f} {r['mb_per_s']:8.2f} {ratio:>7}")
        print(f"ids and counts identical: {'yes' if not mismatches else 'NO'} "
              f"({len(corpus) - len(set(mismatches))}/{len(corpus)} texts)")
    if mismatches:
        print(f"bench tokenizer: ids differ on {len(set(mismatches))} texts, first: {corpus[mismatches[0]]!r:.200}",
              file=sys.stderr)
        return 1
    return 0
