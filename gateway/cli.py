"""The `cliffguard` command: serve, capacity, simulate, generate, bench.

Argument parsing, printing and exit codes live here and nowhere else: 0 on success, 2 with one line
`cliffguard <command>: error: ...` on stderr for anything the user can fix (a bad option, an invalid
YAML file, a model that cannot be found, a port in use, a device this machine lacks, a data folder whose
store cannot be read), 130 on Ctrl-C; `serve` stopped by SIGTERM: 0 (`gateway.signals`); a benchmark stopped
by SIGTERM unwinds as on Ctrl-C (130; 143 while a local Ray cluster runs), and exits 1 where what it checks is
wrong (an output that differs, a kernel off its reference).
This module is the only one that imports `bench`; the gateway's app does not.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
from importlib import import_module
from pathlib import Path
from typing import TextIO

from engine.capacity import DEFAULT_BLOCK_SIZE
from gateway.simulate_cli import add_simulate, simulate
from pools.cli_types import (DEFAULT_CONFIG, ArgumentParser, UsageError, check_preset, memory_size, positive_float,
                             positive_int, probability_mass, sampling_seed, temperature)

DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
DEFAULT_DATA_DIR = "./.cliffguard/"
LOCK_FILE = "serve.lock"          # under --data-dir: held by the one server using the folder

BENCHMARKS = {   # command -> help line; `cliffguard bench NAME` is bench.NAME's add_arguments and run
    "engine": "our engine vs transformers generate, same workload",
    "hostcost": "a decode step's host cost: ours vs transformers' forward, ops per layer, by batch and output length",
    "kvcache": "an FP8 KV cache and FP8 weights against the model's dtype (and the model in another dtype): greedy "
               "agreement, log-prob error, bytes per token",
    "fp8": "a layer's projections with FP8 weights (the Triton GEMM on CUDA) vs the same weights in the model's "
           "dtype: time, weight bytes, fraction of copy bandwidth",
    "moe": "one MoE layer's experts (Qwen3-30B-A3B's shape): grouped matmuls vs the loop over the experts hit",
    "dsa": "one layer of DeepSeek V3.2's sparse attention decoding: indexer + chosen tokens vs dense latent attention "
           "(--block-sparse: MiniMax M3's block-sparse layer; --qsa: Qwen4-Exp's QSA, its torch form against the "
           "kernel)",
    "mamba": "one Mamba-1 layer's selective scan over a prefill (Jamba's), or with --gated-delta a Gated DeltaNet "
             "layer's delta rule (Qwen3.5's), with --ssd a Mamba-2 layer's scan (Granite 4-H's), with --lightning "
             "lightning attention (MiniMax's): the Triton kernels vs the torch forms (--ple: Qwen4-Exp's PLE layer, "
             "a step's chunks at once vs one by one)",
    "tokenizer": "tiktoken counter vs the HF tokenizer",
    "gateway": "latency the gateway adds, routed requests/s",
    "kernels": "paged attention vs copy bandwidth and SDPA (GPU; --dry-run on CPU)",
    "preemption": "recompute vs swap vs auto across pool-pressure regimes",
    "serve": "open-loop load (gamma arrivals) on any OpenAI-compatible server: TTFT/ITL/e2e, goodput, /metrics",
    "prefill": "long-prompt prefill: our engine vs transformers' forward",
    "prefix": "conversations sharing a system prompt with prefix caching and without (a state model's kept states)",
    "sliding": "one KV budget, a model with sliding layers: every position kept against a ring a sequence "
               "(sliding_kv): planned sequences, sequences run, output tokens/s, answers compared",
    "admission": "KV credit queue vs reject-when-full (429 + back-off) on one overload: goodput, p99, KV idle, retries",
    "simulate": "cliffguard simulate's predictions (measured step model) against real runs at three rates: "
                "throughput, p50 and p99 TTFT",
    "isolation": "chat latency under a rag flood: chat alone, split pools (step composer), one shared pool; the "
                 "itl_ms trade-off; --sweep: chat's SLO over a grid of loads",
    "structured": "decode tokens/s with and without a JSON schema per batch size",
    "grammars": "grammar libraries installed here: mask time per token at batch 1 and 32, compile time, schemas",
    "replicas": "one replica against N of the same pool file under the same open-loop load (chat, rag, shared "
                "documents): tokens/s, the split of token load, prefix affinity",
    "restart": "a device worker's restart to ready, forked vs spawned (--gateway: a gateway's cold start)",
    "stored": "a Responses conversation kept turn by turn: store bytes against the conversation's own, put/get ms",
    "chaos": "faults (slow readers, disconnects, oversized inputs, kill -9 / STOP of the worker, a 500-connection "
             "burst) under a steady load: lost, duplicated, p99 TTFT, recovery time, RSS",
}


# --- generate ---------------------------------------------------------------------------------------
def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt with the engine and print it as it streams",
                       description="Load a model in a device worker (one pool, planned by the capacity "
                                   "formula) and stream the completion of one prompt to stdout.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF model folder, a .gguf file, or builtin:smollm2-135m-instruct (default)")
    p.add_argument("--device", default="auto", help="auto (default: CUDA if present) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA, float16 before Ampere; on a CPU bfloat16 where it computes it "
                        "natively, else float32) | float32 | bfloat16 | float16")
    p.add_argument("--block-size", type=int, choices=(8, 16, 32), default=DEFAULT_BLOCK_SIZE, help="KV block tokens")
    p.add_argument("--kv-cache-mib", type=positive_int, default=1024,
                   help="KV cache budget in MiB (default 1024); it must fit the device's 0.9 x memory - weights")
    p.add_argument("--max-model-len", type=positive_int, default=None, help="prompt + output limit in tokens (default: "
                   "the model's context); the KV budget must hold one request this long")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--system", default=None, help="system message (implies --chat)")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=temperature, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=probability_mass, default=1.0, help="nucleus sampling mass (default 1: off)")
    p.add_argument("--seed", type=sampling_seed, default=None, help="sampling seed (default: the engine's)")


_GENERATE_FLAGS = {"pools[0].kv_cache_bytes": "--kv-cache-mib", "pools[0].max_model_len": "--max-model-len",
                   "pools[0].block_size": "--block-size", "pools[0].model": "--model",
                   "devices.default.device": "--device", "devices.default.dtype": "--dtype"}


async def _generate(args: argparse.Namespace) -> int:
    from engine.client import AsyncEngineClient
    from engine.sampling import SamplingParams
    from engine.tokenizer import Tokenizer
    from pools.capacity_plan import plan_single_pool
    from pools.config.spec import SpecError

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    try:
        _, config = plan_single_pool(args.model, device=args.device, dtype=args.dtype,
                                     kv_cache_bytes=args.kv_cache_mib << 20, block_size=args.block_size,
                                     max_model_len=args.max_model_len)
    except SpecError as exc:   # the one pool's keys are this command's flags
        message = str(exc)
        for key, flag in _GENERATE_FLAGS.items():
            message = message.replace(key, flag)
        raise SpecError(message) from None
    async with AsyncEngineClient(config) as client:
        prompt: str | list[int] = args.prompt
        if args.chat or args.system is not None:
            tokenizer = Tokenizer.from_folder(client.model_path)
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            prompt = tokenizer.encode_chat(messages)
        async for out in client.generate(prompt, params):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


# --- serve ------------------------------------------------------------------------------------------
def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible gateway over the pools of a YAML file",
                       description="Validate the YAML, plan every pool's blocks and max_num_seqs, check the "
                                   "listen address and the devices, then load the models and serve the OpenAI "
                                   "API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, and the "
                                   "Batch API /v1/files and /v1/batches, durable in --data-dir), /health, "
                                   "/ready, /metrics and /dashboard until interrupted.")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"pool definitions (default {DEFAULT_CONFIG})")
    p.add_argument("--host", default=None, help="listen address (default: gateway.host of the file)")
    p.add_argument("--port", type=int, default=None, help="listen port, 0 for any free one "
                   "(default: gateway.port of the file)")
    p.add_argument("--vram", type=memory_size, default=None,
                   help="plan with this much memory per device (e.g. 4GiB) instead of the devices' own")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="folder for durable state: the Batch API's "
                   f"files, batches and results (SQLite); created if missing; one server per folder (default "
                   f"{DEFAULT_DATA_DIR})")
    p.add_argument("--take-over", action="store_true", help="replace the replicas of another config that run on a "
                   "Ray cluster under this config's device names (YAML gateway.take_over); else such a device fails")


def check_port_free(host: str, port: int) -> None:
    """UsageError when nothing can listen on (host, port): in use, or not an address of this machine (port 0
    too). Checked before any model loads, so the mistake costs a second, not a model load."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port: must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host: cannot resolve {host!r} ({exc.strerror})") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as aiohttp's server does
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise UsageError(f"--host: {host} is not an address of this machine") from None
                reason = ("already in use" if exc.errno == errno.EADDRINUSE
                          else f"cannot be bound ({exc.strerror or exc})")
                raise UsageError(f"--port: {host}:{port} is {reason}; stop what listens there or pass --port "
                                 "(0 picks a free one; `make serve PORT=9000`)") from None


