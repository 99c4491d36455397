"""`cliffguard bench mamba`: one Mamba-1 layer's selective scan over a prefill (Jamba's), the torch recurrence against
the Triton kernel; with `--gated-delta`, a Gated DeltaNet layer's delta rule (Qwen3.5's; `--per-channel`: Kimi Delta
Attention's), the torch chunked form against the Triton kernels (`_gated_delta`); with `--ssd`, a Mamba-2 layer's scan
(Granite 4-H's), and with `--lightning` a lightning attention layer (MiniMax-Text-01's), likewise (`_ssd`,
`_lightning`); with `--mixed-step`, a Gated DeltaNet layer's step of decodes beside prefill chunks, batched against
chunk by chunk and sequence by sequence (`_mixed_step`); with `--pieces N`, N sequences through a Mamba-1 layer one by
one against at once (`_mamba1_pieces`); with `--ple --pieces N`, Qwen4-Exp's PLE layer in an engine's step of N prompts,
their chunks at once against one by one (`_ple`).

For each of `--tokens` (one sequence's new tokens), over `--channels` (8,192: Jamba 1.5 Mini's, `mamba_expand` 2 x
4,096) with a state of `--d-state` (16) each, from a random state: `recurrence`, the torch loop (`kernels.
selective_scan.recurrence`: a few launches a token on CUDA, the CPU's path), and `triton`, the kernel (`kernels.
triton_selective_scan`, one launch) where it runs: on CUDA, or anywhere under `TRITON_INTERPRET=1` (tests). Each
time is the median of `--repeats` calls; reported beside it tokens a second, the kernel's speed-up and its bandwidth
(the bytes it must move: x, dt, B, C read and y written once, the states read and written once) as GB/s, and the
largest difference of its output from the recurrence's (exit 1 past 1e-3, relative to the output's largest value).
Random inputs: the scan's cost does not depend on the values.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics

import torch
import torch.nn.functional as F

from bench.engine import time_call
from bench.options import device_and_dtype


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (default: CUDA if present) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto",
                   help="x, B and C's: auto (bfloat16 where the device computes it natively) | float32 | bfloat16")
    p.add_argument("--tokens", default="1024,4096,16384", help="comma-separated prefill lengths (one sequence's)")
    p.add_argument("--channels", type=int, default=8192, help="the layer's channels (Jamba 1.5 Mini's: 8,192)")
    p.add_argument("--d-state", type=int, default=16, help="the state a channel holds (mamba_d_state)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per path (median)")
    p.add_argument("--json", action="store_true", help="print one JSON object a length")
    p.add_argument("--gated-delta", action="store_true",
                   help="a Gated DeltaNet layer's delta rule instead (Qwen3.5's: --k-heads, --v-heads of --head-dim): "
                        "the torch chunked form against the Triton kernels")
    p.add_argument("--k-heads", type=int, default=16, help="with --gated-delta: key heads (Qwen3.5's 16)")
    p.add_argument("--v-heads", type=int, default=32, help="with --gated-delta: value heads (Qwen3.5's 32)")
    p.add_argument("--head-dim", type=int, default=128, help="with --gated-delta: key and value heads' size")
    p.add_argument("--per-channel", action="store_true",
                   help="with --gated-delta: a decay a key channel, Kimi Delta Attention's (Kimi Linear's 32 heads of "
                        "128: --k-heads 32 --v-heads 32)")
    p.add_argument("--lightning", action="store_true",
                   help="a lightning attention layer instead (MiniMax-Text-01's: --lightning-heads of --head-dim): the "
                        "torch chunked form against the Triton kernel")
    p.add_argument("--lightning-heads", type=int, default=64, help="with --lightning: heads (MiniMax-Text-01's 64)")
    p.add_argument("--ssd", action="store_true",
                   help="a Mamba-2 layer's SSD scan instead (Granite 4-H's: --ssd-heads of --ssd-head-dim, "
                        "--ssd-groups, a state of --ssd-d-state): the torch chunked form against the Triton kernel")
    p.add_argument("--ssd-heads", type=int, default=128, help="with --ssd: heads (Granite-4.0-H-Small's 128)")
    p.add_argument("--ssd-head-dim", type=int, default=64, help="with --ssd: each head's channels (64)")
    p.add_argument("--ssd-groups", type=int, default=1, help="with --ssd: B and C groups (1)")
    p.add_argument("--ssd-d-state", type=int, default=128, help="with --ssd: each channel's state (128)")
    p.add_argument("--mixed-step", action="store_true",
                   help="a Gated DeltaNet layer's step of --decodes one-token pieces beside --prefills chunks of each "
                        "--tokens: the layer's scan (the decodes batched, the chunks at once) against the chunks one "
                        "by one and each sequence scanned alone")
    p.add_argument("--decodes", type=int, default=63, help="with --mixed-step: one-token pieces in the step (63)")
    p.add_argument("--prefills", type=int, default=1, help="with --mixed-step: prefill chunks in the step (1)")
    p.add_argument("--pieces", type=int, default=1,
                   help="Mamba-1 (the default layer): this many sequences of each --tokens scanned one by one and at "
                        "once (`selective_scan.scan_pieces`); with --ple, the prompts of the step")
    p.add_argument("--ple", action="store_true",
                   help="Qwen4-Exp's PLE layer instead (bench/models/qwen4-exp-small, random weights) in a step of "
                        "--pieces prompts of each --tokens: the chunks at once against one by one")
    p.add_argument("--ple-model", default="bench/models/qwen4-exp-small",
                   help="with --ple: a Qwen4-Exp model folder (config.json; its weights made at random)")


def _inputs(tokens: int, channels: int, d_state: int, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, channels, generator=gen).to(device, dtype)
    dt = F.softplus(torch.randn(tokens, channels, generator=gen) - 2.0).to(device)
    A = (-torch.rand(channels, d_state, generator=gen) * 2 - 0.05).to(device)
    B, C = (torch.randn(tokens, d_state, generator=gen).to(device, dtype) for _ in range(2))
    D = torch.randn(channels, generator=gen).to(device)
    ssm = torch.randn(channels, d_state, generator=gen).to(device)
    return x, dt, A, B, C, D, ssm


def run(args: argparse.Namespace) -> int:
    from kernels import selective_scan

    lengths = [int(n) for n in str(args.tokens).split(",") if n.strip()]
    for name, value in (("tokens", min(lengths, default=0)), ("channels", args.channels),
                        ("d_state", args.d_state), ("repeats", args.repeats)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    if getattr(args, "per_channel", False) and not args.gated_delta:
        raise ValueError("--per-channel: goes with --gated-delta")
    device, dtype = device_and_dtype(args.device, args.dtype)
    with_triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if args.gated_delta:
        return _gated_delta(args, lengths, device, dtype, with_triton)
    if args.ssd:
        return _ssd(args, lengths, device, dtype, with_triton)
    if args.lightning:
        return _lightning(args, lengths, device, dtype, with_triton)
    if args.mixed_step:
        return _mixed_step(args, lengths, device, dtype)
    if args.ple:
        return _ple(args, lengths, device, dtype)
    if args.pieces != 1:
        return _mamba1_pieces(args, lengths, device, dtype)
    failed = False
    for tokens in lengths:
        inputs = _inputs(tokens, args.channels, args.d_state, device, dtype)
        row = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
               "channels": args.channels, "d_state": args.d_state}
        moved = tokens * args.channels * (dtype.itemsize + 4 + 4) + 2 * tokens * args.d_state * dtype.itemsize \
            + 3 * args.channels * args.d_state * 4
        failed |= _compare(row, ("recurrence", selective_scan.recurrence),
                           _kernel("triton_selective_scan", "scan", with_triton), inputs, device, args.repeats, moved,
                           1e-3)
        _print(row, args.json)
    return 1 if failed else 0


def _mamba1_pieces(args: argparse.Namespace, lengths: list[int], device: torch.device, dtype: torch.dtype) -> int:
    """`--pieces N`: N sequences of each length through a Mamba-1 layer's scan (`--channels`, `--d-state`), each from
    its own random state, one by one (`scan`, as a step's prefill chunks ran until 2026-12-07) against at once
    (`scan_pieces` in the engine's groups, `StepPieces.groups`: on CUDA one launch; in torch part after part, so on a
    CPU this times the engine's bookkeeping around the scan); the largest difference of their outputs (exit 1 past
    1e-4, relative)."""
    from engine.layers.gated_delta_net import pieces_a_pass
    from kernels import selective_scan
    from kernels.pieces import Pieces

    if args.pieces < 2:
        raise ValueError(f"--pieces: at least 2 sequences to scan at once, got {args.pieces}")
    failed = False
    for tokens in lengths:
        x, dt, A, B, C, D, _ = _inputs(tokens * args.pieces, args.channels, args.d_state, device, dtype)
        ssm = torch.randn(args.pieces, args.channels, args.d_state, device=device)
        pieces, spans = Pieces.whole([tokens] * args.pieces), [slice(i * tokens, (i + 1) * tokens)
                                                               for i in range(args.pieces)]
        groups = pieces.groups(*pieces_a_pass(ssm, device))

        def one_by_one():
            return torch.cat([selective_scan.scan(x[at], dt[at], A, B[at], C[at], D, ssm[i])[0]
                              for i, at in enumerate(spans)])

        def at_once():   # in the engine's groups (all at once on a GPU; on a CPU a cache's worth of states)
            return torch.cat([selective_scan.scan_pieces(x[at], dt[at], A, B[at], C[at], D, ssm[seqs], group)[0]
                              for at, seqs, group in groups])

        row = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
               "pieces": args.pieces, "channels": args.channels, "d_state": args.d_state}
        with torch.no_grad():
            for name, run in (("one_by_one", one_by_one), ("at_once", at_once)):
                row[f"{name}_ms"] = statistics.median(time_call(run, device, iters=args.repeats)) * 1e3
            expected = one_by_one()
            row["speedup"] = row["one_by_one_ms"] / row["at_once_ms"]
            row["max_rel_diff"] = float((at_once() - expected).abs().max() / expected.abs().max())
        failed |= row["max_rel_diff"] > 1e-4
        _print(row, args.json)
    return 1 if failed else 0


def _kernel(module: str, name: str, with_triton: bool):
    """`kernels.<module>.<name>` where the Triton kernels run (CUDA, or the interpreter), else None."""
    return getattr(importlib.import_module(f"kernels.{module}"), name) if with_triton else None


def _compare(row: dict, reference: tuple, kernel, inputs: tuple, device: torch.device, repeats: int, moved: int,
             tolerance: float) -> bool:
    """Time `reference` (its (name, function): `{name}_ms`, its tokens a second) and, where given, `kernel` on
    `inputs` (the median of `repeats` calls each): the kernel's time, tokens a second, speed-up, bandwidth (`moved`
    bytes as GB/s) and largest difference from the reference's output relative to its largest value, into `row`;
    whether that difference is past `tolerance`."""
    name, function = reference
    tokens = row["tokens"]
    with torch.no_grad():
        expected, _ = function(*inputs)
        row[f"{name}_ms"] = statistics.median(time_call(lambda: function(*inputs), device, iters=repeats)) * 1e3
        row[f"{name}_tokens_per_s"] = tokens / row[f"{name}_ms"] * 1e3
        if kernel is None:
            return False
        out, _ = kernel(*inputs)
        row["triton_ms"] = statistics.median(time_call(lambda: kernel(*inputs), device, iters=repeats)) * 1e3
    row["triton_tokens_per_s"] = tokens / row["triton_ms"] * 1e3
    row["triton_speedup"] = row[f"{name}_ms"] / row["triton_ms"]
    row["triton_gb_per_s"] = moved / row["triton_ms"] / 1e6
    row["max_rel_diff"] = float((out - expected).abs().max() / expected.abs().max())
    return row["max_rel_diff"] > tolerance


def _print(row: dict, as_json: bool) -> None:
    print(json.dumps(row) if as_json else "\n".join(f"{key:26} {value}" for key, value in row.items()) + "\n")


def _check_heads(args: argparse.Namespace) -> None:
    """A Gated DeltaNet layer's heads (`--gated-delta`, `--mixed-step`), each bad one named."""
    for name in ("k_heads", "v_heads", "head_dim"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.v_heads % args.k_heads:
        raise ValueError(f"--v-heads: a multiple of --k-heads ({args.k_heads}), got {args.v_heads}")


def _gated_delta(args: argparse.Namespace, lengths: list[int], device: torch.device, dtype: torch.dtype,
                 with_triton: bool) -> int:
    """`--gated-delta`: for each length, one sequence's delta rule from a random state at the layer's shape: the
    torch chunked form (`kernels.gated_delta.chunked_torch`, a handful of launches a chunk of 64) and the Triton
    kernels (`kernels.triton_gated_delta`, two launches) where they run; their times (median), tokens a second, the
    speed-up, the kernels' bandwidth (the bytes they must move, as GB/s) and the largest difference of the kernels'
    output from the torch form's (exit 1 past 1e-2, relative to its largest value: TF32 dots on a 16-bit model's
    inputs). `--per-channel`: a decay a key channel (`chunked_per_channel` against the same kernels')."""
    from kernels import gated_delta
    from kernels.triton_gated_delta import CHUNK

    _check_heads(args)
    failed, per_channel = False, getattr(args, "per_channel", False)
    reference = gated_delta.chunked_per_channel if per_channel else gated_delta.chunked_torch
    for tokens in lengths:
        gen = torch.Generator(device="cpu").manual_seed(0)
        d, hk, hv = args.head_dim, args.k_heads, args.v_heads
        q, k = (torch.randn(tokens, hk, d, generator=gen).to(device, dtype) for _ in range(2))
        v = torch.randn(tokens, hv, d, generator=gen).to(device, dtype)
        decays = d if per_channel else 1   # a token's decays a head
        g = (-torch.rand(tokens, hv, *(d,) * per_channel, generator=gen) * 0.5).to(device)
        beta = torch.rand(tokens, hv, generator=gen).to(device)
        ssm = torch.zeros(hv, d, d, device=device)
        inputs = (q, k, v, g, beta, ssm)
        row = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "k_heads": hk,
               "v_heads": hv, "head_dim": d, "per_channel": per_channel}
        # q, k, v, g and beta read, the output written, the WY form's w, u and decays (and with a decay a channel the
        # causal scores) written and read, the state read and written once
        moved = tokens * (2 * hk * d + hv * d) * dtype.itemsize + tokens * hv * (1 + decays + d) * 4 + \
            2 * tokens * hv * (2 * d + decays + CHUNK * per_channel) * 4 + 2 * hv * d * d * 4
        failed |= _compare(row, ("torch", reference),
                           _kernel("triton_gated_delta", "chunked", with_triton), inputs, device, args.repeats, moved,
                           1e-2)
        _print(row, args.json)
    return 1 if failed else 0


