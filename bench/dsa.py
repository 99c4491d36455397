"""`cliffguard bench dsa`: one layer of DeepSeek Sparse Attention (DeepSeek V3.2's) decoding, against the same
layer's dense latent attention.

A batch of `--batch` decode tokens, each over `--context` cached tokens of a paged cache whose rows are DeepSeek
V3.2's (a latent of 512, a rotated key of 64, the indexer's key of 128: 704 values), `--heads` query heads (16: 128
over 8 ranks) and an indexer of 64 heads picking `--topk` (2,048) tokens. Timed, each the median of `--repeats`
calls: `dense`, the backend's paged attention over every cached token (the path while no sequence is longer than
`--topk`); `choose`, the indexer's scores and top-k over the whole context; `attend`, the attention over the chosen
tokens alone; `sparse`, the two together, as the engine runs them past `--topk`. Reported: milliseconds, the
sparse path's speed-up over the dense one, and the largest difference of the backend's sparse output from the torch
reference's (`kernels.dsa`) on the same choice (exit 1 past its tolerance: 1e-4 in float32, 2e-2 in bfloat16). On
CUDA the backend is Triton (`kernels.triton_dsa`); on a CPU the torch reference times itself (small sizes:
`--context 4096 --batch 2`). Random rows and queries; the choice a random indexer makes is as costly as a trained
one's.

`--block-sparse`: MiniMax M3's block-sparse layer instead, on a rank of 4 (`--heads` 16 query heads over 2 KV heads of
128, an indexer key of 128 a token, blocks of 128 keys, the best `--topk-blocks` 16 a query): `dense`, the paged
kernels over every cached token (the path within 16 blocks); `sparse`, the block scores, their top-k and the attention
over the chosen blocks (`kernels.triton_block_sparse` on CUDA); the largest difference from `kernels.block_sparse`.

`--qsa`: Qwen4-Exp's QSA layer instead (16 query heads over 2 KV heads of 128, 4 indexer heads of 64, blocks of
`--qsa-ratio` 64 positions, the best `--topk-blocks` a query), over `--batch` decodes or, with `--qsa-chunk N`, one
sequence's chunk of N new tokens ending its `--context`: `dense`, the paged kernels over every cached token; `torch`,
the torch form (`kernels.qsa.qsa_attention_torch`, the CPU's path); `blocks`, the choice as blocks
(`kernels.qsa.qsa_blocks`) and MiniMax M3's kernel over them (`attend_blocks`, the Triton backend only: CUDA's, or the
interpreter's with CLIFFGUARD_ATTENTION_BACKEND=triton), with its largest difference
from the torch form (exit 1 past the tolerance). Beside the times, the aten operators each path dispatches
(`bench.hostcost.OpCounter`: a GPU host's launches, less the Triton kernel's one): `torch_ops`, `choice_ops`
(`qsa_blocks` alone, on any backend) and, on the Triton backend, `blocks_ops`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

from bench.engine import time_call
from bench.options import device_and_dtype

LORA, ROPE, INDEX_DIM, INDEX_HEADS = 512, 64, 128, 64   # DeepSeek V3.2's


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (default: CUDA if present) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, else float32) | float32 | bfloat16")
    p.add_argument("--batch", type=int, default=8, help="decode tokens (sequences) in the step")
    p.add_argument("--context", type=int, default=32768, help="cached tokens of each sequence")
    p.add_argument("--heads", type=int, default=16, help="query heads of this rank (DeepSeek V3.2's 128 over 8)")
    p.add_argument("--topk", type=int, default=2048, help="tokens each query attends to (index_topk)")
    p.add_argument("--block-size", type=int, default=16, help="the paged cache's block size")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per path (median)")
    p.add_argument("--block-sparse", action="store_true", help="MiniMax M3's block-sparse layer instead")
    p.add_argument("--topk-blocks", type=int, default=16,
                   help="with --block-sparse or --qsa: blocks each query attends to (16)")
    p.add_argument("--qsa", action="store_true", help="Qwen4-Exp's QSA layer instead")
    p.add_argument("--qsa-ratio", type=int, default=64, help="with --qsa: positions a block of the indexer (64)")
    p.add_argument("--qsa-chunk", type=int, default=0,
                   help="with --qsa: one sequence's chunk of this many new tokens instead of --batch decodes")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _decode_meta(args: argparse.Namespace, device: torch.device, chunk: int = 0):
    """(metadata of `--batch` decodes over `--context` cached tokens each in shuffled blocks, their block count);
    with `chunk`, one sequence whose last `chunk` tokens are new instead."""
    from kernels import AttentionMetadata

    seqs, new = (1, chunk) if chunk else (args.batch, 1)
    per_seq = -(-args.context // args.block_size)
    blocks = list(range(seqs * per_seq))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(seqs)]
    return AttentionMetadata.build(tables, [new] * seqs, [args.context] * seqs, args.block_size, device), len(blocks)


def _step(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """(metadata, cache, query [B, heads, 576], indexer queries, indexer weights): random rows in shuffled blocks."""
    meta, num_blocks = _decode_meta(args, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    width = LORA + ROPE + INDEX_DIM
    cache = torch.randn(num_blocks, args.block_size, 1, width, generator=gen).to(device, dtype)
    query = (torch.randn(args.batch, args.heads, LORA + ROPE, generator=gen) * 0.1).to(device, dtype)
    index_q = torch.randn(args.batch, INDEX_HEADS, INDEX_DIM, generator=gen).to(device, dtype)
    weights = torch.randn(args.batch, INDEX_HEADS, generator=gen).to(device) * INDEX_HEADS ** -0.5
    return meta, cache, query, index_q, weights


def _block_sparse(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """MiniMax M3's block-sparse layer (`--block-sparse`): its timings and its difference from the torch attention."""
    from kernels import block_sparse, get_backend

    backend, kv_heads, head_dim = get_backend(device), 2, 128
    meta, num_blocks = _decode_meta(args, device)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    k_cache, v_cache = (randn(num_blocks, args.block_size, kv_heads, head_dim) for _ in range(2))
    index_cache, query = randn(num_blocks, args.block_size, 1, head_dim), randn(args.batch, args.heads, head_dim)
    index_q = randn(args.batch, kv_heads, head_dim)
    attend = getattr(backend, "block_sparse_attention", block_sparse.block_sparse_attention)
    pick = dict(block_size=128, topk_blocks=args.topk_blocks, local_blocks=1)
    scale = head_dim ** -0.5
    with torch.no_grad():
        out = attend(query, k_cache, v_cache, index_q, index_cache, meta, scale, **pick)
        reference = block_sparse.block_sparse_attention(query, k_cache, v_cache, index_q, index_cache, meta, scale,
                                                        **pick)
        timed = {"dense": lambda: backend.paged_attention(query, k_cache, v_cache, meta, scale, None),
                 "sparse": lambda: attend(query, k_cache, v_cache, index_q, index_cache, meta, scale, **pick)}
        row = {f"{name}_ms": statistics.median(time_call(call, device, iters=args.repeats)) * 1e3
               for name, call in timed.items()}
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "backend": backend.__name__,
            "model": "minimax-m3", "batch": args.batch, "context": args.context, "heads": args.heads,
            "topk_blocks": args.topk_blocks, **row, "sparse_speedup": row["dense_ms"] / row["sparse_ms"],
            "max_abs_diff": float((out.float() - reference.float()).abs().max()),
            "tolerance": 1e-4 if dtype == torch.float32 else 2e-2}