def _serve(args: argparse.Namespace) -> int:
    from engine.client import start_fork_server
    from pools.config.yaml_file import load_config

    config = load_config(args.config)
    config.check_upstream_keys(os.environ)
    config = dataclasses.replace(config, gateway=config.gateway.replace(take_over=True)) if args.take_over else config
    host = args.host or config.gateway.host
    port = config.gateway.port if args.port is None else args.port
    check_port_free(host, port)
    data_dir = make_data_dir(args.data_dir)
    with lock_data_dir(data_dir):
        if config.runs_workers_here:
            start_fork_server()   # the workers' imports run beside the gateway's own start-up, not after it
        from engine.worker import LOG_FORMAT
        from gateway.app import run
        from gateway.browser_guard import loopback

        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        if not config.gateway.api_keys and not loopback(host):
            logging.getLogger("cliffguard.gateway").warning(
                "no API key, listening on %s: whoever reaches it may use every endpoint and read every stored "
                "file and response (a web page a browser there opens too); set gateway.api_keys", host)
        return run(config, host=host, port=port, vram_bytes=args.vram, data_dir=data_dir)



def make_data_dir(path: str) -> Path:
    """The --data-dir folder, created if missing (with a `.gitignore` of `*`, so the default one inside a
    checkout stays out of git); UsageError when it cannot be created or written."""
    folder = Path(path)
    try:
        if not folder.is_dir():
            folder.mkdir(parents=True)
            (folder / ".gitignore").write_text("# cliffguard serve's state (--data-dir)\n*\n")
    except OSError as exc:
        raise UsageError(f"--data-dir: cannot create {path} ({exc.strerror or exc})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--data-dir: {path} is not writable")
    return folder