def _ssd(args: argparse.Namespace, lengths: list[int], device: torch.device, dtype: torch.dtype,
         with_triton: bool) -> int:
    """`--ssd`: for each length, one sequence's Mamba-2 scan from a random state at the layer's shape: the torch
    chunked form (`kernels.ssd.chunked_torch`, a handful of launches a chunk of 64) and the Triton kernel
    (`kernels.triton_ssd`, one launch) where it runs; times, tokens a second, speed-up and the largest difference
    (exit 1 past 1e-2 of the output's largest value)."""
    from kernels import ssd

    heads, head_dim, groups, d_state = args.ssd_heads, args.ssd_head_dim, args.ssd_groups, args.ssd_d_state
    for name, value in (("ssd_heads", heads), ("ssd_head_dim", head_dim), ("ssd_groups", groups),
                        ("ssd_d_state", d_state)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    if heads % groups:
        raise ValueError(f"--ssd-heads: a multiple of --ssd-groups ({groups}), got {heads}")
    failed = False
    for tokens in lengths:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(tokens, heads, head_dim, generator=gen).to(device, dtype)
        dt = F.softplus(torch.randn(tokens, heads, generator=gen) - 2.0).to(device)
        A = (-torch.rand(heads, generator=gen) * 4 - 0.1).to(device)
        B, C = (torch.randn(tokens, groups, d_state, generator=gen).to(device, dtype) for _ in range(2))
        D = torch.randn(heads, generator=gen).to(device)
        inputs = (x, dt, A, B, C, D, torch.zeros(heads, head_dim, d_state, device=device))
        row = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "heads": heads,
               "head_dim": head_dim, "groups": groups, "d_state": d_state}
        # x, B and C read, dt read, y written, the state read and written once
        moved = tokens * (heads * head_dim + 2 * groups * d_state) * dtype.itemsize + \
            tokens * heads * (1 + head_dim) * 4 + 2 * heads * head_dim * d_state * 4
        failed |= _compare(row, ("torch", ssd.chunked_torch), _kernel("triton_ssd", "chunked", with_triton), inputs,
                           device, args.repeats, moved, 1e-2)
        _print(row, args.json)
    return 1 if failed else 0


