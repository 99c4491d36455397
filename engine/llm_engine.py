"""`LLMEngine`: the synchronous engine of one device: weights, one KV tensor, and one scheduler per pool.

`step()` = `_schedule` (the step composer, `engine.composer`: interactive pools first, throughput pools' chunks
sized to the step's latency target) -> `_execute` (one merged forward pass, n > 1 forks, sampling) -> `_postprocess`
(stop checks, detokenization, outputs). It runs in the device worker process (`engine.worker`); use it directly for
offline batch work (`generate`).

A request with a structured output (`SamplingParams.structured`) waits outside its scheduler until its grammar is
built on a grammar thread (`engine.structured.GrammarCompiler`); each of its sequences then carries a matcher that
masks its next token and follows the tokens it takes, and stops as soon as its grammar is complete.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq

import torch

from engine.capacity import DEFAULT_BLOCK_SIZE
from engine.calibration import derive_slos, warm_up
from engine.composer import StepComposer
from engine.config import CacheConfig, ConfigError, EngineConfig, PoolConfig, SchedulerConfig
from engine.model_config import ModelConfig
from engine.forks import SampleForks
from engine.kv_cache import SwapSpace, device_kv_cache
from engine.kv_scales import calibrate_kv_scales
from engine.cuda_graphs import MAX_GRAPH_BATCH
from engine.models import build_model
from engine.model_runner import ModelRunner, follower_main
from engine.parallel import ShardShape, TensorParallelGroup, use_device
from engine.outputs import RequestOutput, RequestState
from engine.overlap import LaunchedStep, ScheduledStep, StepClock, overlap_applies
from engine.sampler import Sampler
from engine.sampling import SamplingParams, SamplingRow, make_generator
from engine.scheduler import RequestTooLargeError, Scheduler, SchedulerOutput, build_scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.stats import Laps, StepStats
from engine.sliding_kv import device_ring, paged_bytes_per_token
from engine.state_cache import attach_snapshots
from engine.step_commit import check_pools, commit_step
from engine.structured import GrammarCompiler, PendingGrammars
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.weights import iter_weights, resolve_model
from kernels import get_backend
from kernels.cpu_linear import pack_linears, use_packed_linears

log = logging.getLogger("cliffguard.engine")


class RequestError(ValueError):
    """A request was refused at submission; the message names the offending field."""


class LLMEngine:
    """The engine of one device worker. Not thread-safe: one caller (the worker loop) drives it."""

    def __init__(self, config: EngineConfig, *, progress: bool = True) -> None:
        self.config = config
        rank_devices = config.rank_devices()
        self.device = rank_devices[0]
        use_device(self.device)   # Triton's launches, the events and graph captures use the current device
        self.dtype = config.resolved_dtype(self.device)
        self.kv_dtype = config.resolved_kv_dtype(self.device)   # the model's, or float8_e4m3fn
        started = time.perf_counter()
        self.model_path = resolve_model(config.model, cache_dir=config.cache_dir)
        self.model_config = ModelConfig.from_folder(self.model_path).serving(config.max_model_lens)
        self.ring = device_ring(config, self.model_config)   # sliding layers' window-bounded K/V (engine.sliding_kv)
        self.shard = ShardShape.of(self.model_config, 0, config.tensor_parallel_size)
        # With tensor parallelism the other ranks start now and load their shards while this one loads its own.
        self.group = (TensorParallelGroup.start(config, rank_devices, follower_main) if config.tensor_parallel_size > 1
                      else TensorParallelGroup.single())
        try:
            self._build(progress)
        except BaseException:
            self.group.close()
            raise
        self.load_seconds = time.perf_counter() - started
        if progress:
            log.info("loaded %s (%s, %.0f MiB, %s) on %s in %.1fs (%s); KV cache %d blocks x %d tokens%s", config.model,
                     self.model_config.architecture, self.weights_bytes / 2**20, self.dtype, self.device,
                     self.load_seconds, ", ".join(f"{k} {v:.2f}s" for k, v in self.load_phases.items()),
                     self.num_blocks, config.cache.block_size,
                     f"; tensor parallel over {self.shard.size} ranks" if self.shard.size > 1 else "")

    def _build(self, progress: bool) -> None:
        """Everything after the model's shape is known: weights, KV cache, schedulers, the warm-up. The
        seconds of each phase go to `load_phases` (a worker's restart is these plus its imports)."""
        config = self.config
        self.load_phases: dict[str, float] = {}
        lap = Laps(self.load_phases)
        self._load_model()
        lap("weights")
        self.num_blocks = config.num_blocks
        self.kv_cache = device_kv_cache(config, self.model_config, self.shard, self.kv_dtype, self.device, self.ring)
        lap("kv")
        context = self.model_config.context_length   # a pool's max_model_len 0: the model's context
        max_len = max((p.scheduler.max_model_len or context for p in config.pools), default=context)
        max_seqs = sum(p.scheduler.max_num_seqs for p in config.pools)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, get_backend(self.device), self.group,
                                  max_rows=max_seqs, max_blocks=-(-max_len // config.cache.block_size))
        self.runner.compile_kernels()
        lap("kernels")
        self.schedulers: dict[str, Scheduler] = {}
        self.swap_spaces = self.runner.swap_spaces
        self._swap_copies: tuple[float, float] | None = None   # one device's (bytes/s, s per copy), for its pools
        first_block = 0
        for pool in config.pools:
            self.schedulers[pool.name] = self._make_scheduler(pool, first_block)
            first_block += pool.num_blocks
        attach_snapshots(self.schedulers.values(), self.model, self.kv_cache)   # prefix caching's kept states, rings
        self.runner.setup_followers()
        self.composer = StepComposer(self.schedulers, {p.name: p.slo for p in config.pools},
                                     min_shares={p.name: p.min_share for p in config.pools})
        lap("schedulers")
        calibrate_kv_scales(self)   # an FP8 cache without the checkpoint's scales; before graphs bake them in
        if self.runner.graphs_apply(config.enforce_eager):
            self.runner.capture_graphs(min(max_seqs, MAX_GRAPH_BATCH), max_len)
            lap("graphs")
        warm_up(self)
        lap("warm-up")
        self.derived_slos = derive_slos(self)
        lap("slo")
        self.default_pool = config.pools[0].name
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.draw_sampling_seed()))
        self.requests: dict[str, RequestState] = {}
        self._forks = SampleForks(self.schedulers, share_prefill=not (self.model_config.state_shape or self.ring))
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
        self._building = PendingGrammars(self.grammars)   # requests whose grammar is being built
        self.overlap = overlap_applies(config.async_scheduling, self.device)
        self._in_flight: LaunchedStep | None = None   # overlapped: the step launched, its tokens not yet read
        self._seq_ids, self._arrivals = itertools.count(), itertools.count()
        self.last_step = StepStats()

    def _load_model(self) -> None:
        """The tokenizer and this rank's weights (random ones if the config asks)."""
        self.tokenizer = Tokenizer.from_folder(self.model_path)
        self.byte_detokenizer = self.tokenizer.byte_tables is not None   # the tables built now, not on a request
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self.model = build_model(self.model_config, self.dtype, self.device, self.shard, self.group.collectives,
                                 self.config.quantization)
        self.model.init_random(seed=self.config.seed) if self.config.random_weights else \
            self.model.load_weights(iter_weights(self.model_path))
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())   # as held here
        if use_packed_linears(self.device, self.dtype):
            pack_linears(self.model)

    def _make_scheduler(self, pool: PoolConfig, first_block: int) -> Scheduler:
        """One pool's scheduler: its block range from `first_block` on, its swap space (`ModelConfig.serving_pool`)."""
        pool = self.model_config.serving_pool(pool)
        max_model_len = pool.scheduler.max_model_len or self.model_config.context_length
        if max_model_len > self.model_config.context_length:
            raise ConfigError(f"pools.{pool.name}.max_model_len: {max_model_len} exceeds the model's context "
                              f"{self.model_config.context_length} (max_position_embeddings, scaled by a YaRN or linear rope)")
        scheduler = build_scheduler(pool, block_size=self.config.cache.block_size, first_block=first_block,
                                    max_model_len=max_model_len, bytes_per_block=self.kv_cache.bytes_per_block,
                                    kv_bytes_per_token=self.kv_bytes_per_token)
        if scheduler.swap_manager is not None:
            self.swap_spaces[pool.name] = SwapSpace(self.kv_cache, scheduler.swap_manager.num_blocks)
            self._swap_copies = self._swap_copies or self.swap_spaces[pool.name].measure()
            scheduler.cost_model.swap_bytes_per_second, scheduler.cost_model.swap_latency_seconds = self._swap_copies
        return scheduler

    @property
    def kv_bytes_per_token(self) -> int:
        """S_KV of this rank's shard (the model's whole S_KV with one rank): the paged blocks' layers, without the
        sliding layers a ring holds (`engine.sliding_kv`)."""
        return paged_bytes_per_token(self.model_config, self.kv_dtype, self.shard.size, self.ring)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group (nothing with one rank). Idempotent."""
        self.group.close()

    @classmethod
    def from_args(cls, model: str = "builtin:smollm2-135m-instruct", *, block_size: int = DEFAULT_BLOCK_SIZE,
                  num_blocks: int = 1024, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                  max_model_len: int = 0, enable_chunked_prefill: bool = True, **kwargs) -> "LLMEngine":
        """One pool named 'default' with the given limits; other EngineConfig fields as keywords."""
        progress = kwargs.pop("progress", True)
        pool = PoolConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill))
        return cls(EngineConfig(model=model, cache=CacheConfig(block_size=block_size), pools=(pool,), **kwargs),
                   progress=progress)

    # --- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    *, priority: int = 0, pool: str | None = None, cache_salt: str | None = None,
                    background: bool = False) -> None:
        """Queue a request. `prompt` is text (tokenized as a completion prompt) or token ids; `background` (a batch
        line's) is queued and resumed after the pool's other requests (a victim first under `victim_policy: priority`).
        `cache_salt` partitions the prefix cache: a request only reuses blocks cached by requests with the same salt
        (the gateway passes the tenant, so no tenant can probe another's prompts). Raises RequestError (a ValueError
        naming the field) when the request is malformed or can never fit its pool (prompt + max_tokens over
        max_model_len or over the pool's blocks, min_tokens past them)."""
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id: must be a non-empty string")
        if request_id in self.requests:
            raise RequestError(f"request_id: {request_id!r} is already in flight")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestError(f"priority: must be an integer, got {priority!r}")
        pool = pool or self.default_pool
        if pool not in self.schedulers:
            raise RequestError(f"pool: unknown pool {pool!r}; pools: {', '.join(self.schedulers)}")
        scheduler = self.schedulers[pool]
        prompt_ids = self._prompt_ids(prompt, params)
        if (max_tokens := params.max_tokens) is None:
            max_tokens = scheduler.max_model_len - len(prompt_ids)
            if max_tokens < 1:
                raise RequestError(f"prompt: {len(prompt_ids)} tokens leave no room to generate within "
                                   f"max_model_len {scheduler.max_model_len}")
        if params.min_tokens > max_tokens:   # past an unset max_tokens' room (set, SamplingParams refuses it)
            raise RequestError(f"min_tokens: {params.min_tokens} is over the {max_tokens} tokens the prompt leaves")
        if params.n > scheduler.config.max_num_seqs:   # its samples run together: it would wait forever
            raise RequestError(f"n: {params.n} samples run together, and pool {pool!r} runs at most "
                               f"max_num_seqs {scheduler.config.max_num_seqs} sequences at once")
        try:
            scheduler.check_fits(len(prompt_ids), max_tokens)
        except RequestTooLargeError as exc:
            raise RequestError(f"prompt: {exc}") from exc
        arrival = next(self._arrivals)
        seqs = []
        for index in range(params.n):
            gen = make_generator(params.seed, index, self.device) if params.seed is not None else None
            seqs.append(Sequence(background=background,
                seq_id=next(self._seq_ids), request_id=request_id, index=index, token_ids=list(prompt_ids),
                num_prompt_tokens=len(prompt_ids), params=params, max_tokens=max_tokens, priority=priority,
                arrival_order=arrival, generator=gen, pool=pool, cache_salt=cache_salt))
        request = RequestState(request_id, list(prompt_ids), seqs, time.monotonic())
        request.detokenizers = [IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens) for _ in seqs]
        self.requests[request_id] = request
        if params.structured is None:
            self._forks.submit(seqs)
        else:
            self._building.add(request_id, params.structured)

    def _prompt_ids(self, prompt: str | Seq[int], params: SamplingParams) -> list[int]:
        vocab = self.model_config.vocab_size   # and no logit_bias past it: the sampler could not apply it
        if outside := [t for t, _ in params.logit_bias if t >= vocab]:
            raise RequestError(f"logit_bias: token ids {outside[:8]} are outside the vocabulary (0..{vocab - 1})")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt: must not be empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, Seq) or not prompt:
            raise RequestError("prompt: must be a non-empty string or a non-empty list of token ids")
        for i, tok in enumerate(prompt):
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab:
                raise RequestError(f"prompt[{i}]: token id {tok!r} is not in the vocabulary (0..{vocab - 1})")
        return list(prompt)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (None if unknown)."""
        if (request := self.requests.get(request_id)) is None:
            return None
        if self._building.discard(request_id):   # never reached its scheduler
            for seq in request.seqs:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        self._forks.end(request_id, FinishReason.ABORT)
        for seq in request.seqs:
            if not seq.is_finished:
                self.schedulers[seq.pool].finish(seq, FinishReason.ABORT)
        self._forget(request)
        return request.output(request.seqs)

    def pause(self, request_id: str, paused: bool) -> bool:
        """Stop stepping a request (`paused`: it keeps its blocks and place), or step it again; False if unknown."""
        if (request := self.requests.get(request_id)) is not None:
            self.schedulers[request.seqs[0].pool].pause(request_id, paused)
        return request is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether `step()` would run anything: unfinished requests that are not all paused."""
        return bool(self._building) or self._in_flight is not None or any(s.has_work for s in self.schedulers.values())

    # --- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Compose the step across pools, launch one merged forward pass and its sampling, and report what
        changed: this step's tokens, or with overlapped steps (`engine.overlap`) the step before's, read
        once this one is queued behind it."""
        previous, self._in_flight = self._in_flight, None
        if not self.has_work():   # nothing to run, or only paused requests: what is in flight settles
            self.last_step = StepStats(finished_at=self.last_step.finished_at)
            return self._postprocess(previous) if previous is not None else []
        started = time.perf_counter()
        outputs = self._admit_built_grammars()
        if previous is not None and any(s.grammar is not None for s in previous.sampled):
            outputs += self._postprocess(previous)   # a grammar masks the next token by this one's value
            previous = None
        scheduled = self._schedule()
        if not scheduled.batch and self._building and previous is None:   # nothing until a grammar is built
            self._building.wait()
        scheduled.stats.phases["schedule"] = time.perf_counter() - started
        scheduled.stats.stalled = scheduled.idle and not (outputs or previous or self._building)
        launched = self._execute(scheduled)
        if previous is not None:
            outputs += self._postprocess(previous)
        if launched.tokens is not None and self.overlap:
            self._in_flight = launched
        else:
            outputs += self._postprocess(launched)
        return outputs

    def _admit_built_grammars(self) -> list[RequestOutput]:
        """Requests whose grammar is built enter their scheduler, each sequence with its own matcher; those
        whose grammar failed end with the library's reason as their error."""
        failed = []
        for request_id, built, error in self._building.ready():
            request = self.requests[request_id]
            for seq in request.seqs:
                if error is None:
                    seq.grammar = self.grammars.matcher(built)
                else:   # the gateway checked the grammar: this is the backstop
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
                    seq.error = f"response_format: the grammar cannot be built: {error}"
            if error is None:
                self._forks.submit(request.seqs)
            else:
                failed.append(request.output(request.seqs))
                self._forget(request)
        return failed

    def _schedule(self) -> ScheduledStep:
        """Every pool's batch (the composer decides across pools), with the block copies it needs done."""
        started = time.perf_counter()
        composed = self.composer.schedule()
        stats = StepStats(num_prefill_tokens=composed.features.num_prefill_tokens,
                          num_decode_tokens=composed.features.num_decode_tokens,
                          num_attended=composed.features.num_attended,
                          num_keys_read=composed.features.num_keys_read,
                          target_seconds=composed.target_seconds, predicted_seconds=composed.predicted_seconds,
                          pressed=list(composed.pressed),
                          pool_tokens={name: out.num_batched_tokens for name, out in composed.outputs.items()})
        scheduled = ScheduledStep(composed, [], [], stats, started)
        for name, out in composed.outputs.items():
            scheduled.batch.extend(out.scheduled)
            scheduled.ended.extend(out.finished)   # too large for their pool: their text ends with what it held
            for seq in out.finished:
                seq.finish_reason = FinishReason.STOP if self._flushed_stop(seq) else seq.finish_reason
            stats.num_preempted += len(out.preempted)
            for seq in (*out.preempted, *out.finished):   # no longer running: their rows are free, their penalty
                self.runner.release(seq)                  # counts too (counted again from their tokens on resume)
                self.sampler.release(seq.seq_id)
            self._move_blocks(name, self.schedulers[name], out)
        self._forks.end_with_first(scheduled.ended)
        scheduled_at = time.monotonic()
        for item in scheduled.batch:
            request = self.requests[item.seq.request_id]
            if request.first_scheduled_time is None:   # its first admission: only its cached prefix is computed
                request.first_scheduled_time, request.num_cached_tokens = scheduled_at, item.seq.num_computed_tokens
        return scheduled

    def _execute(self, scheduled: ScheduledStep) -> LaunchedStep:
        """One forward pass over the merged batch; forks the samples whose prefill ended; queues the sampling. With
        overlap each sampled sequence counts its token as a placeholder, filled on the device in the next step's."""
        if not scheduled.batch:   # nothing to time: no clock (a CUDA clock never stopped cannot be read)
            return LaunchedStep(scheduled)
        launched = LaunchedStep(scheduled, clock=StepClock(self.device) if self.overlap else None)
        launched.forward_started = time.perf_counter()
        logits, sampled = self.runner.execute(scheduled.batch)
        launched.prompt_spans = self.runner.prompt_spans   # its prompt logprobs, if any (`engine.prompt_logprobs`)
        # Launched: on CUDA the device runs it while the host does the bookkeeping, forks and sampling rows (queued)
        forward_launched = time.perf_counter()
        commit_step(self.schedulers, scheduled.batch)
        logits, launched.sampled = self._forks.fork(logits, sampled)
        if launched.sampled:
            rows = [SamplingRow(s.params, s.generator, s.num_output_tokens, self.eos_token_ids, s.token_ids,
                                s.grammar, s.seq_id) for s in launched.sampled]
            launched.tokens = self.sampler.launch(logits, rows)   # its tokens reach the host when read
        if launched.clock is not None:
            launched.clock.stop()
            if launched.tokens is not None:
                for row, seq in enumerate(launched.sampled):
                    seq.add_pending(row)
                self.runner.pending_tokens = launched.tokens.token_ids
        phases = scheduled.stats.phases
        phases["inputs"] = self.runner.last_inputs_seconds
        phases["forward"] = forward_launched - launched.forward_started - phases["inputs"]
        phases["sample"] = time.perf_counter() - forward_launched
        return launched

    def _postprocess(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read the step's tokens (the wait for the device counts as sampling), append them (stop checks,
        detokenization) and report every request touched. A sequence that ended while the step was in
        flight (an abort, a stop in the step before) has its token dropped."""
        scheduled, started = launched.scheduled, time.perf_counter()
        tokens = launched.tokens.output() if launched.tokens is not None else None
        if launched.clock is None and scheduled.batch:
            self.runner.synchronize()   # the step's time is the device's, not its launch's (nothing sampled)
        done = time.perf_counter()
        stats = scheduled.stats
        if scheduled.batch:
            device_seconds = launched.clock.seconds() if launched.clock else done - launched.forward_started
            stats.phases["sample"] = stats.phases.get("sample", 0.0) + done - started
        launched.prompt_spans.apply()
        touched: dict[str, list[Sequence]] = {}
        for seq in scheduled.ended:
            touched.setdefault(seq.request_id, []).append(seq)
        now = time.monotonic()
        first_tokens = []                  # (pool, seconds since arrival), told the composer after the step
        for i, seq in enumerate(launched.sampled):
            if seq.is_finished:
                continue
            self.schedulers[seq.pool].stats.num_generated_tokens += 1
            self._append_token(seq, tokens.token_ids[i], tokens.logprobs[i], tokens.top_logprobs[i])
            request = self.requests[seq.request_id]
            if request.first_token_time is None:
                request.first_token_time = now
                first_tokens.append((seq.pool, now - request.arrival_time))
            touched.setdefault(seq.request_id, []).append(seq)
        # The last report of a request carries every sample, the untouched ones with empty deltas.
        outputs = [self._finish_or_report(self.requests[rid], seqs) for rid, seqs in touched.items()
                   if rid in self.requests]
        if scheduled.batch:
            finished_at = stats.finished_at = time.perf_counter()
            self.composer.observe(scheduled.composed, device_seconds if launched.clock else
                                  finished_at - launched.forward_started, finished_at)
            for pool, seconds in first_tokens:
                self.composer.observe_first_token(pool, seconds, finished_at)
            stats.seconds = finished_at - max(scheduled.started, self.last_step.finished_at)   # see StepStats
        stats.phases["outputs"] = time.perf_counter() - done
        self.last_step = stats
        return outputs

    def _move_blocks(self, pool: str, scheduler: Scheduler, out: SchedulerOutput) -> None:
        """Do the copies the scheduler asked for, before the forward pass reuses any freed block."""
        if not out.moves:
            return
        started = time.perf_counter()
        self.runner.move_blocks(pool, out.moves)
        if out.swap_out or out.swap_in:
            scheduler.stats.preempt_seconds += time.perf_counter() - started

    def _finish_or_report(self, request: RequestState, seqs: list[Sequence]) -> RequestOutput:
        if request.all_finished and not self._forks.has_pending(request.request_id):
            self._forget(request)
            return request.output(request.seqs)
        return request.output(seqs)

    def _forget(self, request: RequestState) -> None:
        """A request has ended: drop it, what the sampler keeps for its sequences, and any pause of it."""
        del self.requests[request.request_id]
        self.schedulers[request.seqs[0].pool].pause(request.request_id, False)
        for seq in request.seqs:
            self.sampler.release(seq.seq_id)
            self.runner.release(seq)

    def _append_token(self, seq: Sequence, token: int, logprob: float | None,
                      top: list[tuple[int, float]] | None) -> None:
        detok = self.requests[seq.request_id].detokenizers[seq.index]
        reason = seq.append_token(token, logprob, top, lambda t: detok.step([t]), self.eos_token_ids,
                                  self.schedulers[seq.pool].max_model_len, detok.held_text)
        if reason is not None:
            reason = FinishReason.STOP if self._flushed_stop(seq) else reason
            self.schedulers[seq.pool].finish(seq, reason)
            self.runner.release(seq)
            self.sampler.release(seq.seq_id)   # a sibling that ends before the others (n > 1) frees its row now

    def _flushed_stop(self, seq: Sequence) -> bool:
        """At its end, the text `seq`'s detokenizer held back appended; True if a stop string in it cut it."""
        detok = self.requests[seq.request_id].detokenizers[seq.index] if seq.request_id in self.requests else None
        return detok is not None and not isinstance(seq.stop_reason, str) and seq.append_flushed(detok.flush())

    # --- offline use -----------------------------------------------------------------------------
    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion, all in one continuous batch; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"params: {len(params)} sampling params for {len(prompts)} prompts")
        ids = [f"gen-{next(self._arrivals)}-{i}" for i in range(len(prompts))]
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.add_request(request_id, prompt, p)
        except BaseException:   # one refused: none of them runs (those added would hold blocks for no one)
            for request_id in ids:
                self.abort(request_id)
            raise
        final: dict[str, RequestOutput] = {}
        while any(r in self.requests for r in ids):
            final.update((out.request_id, out) for out in self.step() if out.finished)
        return [final[r] for r in ids]

    # --- invariants ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every pool's allocator agrees with its live sequences: each block is free, cached-free or owned,
        and a pool's requests hold only that pool's blocks (`engine.step_commit.check_pools`)."""
        check_pools(self.schedulers, self.runner.input_batch.num_rows)

    def num_free_blocks(self) -> int:
        return sum(s.block_manager.num_free_blocks for s in self.schedulers.values())