def lock_data_dir(folder: Path) -> TextIO:
    """An exclusive lock on `folder/serve.lock` (which then holds this process's pid), kept while the
    returned file is open; the kernel drops it when the process dies, however it dies. Two servers on
    one folder would run each other's batches twice, so the second gets a UsageError naming the first."""
    import fcntl

    lock = open(folder / LOCK_FILE, "a+")   # noqa: SIM115 - open for the server's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise UsageError(f"--data-dir: {folder} is in use by another cliffguard serve (pid {holder}); "
                         "give each server its own folder") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


# --- capacity ---------------------------------------------------------------------------------------
def _add_capacity(sub) -> None:
    from engine.roofline import PRESETS

    p = sub.add_parser("capacity", help="plan each pool's blocks and max_num_seqs (capacity formula)",
                       description="Print each device's memory, weights and KV space and each pool's blocks and "
                                   "max_num_seqs = floor(KV bytes / (S_KV x avg_len)), without loading weights; with "
                                   "--rate, whether each device is overloaded at that rate (docs/SIMULATE.md).")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"pools YAML (default: {DEFAULT_CONFIG})")
    p.add_argument("--vram", type=memory_size, default=None,
                   help="memory per GPU for every device, e.g. 80GiB; a device 'auto' is then planned as CUDA "
                        "(bfloat16), and a 'cuda' device can be planned on a machine without one")
    p.add_argument("--model-config", default=None,
                   help="an HF config.json (or a folder holding one) used for every local pool instead of "
                        "resolving each pool's model")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--rate", type=positive_float, default=None, metavar="R",
                   help="also judge each device under R requests/s of --workload: its offered load, overloaded or "
                        "not, the replicas that would carry it (docs/SIMULATE.md \"Overloaded or not\")")
    p.add_argument("--workload", default=None, help="with --rate: workload classes, a YAML file or a name under "
                   "bench/workloads (default: mixed)")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--device", choices=sorted(PRESETS), default=None, help="with --rate: the GPU preset whose "
                       "roofline gives step times, not the plan's memory (default h100; a device planned as cpu "
                       "needs --step-model or an explicit --device)")
    steps.add_argument("--step-model", default=None, metavar="FILE", help="with --rate: a measured step model "
                       "(simulate --calibrate FILE) for every device")