def _lightning(args: argparse.Namespace, lengths: list[int], device: torch.device, dtype: torch.dtype,
               with_triton: bool) -> int:
    """`--lightning`: for each length, one sequence's lightning attention from a random state at the layer's shape
    (`--lightning-heads` of `--head-dim`): the torch chunked form (`kernels.lightning.chunked_torch`) and the Triton
    kernel (`kernels.triton_lightning`, one launch) where it runs; times, tokens a second, speed-up and the largest
    difference (exit 1 past 1e-2 of the output's largest value)."""
    from kernels import lightning

    heads, d = args.lightning_heads, args.head_dim
    for name, value in (("lightning_heads", heads), ("head_dim", d)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    failed = False
    for tokens in lengths:
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(tokens, heads, d, generator=gen).to(device, dtype) for _ in range(3))
        slopes = (torch.rand(heads, generator=gen) * 0.5 + 0.01).to(device)
        inputs = (q, k, v, slopes, torch.zeros(heads, d, d, device=device))
        row = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "heads": heads,
               "head_dim": d}
        # q, k and v read, the output written, the state read and written once
        moved = 3 * tokens * heads * d * dtype.itemsize + tokens * heads * d * 4 + 2 * heads * d * d * 4
        failed |= _compare(row, ("torch", lightning.chunked_torch),
                           _kernel("triton_lightning", "chunked", with_triton), inputs, device, args.repeats, moved,
                           1e-2)
        _print(row, args.json)
    return 1 if failed else 0


