"""`cliffguard bench kernels`'s printed report (`print_report`): the result `bench.kernels.run` builds, as tables."""

from __future__ import annotations


def _mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def print_report(r: dict, note: str) -> None:
    """The result as tables; the goals' thresholds and the check's tolerance are the result's own (`r["goals"]`,
    `r["tolerance"]`)."""
    g = r["goals"]
    decode_goal, large_mib = g["decode_goal"], g["large_bytes"] >> 20
    if note:
        print(note)
    latent = " (latent: one plane, K and V alike)" if r["latent"] else ""
    print(f"kernels: {r['backend']} ({r['source']}) on {r['device']}, {r['dtype']}, KV cache {r['kv_dtype']}{latent}; "
          f"{r['num_heads']} query heads, "
          f"{r['num_kv_heads']} KV heads, head_dim {r['head_dim']}, block {r['block_size']}; median of "
          f"{r['iters']} calls")
    print(f"ceilings measured in this run: copy {r['copy_gbps']:.1f} GB/s (dst.copy_(src), read + write), "
          f"matmul {r['matmul_tflops']:.3g} TFLOP/s ({r['dtype']})")
    print(f"check: finite and max |ours - reference| <= {r['tolerance']:g} x max |reference| "
          "(store_kv: equal)")

    kv = "the latent cache read (once: its rows are K and V)" if r["latent"] else "K/V read"
    print(f"\ndecode paged attention (one layer, query length 1, block tables shuffled over "
          f"{r['cache_blocks']} blocks); bytes = {kv} + Q read + O written")
    print(f"{'batch x context':>16} {'check':>5} {'max err':>9} {'ms':>9} {'MB':>9} {'GB/s':>9} {'of copy':>8}")
    for d in r["decode"]:
        print(f"{d['batch']:>6} x {d['context']:<7} {_mark(d['ok']):>5} {d['max_abs_err']:9.2e} {d['ms']:9.3f} "
              f"{d['bytes'] / 1e6:9.1f} {d['gbps']:9.1f} {d['of_copy']:7.1%}{' *' if d['large'] else ''}")
    if not g["judged"]:
        print(f"goal >= {decode_goal:.0%} of copy bandwidth on the large cases: not judged in a dry run")
    elif g["decode_min_of_copy"] is None:
        print(f"goal >= {decode_goal:.0%} of copy bandwidth on the large cases (*, >= {large_mib} MiB "
              "moved): no such case in this run")
    else:
        print(f"goal >= {decode_goal:.0%} of copy bandwidth on the large cases (*, >= {large_mib} MiB "
              f"moved): {'met' if g['decode_met'] else 'NOT met'} (lowest {g['decode_min_of_copy']:.1%})")

    print("\nprefill paged attention (one layer, causal, whole prompt as one chunk, K/V already in the cache) "
          "vs SDPA (is_causal=True, contiguous K/V); x SDPA: our speed over SDPA's (SDPA ms / ours ms)")
    print(f"{'batch x seq_len':>16} {'kernel':>9} {'check':>5} {'max err':>9} {'ours ms':>9} {'TFLOP/s':>8} "
          f"{'SDPA ms':>9} {'TFLOP/s':>8} {'x SDPA':>9} {'of matmul':>9}  SDPA variant")
    for p in r["prefill"]:
        print(f"{p['batch']:>6} x {p['seq_len']:<7} {p['kernel']:>9} {_mark(p['ok']):>5} {p['max_abs_err']:9.2e} "
              f"{p['ms']:9.3f} {p['tflops']:8.2f} {p['sdpa_ms']:9.3f} {p['sdpa_tflops']:8.2f} {p['ratio']:8.2f}x "
              f"{p['of_matmul']:9.1%}  {p['sdpa_variant']}{' *' if p['goal'] else ''}")
    goal = f"goal >= {g['prefill_goal']}x SDPA on the prompts of >= {g['prefill_goal_min_len']} tokens (*)"
    if not g["judged"]:
        print(f"{goal}: not judged in a dry run")
    elif g["prefill_min_ratio"] is None:
        print(f"{goal}: no such case in this run")
    else:
        print(f"{goal}: {'met' if g['prefill_met'] else 'NOT met'} (lowest {g['prefill_min_ratio']:.2f}x)")

    print("\nstore_kv (K/V of the new tokens into shuffled slots); bytes = K/V read + written + slots read")
    print(f"{'seqs x new':>16} {'check':>5} {'ms':>9} {'MB':>9} {'GB/s':>9} {'of copy':>8}")
    for s in r["store_kv"]:
        print(f"{s['num_seqs']:>6} x {s['new_tokens']:<7} {_mark(s['ok']):>5} {s['ms']:9.3f} {s['bytes'] / 1e6:9.2f} "
              f"{s['gbps']:9.1f} {s['of_copy']:7.1%}")
    print(f"\nchecks against kernels.reference: {'all ✓' if r['all_ok'] else 'FAILED (✗ above)'}")
