"""The `cliffguard` command: serve, capacity, generate, bench."""

from __future__ import annotations

import argparse
import asyncio
import sys

DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
DEFAULT_CONFIG = "config/pools.yaml"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF model folder, a .gguf file, or builtin:smollm2-135m-instruct (default)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-mib", type=int, default=1024, help="KV cache budget in MiB (capped on CUDA "
                   "by 0.9 x VRAM - weights)")


def _engine_config(args: argparse.Namespace, **pool_kwargs):
    from engine import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig

    cache = CacheConfig(block_size=args.block_size, kv_cache_bytes=args.kv_cache_mib << 20)
    pool = PoolConfig(scheduler=SchedulerConfig(**pool_kwargs))
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, cache=cache, pools=(pool,))


async def _generate(args: argparse.Namespace) -> int:
    from engine import AsyncEngineClient, SamplingParams
    from engine.tokenizer import Tokenizer

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    async with AsyncEngineClient(_engine_config(args)) as client:
        prompt: str | list[int] = args.prompt
        if args.chat:
            tokenizer = Tokenizer.from_folder(client.model_path)
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            prompt = tokenizer.encode_chat(messages)
        async for out in client.generate(prompt, params):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    from gateway.app import run
    from pools.spec import load_config, parse_bytes

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = load_config(args.config)
    vram = parse_bytes(args.vram, "--vram") if args.vram else None
    run(config, host=args.host, port=args.port, vram_bytes=vram)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cliffguard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt with the engine and print it as it streams")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible gateway over the pools of a YAML file")
    serve.add_argument("--config", default=DEFAULT_CONFIG, help=f"pool definitions (default {DEFAULT_CONFIG})")
    serve.add_argument("--host", default=None, help="listen address (default: gateway.host of the file)")
    serve.add_argument("--port", type=int, default=None, help="listen port, 0 for any free one "
                       "(default: gateway.port of the file)")
    serve.add_argument("--vram", default=None, help="plan with this much device memory (e.g. 4GiB) instead "
                       "of the devices' own")

    from pools.capacity import add_arguments as add_capacity

    add_capacity(sub.add_parser("capacity", help="plan each pool's blocks and max_num_seqs (capacity formula)"))

    bench = sub.add_parser("bench", help="benchmarks that print measured ratios")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from bench.engine import add_arguments as add_engine_bench
    from bench.gateway import add_arguments as add_gateway_bench
    from bench.isolation import add_arguments as add_isolation_bench
    from bench.kernels import add_arguments as add_kernels_bench
    from bench.preemption import add_arguments as add_preemption_bench
    from bench.prefill import add_arguments as add_prefill_bench
    from bench.serve import add_arguments as add_serve_bench
    from bench.tokenizer import add_arguments as add_tokenizer_bench

    add_engine_bench(bench_sub.add_parser("engine", help="our engine vs transformers generate, same workload"))
    add_tokenizer_bench(bench_sub.add_parser("tokenizer", help="tiktoken counter vs the HF tokenizer"))
    add_gateway_bench(bench_sub.add_parser("gateway", help="latency the gateway adds, routed requests/s"))
    add_kernels_bench(bench_sub.add_parser("kernels", help="paged attention vs copy bandwidth and SDPA (GPU; "
                                           "--dry-run on CPU)"))
    add_preemption_bench(bench_sub.add_parser("preemption", help="recompute vs swap vs auto across pool-pressure "
                                              "regimes"))
    add_serve_bench(bench_sub.add_parser("serve", help="open-loop load (gamma arrivals, workload classes) against "
                                         "any OpenAI-compatible server: TTFT/ITL/e2e, goodput, /metrics"))
    add_prefill_bench(bench_sub.add_parser("prefill", help="long-prompt prefill: our engine vs transformers' forward"))
    add_isolation_bench(bench_sub.add_parser("isolation", help="chat latency under a rag flood: chat alone, split "
                                             "pools (step composer), one shared pool; the itl_ms trade-off"))

    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return asyncio.run(_generate(args))
        if args.command == "serve":
            return _serve(args)
        if args.command == "capacity":
            from pools.capacity import run

            return run(args)
        if args.command == "bench":
            from importlib import import_module

            return import_module(f"bench.{args.bench}").run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"cliffguard: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
