#!/usr/bin/env bash
# What a session that is lent a GPU runs there, in one call (the device machine has torch and triton but
# no network, so the project is used from the source tree, not installed). Carry `.gpu`, a folder made
# here with the model folders the benchmarks read (config.json + tokenizer files):
#   mkdir -p .gpu/llama-3-8b && cp bench/models/llama-3-8b/config.json .gpu/llama-3-8b/
#   cp <converted builtin model>/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/llama-3-8b/
#   mkdir -p .gpu/smollm2 && cp <converted builtin model>/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/smollm2/
# (the converted builtin model is the folder under ~/.cache/cliffguard/models/ that `make serve` made). The
# simulate step gives that SmolLM2 shape random weights there (transformers) and validates the simulator on
# a machine whose speed holds still (GPU_STEPS=simulate runs it alone: about 6 minutes, 60 s a rate, as a
# device call is at most 600 s); the isolation
# step runs `bench isolation --sweep --quick` on that model on CUDA, with the SLO the engine derives there;
# the chaos step runs `bench chaos --quick` there on config/pools.yaml's pools (that model, an 8 GiB
# device) with the faults of CHAOS_FAULTS at their full sizes (--quick sizes them for a 2-core CPU); the
# restart step times a CUDA worker's restart, forked and spawned (`bench restart`); the hostcost step runs
# `bench hostcost` on CUDA (the host's share of a decode step of a deep, narrow model, beside transformers);
# (its tokenizer from .gpu/smollm2: the device lacks the builtin's package);
# the engine step runs the 8B shape with decode graphs (the default) and the eager step the same with
# --enforce-eager, the sync step with --async-scheduling off (no overlapped steps); the tests step includes greedy
# output with graphs against without (test_cuda_graphs.py), no stream synchronize in a step's launch (test_overlap.py)
# and the FP8 KV cache's and the MoE layer's kernels on the GPU (test_triton*.py, compiled: TRITON_INTERPRET=0), and
# DeepSeek V4's, HY V4's and Gemma 3n's tiny models on CUDA against transformers (test_engine_vs_hf.py); the
# moe step times the MoE experts' three ways (Triton, grouped matmuls, loop) and in FP8 (GPT-OSS's in MXFP4); the kernels_fp8 step the
# kernels on an FP8 KV cache (its decode bandwidth, in its own bytes), the kernels_mla step on DeepSeek's latent cache
# (one plane read as K and V, head_dim 576, 16 query heads: `bench kernels --latent`), the dsa step DeepSeek V3.2's
# sparse attention (`bench dsa`: the Triton indexer and sparse kernel against the dense latent kernel, 32k and 128k
# contexts), MiniMax M3's block-sparse layer (`--block-sparse`: block scores and the chosen blocks against the dense
# paged kernels) and Qwen4-Exp's QSA (`--qsa`: the choice as blocks and MiniMax M3's kernel against the torch form and
# the dense kernels, decodes and a 512-token chunk), the fp8 step a layer's projections with FP8 weights (`bench fp8`:
# the Triton GEMM against bfloat16's
# F.linear, the weights' fraction of copy bandwidth; with INT4 weights too, `--int4`, and AWQ's zero points,
# `--zero-points`, and INT8 weights, `--int8`, at Qwen3-32B's shape),
# engine_fp8 the 8B engine with them; the sliding step (not a default) one KV budget with every position kept and in
# rings (`bench sliding`: Gemma-3-shaped, and Mistral-shaped with every layer sliding); the kvcache step (not a
# default: it needs real weights, KVCACHE_MODEL, which a device machine cannot be given) an FP8 cache's agreement on
# CUDA. The tests
# step reads the builtin's tokenizer from .gpu/smollm2 (CLIFFGUARD_BUILTIN_DIR: its tiny models take only the
# tokenizer). The device machine lacks msgspec (the worker protocol): carry
# its wheel in `.whl` and install it first (see the device tool's notes). Logs go to $OUT (or ./gpu-out); the last lines printed are a short summary.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
CLI="$PY -m gateway.cli"
# A device call is at most 600 s: the default steps (GPU_STEPS unset) are the first call's; the second call is
# GPU_STEPS="sync eager engine_fp8 hostcost moe kernels_mla dsa mamba", a third (if time is left)
# GPU_STEPS="sliding prefix sparse kernels kernels_warps" (sparse: HY V4's and MiniMax M3's small shapes, whose chat
# prompts and outputs pass their dense regimes of 64 and 32 tokens, through `bench engine` with decode graphs and with
# --enforce-eager; kernels_warps: `bench kernels` with the paged kernel on 8 warps, beside kernels' run on the same
# machine: at head_dim 128 its decode tile spills on 4).
# Each step is killed past STEP_TIMEOUT seconds
# (default 300; simulate, chaos and isolation 540, so run each of those alone): a hung step costs its own time, not
# the call's.
step() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS;
         timeout -k 10 "${STEP_TIMEOUT:-300}" "$@" >"$OUT/$name.log" 2>&1; local rc=$?;
         echo "=== $name: rc=$rc in $((SECONDS - t0)) s"; tail -n ${TAILN:-25} "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