def _mixed_step(args: argparse.Namespace, lengths: list[int], device: torch.device, dtype: torch.dtype) -> int:
    """`--mixed-step`: a Gated DeltaNet layer of random weights (`--k-heads`, `--v-heads`, `--head-dim`) in a step of
    `--prefills` prefill chunks of each length (resuming from states) then `--decodes` one-token pieces: its `scan`
    over the step (`step`: the one-token pieces as one batched step, `RecurrentStates.split`, the chunks as one scan,
    `RecurrentStates.pieces`) against the same step with the chunks scanned one by one (`chunks_one_by_one`: the
    layer's path before its chunks were batched, 2026-12-07) and against each sequence's `scan` alone, one after
    another (`alone`: as it ran a step with a prefill in it until 2026-12-07, every decode on its own); the
    projections around the scan left out; the largest difference of their outputs (exit 1 past 1e-3)."""
    from engine.gated_delta_config import GatedDeltaShape
    from engine.layers.gated_delta_net import GatedDeltaNet

    _check_heads(args)
    if args.decodes < 0 or args.prefills < 1 or args.decodes + args.prefills < 2:
        option = "--prefills" if args.prefills < 1 else "--decodes"
        raise ValueError(f"{option}: at least one prefill chunk and two pieces in all, got --prefills "
                         f"{args.prefills} and --decodes {args.decodes}")
    if min(lengths) < 2:
        raise ValueError(f"--tokens: a prefill chunk of at least 2 tokens beside the decodes, got {min(lengths)}")
    shape = GatedDeltaShape(args.k_heads, args.v_heads, args.head_dim, args.head_dim, 4)
    layer = GatedDeltaNet(shape, shape.num_v_heads * shape.v_head_dim, 1e-6, 0).to(device, dtype)
    failed = False
    with torch.no_grad():
        for weight in layer.parameters():
            weight.normal_(0, 0.02)
        for tokens in lengths:
            row = _time_mixed_step(args, layer, tokens, device, dtype)
            failed |= row["max_rel_diff"] > 1e-3
            _print(row, args.json)
    return 1 if failed else 0