def _qsa(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """Qwen4-Exp's QSA layer (`--qsa`): each path's time and aten operators, the kernels' difference from the torch
    form."""
    from bench.hostcost import OpCounter
    from kernels import get_backend, qsa

    backend, (heads, kv_heads, head_dim, index_heads, index_dim) = get_backend(device), (args.heads, 2, 128, 4, 64)
    meta, num_blocks = _decode_meta(args, device, args.qsa_chunk)
    gen, tokens = torch.Generator(device="cpu").manual_seed(0), sum(meta.query_lens_list)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(device, dtype)

    k_cache, v_cache = (randn(num_blocks, args.block_size, kv_heads, head_dim) for _ in range(2))
    index_cache, query = randn(num_blocks, args.block_size, 1, index_dim), randn(tokens, heads, head_dim)
    inputs = (query, k_cache, v_cache, randn(tokens, index_heads, index_dim), index_cache, meta, head_dim ** -0.5)
    select = dict(ratio=args.qsa_ratio, topk_blocks=args.topk_blocks, key_norm=(randn(index_dim, std=0.1), 1e-6),
                  cos_sin_cache=randn(args.context, index_dim), rotary_dim=index_dim)
    paths = {"dense": lambda: backend.paged_attention(query, k_cache, v_cache, meta, inputs[-1], None),
             "torch": lambda: qsa.qsa_attention_torch(*inputs, **select),
             "choice": lambda: qsa.qsa_blocks(*inputs[3:6], **select)}
    if backend.__name__ == "kernels.triton_attention":   # CUDA's path (on a CPU, the interpreter's: exact, not fast)
        from kernels.triton_block_sparse import attend_blocks

        def blocks():
            chosen, keep = qsa.qsa_blocks(*inputs[3:6], **select)
            return attend_blocks(*inputs[:3], chosen, keep, meta, inputs[-1], block_size=args.qsa_ratio)
        paths["blocks"] = blocks
    row = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "backend": backend.__name__,
           "model": "qwen4-exp", "batch": len(meta.seq_lens_list), "new_tokens": tokens, "context": args.context,
           "heads": heads, "ratio": args.qsa_ratio, "topk_blocks": args.topk_blocks}
    with torch.no_grad():
        for name, call in paths.items():
            row[f"{name}_ms"] = statistics.median(time_call(call, device, iters=args.repeats)) * 1e3
            with OpCounter() as counter:
                call()
            row[f"{name}_ops"] = counter.count
        if "blocks" in paths:
            row["sparse_speedup"] = row["dense_ms"] / row["blocks_ms"]
            row["torch_speedup"] = row["torch_ms"] / row["blocks_ms"]
        diff = (paths["blocks"]().float() - paths["torch"]().float()).abs().max() if "blocks" in paths else None
    row["max_abs_diff"] = None if diff is None else float(diff)
    row["tolerance"] = 1e-4 if dtype == torch.float32 else 2e-2
    return row