SIM=${SIM_DIR:-/tmp/cliffguard-sim}
smollm2() {   # the builtin model's shape with random weights (once per machine)
  [ -f "$SIM/smollm2/model.safetensors" ] && return 0
  mkdir -p "$SIM/smollm2" && cp .gpu/smollm2/* "$SIM/smollm2/" && $PY bench/random_weights.py "$SIM/smollm2"; }
chaos_config() {   # config/pools.yaml on CUDA with that model, an 8 GiB device and bench chaos's short fault timers
  $PY - "$SIM" <<'PYEOF'
import sys, yaml
from bench.chaos import FAULT_TIMERS
sim = sys.argv[1]
config = yaml.safe_load(open("config/pools.yaml"))
config["gateway"].update(FAULT_TIMERS)
config["devices"]["default"].update(device="cuda", memory="8GiB")
for pool in config["pools"]:
    pool["model"] = f"{sim}/smollm2"
yaml.safe_dump(config, open(f"{sim}/chaos.yaml", "w"), sort_keys=False)
PYEOF
}
for what in ${GPU_STEPS:-tests kernels kernels_fp8 fp8 engine}; do
  case $what in
    tests)   CLIFFGUARD_BUILTIN_DIR=${CLIFFGUARD_BUILTIN_DIR:-$PWD/.gpu/smollm2} TRITON_INTERPRET=0 step gpu_tests $PY -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_triton.py \
               tests/kernels/test_triton_prefill.py tests/kernels/test_triton_fused.py tests/kernels/test_triton_moe.py \
               tests/kernels/test_triton_dsa.py tests/kernels/test_triton_block_sparse.py tests/kernels/test_triton_fp8_gemm.py \
               tests/kernels/test_triton_int4_gemm.py tests/kernels/test_selective_scan.py \
               tests/kernels/test_triton_gated_delta.py tests/kernels/test_triton_ssd.py \
               tests/kernels/test_triton_lightning.py \
               tests/engine/test_sampling.py \
               tests/engine/test_cuda_graphs.py tests/engine/test_overlap.py tests/engine/test_prompt_logprobs.py \
               tests/engine/test_sliding_kv.py \
               tests/kernels/test_transfer.py \
               tests/kernels/test_engine_triton.py tests/engine/test_engine_vs_hf.py ;;
    kernels) step bench_kernels $CLI bench kernels ;;
    kernels_fp8) step bench_kernels_fp8 $CLI bench kernels --kv-dtype fp8 ;;
    kernels_mla) step bench_kernels_mla $CLI bench kernels --latent ;;
    kernels_warps) CLIFFGUARD_PAGED_WARPS=8 step bench_kernels_warps8 $CLI bench kernels ;;   # against `kernels`
    hostcost) step bench_hostcost $CLI bench hostcost --device cuda --lengths 100,1000 --tokenizer .gpu/smollm2 ;;
    engine)  step bench_engine $CLI bench engine --model .gpu/llama-3-8b --random-weights --dtype bfloat16 ;;
    eager)   step bench_engine_eager $CLI bench engine --model .gpu/llama-3-8b --random-weights --dtype bfloat16 \
               --skip-hf --enforce-eager ;;
    kvcache) if [ -n "${KVCACHE_MODEL:-}" ]; then step bench_kvcache $CLI bench kvcache --device cuda --max-tokens 32 \
               --model "$KVCACHE_MODEL"; else echo "=== kvcache: skipped (KVCACHE_MODEL unset: real weights needed)"; fi ;;
    mamba)   step bench_mamba $CLI bench mamba --device cuda --tokens 1024,4096,16384
             step bench_gated_delta $CLI bench mamba --gated-delta --device cuda --tokens 1024,4096,32768
             step bench_kda $CLI bench mamba --gated-delta --per-channel --k-heads 32 --v-heads 32 --device cuda \
                 --tokens 1024,4096,16384
             step bench_ssd $CLI bench mamba --ssd --device cuda --tokens 1024,4096,32768
             step bench_lightning $CLI bench mamba --lightning --device cuda --tokens 1024,4096,32768
             step bench_mixed_step $CLI bench mamba --mixed-step --device cuda --tokens 64,512 --decodes 63
             step bench_prefills $CLI bench mamba --mixed-step --device cuda --tokens 64,512,2048 --prefills 8 \
                 --decodes 0
             step bench_mamba1_pieces $CLI bench mamba --pieces 8 --device cuda --tokens 64,512,2048
             step bench_ple $CLI bench mamba --ple --pieces 8 --device cuda --tokens 64,512 ;;
    dsa)     step bench_dsa $CLI bench dsa --device cuda --batch 8 --context 32768
             step bench_dsa_long $CLI bench dsa --device cuda --batch 8 --context 131072
             step bench_block_sparse $CLI bench dsa --device cuda --batch 8 --context 32768 --block-sparse
             step bench_block_sparse_long $CLI bench dsa --device cuda --batch 8 --context 131072 --block-sparse
             step bench_qsa $CLI bench dsa --device cuda --batch 8 --context 32768 --qsa --topk-blocks 8
             step bench_qsa_chunk $CLI bench dsa --device cuda --context 4096 --qsa --topk-blocks 8 --qsa-chunk 512 ;;
    sparse)  for m in hy-v4-small minimax-m3-small; do   # sparse attention past its dense regime, graphs against eager
               step bench_sparse_graphs_$m $CLI bench engine --model bench/models/$m --random-weights --dtype bfloat16 \
                 --skip-hf
               step bench_sparse_eager_$m $CLI bench engine --model bench/models/$m --random-weights --dtype bfloat16 \
                 --skip-hf --enforce-eager
             done ;;
    fp8)     step bench_fp8 $CLI bench fp8 --device cuda
             step bench_fp8_32b $CLI bench fp8 --device cuda --shape 32b --tokens 1,16,256
             step bench_int4_32b $CLI bench fp8 --device cuda --shape 32b --tokens 1,16,256 --int4
             step bench_awq_32b $CLI bench fp8 --device cuda --shape 32b --tokens 1,16,256 --int4 --zero-points
             step bench_int8_32b $CLI bench fp8 --device cuda --shape 32b --tokens 1,16,256 --int8 ;;
    engine_fp8) step bench_engine_fp8 $CLI bench engine --model .gpu/llama-3-8b --random-weights --dtype bfloat16 \
               --skip-hf --quantization fp8 ;;
    moe)     step bench_moe $CLI bench moe --device cuda --tokens 1,16,64,256,1024 --fp8 --int4 --int8
             step bench_moe_gpt_oss $CLI bench moe --device cuda --tokens 1,16,64,256,1024 --gpt-oss --mxfp4
             step bench_moe_gpt_oss_120b $CLI bench moe --device cuda --tokens 1,16,64,256,1024 --gpt-oss \
                 --experts 128 --mxfp4 ;;
    prefix)  step bench_prefix $CLI bench prefix --random-weights --dtype bfloat16 --device cuda --users 16 \
               --system-tokens 4096 --max-num-batched-tokens 2048 --max-num-seqs 32 --kv-cache-mib 4096 ;;
    sliding) step bench_sliding $CLI bench sliding --random-weights --device cuda --max-tokens 256
             step bench_sliding_mistral $CLI bench sliding --model bench/models/mistral-small --random-weights \
               --device cuda --max-tokens 256 ;;
    sync)    step bench_engine_sync $CLI bench engine --model .gpu/llama-3-8b --random-weights --dtype bfloat16 \
               --skip-hf --async-scheduling off ;;
    simulate) smollm2 && printf '%s\n' 'devices:' '  gpu: {device: cuda, memory: 4GiB, dtype: bfloat16}' 'pools:' \
                '  - name: chat' "    model: $SIM/smollm2" '    device: gpu' '    kv_cache_bytes: 128MiB' \
                '    avg_len: 512' '    max_model_len: 2048' '    max_num_batched_tokens: 512' > "$SIM/pools.yaml" &&
              TAILN=40 STEP_TIMEOUT=${STEP_TIMEOUT:-540} step bench_simulate $CLI bench simulate --config "$SIM/pools.yaml" \
                --duration 60 --calibration-duration 40 --out "$OUT/simulate" ;;
    chaos)   smollm2 && chaos_config && TAILN=45 STEP_TIMEOUT=${STEP_TIMEOUT:-540} step bench_chaos $CLI bench chaos --quick --config "$SIM/chaos.yaml" \
               --burst 500 --silent-bodies 24 --tenant-burst 16 \
               --faults ${CHAOS_FAULTS:-silent_bodies,stop_idle_worker,poison,tenant_burst,kill_worker} --out "$OUT/chaos" ;;
    restart) smollm2 && chaos_config && step bench_restart $CLI bench restart --config "$SIM/chaos.yaml" --runs 3 ;;
    isolation) smollm2 && TAILN=40 STEP_TIMEOUT=${STEP_TIMEOUT:-540} step bench_isolation $CLI bench isolation --sweep --quick --no-slo --device cuda \
                 --model "$SIM/smollm2" --out "$OUT/isolation" ;;
  esac
done