def _time_mixed_step(args: argparse.Namespace, layer, tokens: int, device: torch.device, dtype: torch.dtype) -> dict:
    """One row of `--mixed-step`: the three ways over the same step from the same random states, each timed and its
    torch operators counted."""
    from bench.hostcost import OpCounter
    from engine.layers.gated_delta_net import RecurrentStates

    shape = layer.shape
    query_lens = [tokens] * args.prefills + [1] * args.decodes
    seq_lens = [tokens + 64] * args.prefills + [100] * args.decodes
    metas = [_rows_metadata(list(range(i, j)), query_lens[i:j], seq_lens[i:j], device)
             for i, j in [(0, len(query_lens))] + [(i, i + 1) for i in range(len(query_lens))]]
    states = RecurrentStates(shape, 1, dtype, device, len(query_lens))
    start = [t.normal_().clone() for t in (*states.conv, *states.ssm)]   # from random states
    hidden = torch.randn(sum(query_lens), shape.num_v_heads * shape.v_head_dim, device=device, dtype=dtype)
    mixed, _, b, a = layer.in_proj(hidden).split([shape.conv_dim, shape.value_dim, shape.num_v_heads,
                                                  shape.num_v_heads], dim=-1)
    extras = (-layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias), b.sigmoid())
    ends = metas[0].query_start_loc.tolist()   # each sequence's first token, then the step's end

    def together():
        states.for_step(metas[0])
        return layer.scan(mixed, extras, metas[0], states)

    def chunks_one_by_one():
        layer.scans_pieces = False
        try:
            return together()
        finally:
            del layer.scans_pieces

    def alone():
        outs = []
        for meta, i, j in zip(metas[1:], ends, ends[1:]):
            states.for_step(meta)
            outs.append(layer.scan(mixed[i:j], tuple(e[i:j] for e in extras), meta, states))
        return torch.cat(outs)

    row, outs = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                 "prefills": args.prefills, "decodes": args.decodes}, {}
    for name, run in (("alone", alone), ("chunks_one_by_one", chunks_one_by_one), ("step", together)):
        for held, value in zip((*states.conv, *states.ssm), start):
            held.copy_(value)
        outs[name] = run().float()   # from the same states: compared below
        row[f"{name}_ms"] = statistics.median(time_call(run, device, iters=args.repeats)) * 1e3
        with OpCounter() as counter:   # the torch operators of one call (a GPU's launches, less the kernels')
            run()
        row[f"{name}_ops"] = counter.count
    row["speedup"] = row["alone_ms"] / row["step_ms"]
    row["chunks_speedup"] = row["chunks_one_by_one_ms"] / row["step_ms"]
    row["max_rel_diff"] = max(float((outs[name] - outs["alone"]).abs().max() / outs["alone"].abs().max())
                              for name in ("step", "chunks_one_by_one"))
    return row