def _capacity(args: argparse.Namespace) -> int:
    import torch

    from pools.capacity_plan import plan_capacity
    from pools.model_configs import resolve_model_configs
    from pools.plan_report import format_plan, format_verdicts, rate_verdicts
    from pools.simulation.runner import upstream_rates
    from pools.config.yaml_file import load_config
    from pools.config.spec import SpecError

    if args.rate is None and (given := next((o for o in ("device", "step_model", "workload") if getattr(args, o)), 0)):
        raise UsageError(f"--{given.replace('_', '-')}: only with --rate")
    config = load_config(args.config)
    if args.vram is None and not torch.cuda.is_available():
        for name, device in config.devices.items():
            if device.device.startswith("cuda") and device.memory_bytes is None and any(
                    p.device == name for p in config.local_pools):   # a memory: size plans without one
                raise SpecError(f"devices.{name}.device: {device.device!r} but this machine has no CUDA device; "
                                "pass --vram (e.g. --vram 80GiB) to plan for one")
    try:
        model_configs = resolve_model_configs(config, args.model_config)
    except SpecError as exc:
        raise SpecError(f"{exc} (or pass --model-config config.json)") from None
    plan = plan_capacity(config, model_configs, vram_bytes=args.vram)
    if args.rate is None:
        print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
        return 0
    workload = args.workload or "mixed"
    check_preset(config, args.device)
    from pools.workload import class_rates, load_workload

    classes = load_workload(workload)
    if all(c.rate is not None for c in classes):
        raise UsageError(f"--rate: every class of workload {workload!r} has a rate of its own, so no request rate "
                         "moves its arrivals (give a class a share; its rates offer "
                         f"{sum(class_rates(classes, 0.0).values()):g} requests/s)")
    offered = sum(class_rates(classes, args.rate).values())   # the share classes' args.rate, and the others' own
    verdicts, unrouted = rate_verdicts(config, plan, model_configs, workload, args.rate, preset=args.device,
                                       step_model=args.step_model)
    upstream = upstream_rates(config, plan, workload, args.rate)
    if args.json:
        print(json.dumps(plan.to_dict() | {"overload": verdicts, "unrouted_rate": unrouted,
                                           "upstream_rates": upstream}, indent=2))
    else:
        own = f" ({args.rate:g} over its share classes, the rest their own rates)" if any(
            c.rate is not None for c in classes) else ""
        print("\n".join([format_plan(plan), "", f"overload at {offered:g} requests/s of {workload}{own}:",
                         *format_verdicts(verdicts, unrouted=unrouted), *(f"upstream pool {name}: {rate:.2f} "
                         "requests/s routed there (on no device's load)" for name, rate in upstream.items())]))
    return 0


# --- bench ------------------------------------------------------------------------------------------
def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print measured ratios",
                           description="Benchmarks: each prints ratios measured side by side in one run.")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, help_line in BENCHMARKS.items():
        import_module(f"bench.{name}").add_arguments(
            bench_sub.add_parser(name, help=help_line, description=help_line[0].upper() + help_line[1:] + "."))


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="cliffguard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_capacity(sub)
    add_simulate(sub)
    _add_bench(sub)
    return parser


def _in_file(exc: BaseException, args: argparse.Namespace) -> str:
    """The error's message, ending with `(in <file>)` where it names a key of the --config file and does not say
    which file yet (the plan's and the model's checks, which run on the config once it is read)."""
    from pools.config.checks import SpecError

    config = getattr(args, "config", None)
    if isinstance(exc, SpecError) and isinstance(config, str) and os.path.isfile(config) and " (in " not in str(exc):
        return f"{exc} (in {config})"
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:   # argparse said why (a bad option: 2) or printed --help (0)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "generate":
            return asyncio.run(_generate(args))
        if args.command == "serve":
            return _serve(args)
        if args.command == "capacity":
            return _capacity(args)
        if args.command == "simulate":
            return simulate(args)
        # a SIGTERM (`timeout`, a CI job's cancel) unwinds a benchmark as Ctrl-C does: the servers, workers and
        # temporary folders it started are stopped and removed (its default ended the process, leaving them)
        main_thread = threading.current_thread() is threading.main_thread()   # (only there may it be set)
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None
        try:
            return import_module(f"bench.{args.bench}").run(args)
        finally:
            if previous is not None:   # (None: a handler set outside Python, which it cannot put back)
                signal.signal(signal.SIGTERM, previous)
    except (UsageError, ValueError, OSError, RuntimeError) as exc:   # OSError: a path that cannot be read
        print(f"cliffguard {args.command}: error: {_in_file(exc, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