def run(args: argparse.Namespace) -> int:
    for name in ("batch", "context", "heads", "topk", "block_size", "repeats", "topk_blocks", "qsa_ratio"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.qsa_chunk < 0 or args.qsa_chunk >= args.context:
        raise ValueError(f"--qsa-chunk: must be >= 0 and below --context ({args.context}), got {args.qsa_chunk}")
    if args.qsa and args.block_sparse:
        raise ValueError("--qsa: one layer at a time, not with --block-sparse")
    device, dtype = device_and_dtype(args.device, args.dtype)
    row = (_qsa if args.qsa else _block_sparse if args.block_sparse else _dsa)(args, device, dtype)
    print(json.dumps(row) if args.json else "\n".join(f"{key:16} {value}" for key, value in row.items()))
    off = row["max_abs_diff"] is not None and row["max_abs_diff"] > row["tolerance"]
    return 1 if off else 0   # the backend's kernels off the reference


def _dsa(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """DeepSeek V3.2's layer: its timings and its sparse output's difference from the torch reference."""
    from kernels import dsa, get_backend

    backend = get_backend(device)
    choose = getattr(backend, "dsa_choose_tokens", dsa.choose_tokens)
    attend = getattr(backend, "dsa_attend_chosen", dsa.attend_chosen)
    meta, cache, query, index_q, weights = _step(args, device, dtype)
    scale, latent = (LORA + ROPE) ** -0.5, LORA + ROPE
    padded = torch.nn.functional.pad(query, (0, INDEX_DIM))
    with torch.no_grad():
        choice = choose(index_q, weights, cache, meta, args.topk, latent, index_scale=INDEX_DIM ** -0.5)
        out = attend(query, choice, cache, meta, scale, LORA, latent)
        reference = dsa.attend_chosen(query, choice, cache, meta, scale, LORA, latent)
        timed = {"dense": lambda: backend.paged_attention(padded, cache, cache, meta, scale, None),
                 "choose": lambda: choose(index_q, weights, cache, meta, args.topk, latent,
                                          index_scale=INDEX_DIM ** -0.5),
                 "attend": lambda: attend(query, choice, cache, meta, scale, LORA, latent)}
        row = {name: statistics.median(time_call(call, device, iters=args.repeats)) * 1e3
               for name, call in timed.items()}
    row = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "backend": backend.__name__,
           "batch": args.batch, "context": args.context, "heads": args.heads, "topk": args.topk,
           **{f"{name}_ms": ms for name, ms in row.items()}}
    row["sparse_ms"] = row["choose_ms"] + row["attend_ms"]
    row["sparse_speedup"] = row["dense_ms"] / row["sparse_ms"]
    row["max_abs_diff"] = float((out.float() - reference.float()).abs().max())
    row["tolerance"] = 1e-4 if dtype == torch.float32 else 2e-2
    return row