def _rows_metadata(rows: list[int], query_lens: list[int], seq_lens: list[int], device: torch.device):
    """A step's metadata over `rows` of the persistent batch (one block table each, as long as its sequence)."""
    from kernels import AttentionMetadata

    block = 16
    meta = AttentionMetadata.build([[0] * -(-n // block) for n in seq_lens], query_lens, seq_lens, block, device)
    meta.rows_list, meta.rows = rows, torch.tensor(rows, device=device)
    return meta



def _ple(args: argparse.Namespace, lengths: list[int], device: torch.device, dtype: torch.dtype) -> int:
    """`--ple`: the first PLE layer of Qwen4-Exp's small shape (`--ple-model`, random weights) in an
    engine's prefill step of `--pieces` new prompts of each length: the layer's call on that step with the chunks at
    once (`PleLayer._pieces_at_once`) against one by one (`scans_pieces` off), each from the states the step found
    (`_ple_row`); the largest difference of their outputs (exit 1 past 1e-4, relative)."""
    import tempfile
    from pathlib import Path

    from bench.engine import prepare_model_folder
    from engine.llm_engine import LLMEngine
    from engine.models.qwen4_exp import PleLayer
    from engine.sampling import SamplingParams

    if args.pieces < 2:
        raise ValueError(f"--pieces: with --ple, at least 2 prompts in the step, got {args.pieces}")
    gen, rows = torch.Generator().manual_seed(0), []
    with tempfile.TemporaryDirectory(prefix="cliffguard-bench-") as tmp:
        engine = LLMEngine.from_args(
            prepare_model_folder(args.ple_model, Path(tmp)), device=str(device),
            dtype=str(dtype).removeprefix("torch."), random_weights=True, block_size=16,
            num_blocks=args.pieces * (max(lengths) // 16 + 2), max_num_seqs=args.pieces,
            max_num_batched_tokens=args.pieces * max(lengths), progress=False)
        layer = next(m for m in engine.model.modules() if isinstance(m, PleLayer))
        for tokens in lengths:
            row = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                   "prompts": args.pieces}
            layer.forward = lambda *step, row=row: _ple_row(args, layer, row, device, *step)
            prompts = torch.randint(3, engine.model_config.vocab_size, (args.pieces, tokens), generator=gen).tolist()
            engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
            del layer.forward
            rows.append(row)
            _print(row, args.json)
    return 1 if any(row["max_rel_diff"] > 1e-4 for row in rows) else 0


def _ple_row(args: argparse.Namespace, layer, row: dict, device: torch.device, streams: torch.Tensor,
             input_ids: torch.Tensor, meta, states) -> torch.Tensor:
    """The layer's call in the step (`--ple`): both ways timed and their aten operators counted (a GPU host's
    launches), each from the states as the step found them; the step goes on with the chunks at once."""
    from bench.hostcost import OpCounter

    if len(meta.query_lens_list) != args.pieces:
        raise RuntimeError(f"--ple: the step holds {len(meta.query_lens_list)} prompts, not {args.pieces}")
    held = [t.clone() for t in (states.conv[layer.index], states.ssm[layer.index])]

    def call(at_once: bool) -> torch.Tensor:
        for state, start in zip((states.conv[layer.index], states.ssm[layer.index]), held):
            state.copy_(start)
        layer.scans_pieces = at_once
        try:
            return type(layer).forward(layer, streams, input_ids, meta, states)
        finally:
            del layer.scans_pieces

    outs = {}
    for name, at_once in (("one_by_one", False), ("at_once", True)):
        row[f"{name}_ms"] = statistics.median(time_call(lambda: call(at_once), device, iters=args.repeats)) * 1e3
        with OpCounter() as counter:
            outs[name] = call(at_once)
        row[f"{name}_ops"] = counter.count
    row["speedup"] = row["one_by_one_ms"] / row["at_once_ms"]
    row["max_rel_diff"] = float((outs["at_once"] - outs["one_by_one"]).abs().max() / outs["one_by_one"].abs().max())
    return outs["at_once"]
