"""One pool's scheduler: continuous batching with chunked prefill, FCFS or priority order, prefix caching, and
preemption by recompute or swap when the pool runs out of blocks.

Each `schedule()` fills a token budget of `max_num_batched_tokens`: first the running sequences (a decode token
each, or the next chunk of an unfinished prefill), then swapped-out ones (before new arrivals, but for those of a
more urgent priority than every swapped one), then waiting ones
in order while `max_num_seqs`, the budget and the free blocks allow; sequences leave and join at every step. One
sequence's chunk is at most `long_prefill_token_threshold` where set (vLLM's knob): a long prompt then leaves the
rest of a step to other prompts, and a sliding layer's ring (`engine.sliding_kv`) holds that much less.
A budget short of the running decodes (a throughput pool's under the step composer's time target) serves those
scheduled longest ago first: every decode slows in turn, none waits behind the others for good.

When a running sequence needs a block and none is free, a victim is chosen by the pool's victim policy, never one
that produced fewer than `stability_floor_tokens` since its (re)admission while another candidate exists, and
preempted (its full blocks stay in the prefix cache, the last one's token in flight included):
- `recompute`: its blocks are dropped; it re-prefills later;
- `swap`: its computed blocks are copied to the pool's CPU block pool and back on resume (CPU pool full: recompute);
- `auto`: per victim, the cheaper of the swap round trip `2 x (t_copy + L x S_KV / B_swap)` and the re-prefill
  `T_prefill(L)` (`PreemptionCostModel`).
A step that preempted admits nothing. A sequence alone in its pool that still cannot grow ends (`length`, an error).
A **paused** request (`pause`: its client reads too slowly) is skipped: its running sequences keep their blocks
and place but get no token and are never victims; its waiting or swapped ones are passed by. A sequence short of
blocks that only paused ones hold computes what the free blocks hold of its prefill chunk and waits for the rest,
keeping its own (`_held_by_paused`) and promising none (the blocks the paused ones hold may never come back). A running
sequence whose last token is in flight (overlap) is never a victim either: it frees its blocks when that lands; one
short of what those make up waits for them.
The scheduler only decides; the block copies it asks for (swap out, swap in, copy-on-write) travel in
`SchedulerOutput` and the engine performs them before the step's forward pass.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter

from engine.block_manager import BlockManager, NoFreeBlocksError
from engine.config import ConfigError, PoolConfig, SchedulerConfig
from engine.preemption_cost import PreemptionCostModel, victim_by_policy
from engine.scheduler_output import RequestTooLargeError, ScheduledSeq, SchedulerOutput, SchedulerStats
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.state_cache import StateSnapshots


class Scheduler:
    """Owns one pool's waiting, running and swapped sequences and decides each step's batch (single-threaded)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 name: str = "default", swap_manager: BlockManager | None = None,
                 cost_model: PreemptionCostModel | None = None) -> None:
        self.config, self.block_manager, self.cost_model = config, block_manager, cost_model
        self.swap_manager, self.max_model_len, self.name = swap_manager, max_model_len, name   # swap: CPU block ids
        self.waiting: list[Sequence] = []   # sorted by Sequence.sort_key
        self.running: list[Sequence] = []   # in admission order
        self.swapped: list[Sequence] = []   # sorted by Sequence.sort_key too: the order they resume in
        self.paused: set[str] = set()       # request ids not to schedule until resumed
        self.stats = SchedulerStats()
        self._step, self._promised = 0, 0   # steps so far; blocks promised this step to sequences waiting for them
        self._served: set[int] | None = None   # this step's decodes under a short budget (`_decodes_served`)
        self._max_step = config.max_step_tokens   # a sequence's tokens in one step (`long_prefill_token_threshold`)
        self.state_snapshots: StateSnapshots | None = None   # a state model's prefixes' states (the engine's)
        if config.preemption_mode in ("swap", "auto") and swap_manager is None:
            raise ValueError(f"pool {name!r}: preemption_mode {config.preemption_mode!r} needs a swap_manager")

    # --- admission ---------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestTooLargeError unless prompt + max_tokens can ever run in this pool (the K/V of all but
        the last token: it is sampled, never computed)."""
        total, bm = num_prompt_tokens + max_tokens, self.block_manager
        what = f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total}"
        if total > self.max_model_len:
            raise RequestTooLargeError(f"{what} exceeds max_model_len {self.max_model_len} of pool {self.name!r}")
        if bm.num_blocks_for(total - 1) > bm.num_blocks:
            raise RequestTooLargeError(f"{what} tokens needs {bm.num_blocks_for(total - 1)} blocks; pool "
                                       f"{self.name!r} has {bm.num_blocks} ({bm.capacity_tokens} tokens)")
        if not self.config.enable_chunked_prefill and total > self.config.max_num_batched_tokens:
            raise RequestTooLargeError(f"{total} tokens exceed max_num_batched_tokens "
                                       f"{self.config.max_num_batched_tokens} of pool {self.name!r}, which has "
                                       "chunked prefill off")

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def add_forked(self, seq: Sequence, sibling: Sequence) -> None:
        """A sample forked from a running `sibling`: sharing its blocks, it decodes at once, behind its request's."""
        seq.status, seq.admitted_at_output = SequenceStatus.RUNNING, seq.num_output_tokens
        seq.last_scheduled_step = self._step
        self.running.insert(max((i + 1 for i, s in enumerate(self.running) if s.request_id == sibling.request_id),
                                default=len(self.running)), seq)   # after its request's samples, in order

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def pause(self, request_id: str, paused: bool) -> None:
        """Skip the request's sequences (here and to come: forks, a grammar being built), or not."""
        (self.paused.add if paused else self.paused.discard)(request_id)

    def is_paused(self, seq: Sequence) -> bool:
        return bool(self.paused) and seq.request_id in self.paused

    @property
    def has_work(self) -> bool:
        """Whether a step could schedule anything: a sequence of a request that is not paused."""
        return any(not self.is_paused(s) for queue in (self.running, self.waiting, self.swapped) for s in queue)

    def pending_work(self) -> tuple[list[int], int | None]:
        """What the next step would compute, for the step composer's cost estimate: the context lengths of the
        running sequences that would decode, and the cached context of `next_prefill` (None: none pending)."""
        decodes = [s.num_computed_tokens for s in self.running
                   if s.num_uncomputed_tokens == 1 and not self.is_paused(s) and not self._ending(s)]
        prefill = self.next_prefill()
        return decodes, prefill.num_computed_tokens if prefill is not None else None

    def next_prefill(self) -> Sequence | None:
        """The sequence whose prefill the next step would continue or start (paused ones wait: skipped)."""
        return next((s for queue in (self.running, self.swapped, self.waiting) for s in queue
                     if not self.is_paused(s) and (queue is not self.running or s.num_uncomputed_tokens > 1)), None)

    # --- the step ----------------------------------------------------------------------------
    def schedule(self, token_budget: int | None = None) -> SchedulerOutput:
        """This step's batch of the pool, within `max_num_batched_tokens` and `token_budget` (the step
        composer's limit for a throughput pool; None: no limit beyond the pool's own); a state model's
        snapshots planned on it (`engine.state_cache`)."""
        out = self._schedule(token_budget)
        if self.state_snapshots is not None:
            self.state_snapshots.plan(out.scheduled)
        return out

    def _schedule(self, token_budget: int | None) -> SchedulerOutput:
        self._step += 1
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = budget if token_budget is None else max(0, min(budget, token_budget))
        budget = self._schedule_running(out, budget)
        if out.preempted or self._promised:
            return out  # no admissions in a step that had to preempt, or promised blocks to come: the pool is full
        budget = self._schedule_swapped(out, budget)
        # swapped sequences resume before new arrivals, but for more urgent ones ((background, priority) below theirs)
        waits = min(((s.background, s.priority) for s in self.swapped if not self.is_paused(s)), default=None)
        self._schedule_waiting(out, budget, before=waits)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Each running sequence's decode token or next chunk (leaving the decodes after it theirs); the budget left."""
        bm = self.block_manager
        # The sequences scheduled or skipped (paused, ending, waiting, or passed over by a short budget) so far are
        # always a prefix of `running` (victims leave from anywhere, a chunk moved behind the decodes from the next place,
        # the order of the rest is kept): the next is running[that]. A sequence short of blocks that the ending ones'
        # own blocks (back a step later, less those promised to sequences before it) make up waits for them, as does
        # every later one short of the free blocks the waiters leave: nobody is preempted, nothing admitted.
        skipped, waits, coming, self._promised = 0, set(), None, 0
        served = self._served = self._decodes_served(budget) if 0 < budget < len(self.running) else None
        while len(out.scheduled) + skipped < len(self.running) and budget > 0:
            seq = self.running[len(out.scheduled) + skipped]
            if self.is_paused(seq) or self._ending(seq) or (
                    served is not None and seq.num_uncomputed_tokens == 1 and id(seq) not in served):
                skipped += 1
                continue
            i, num_new = len(out.scheduled) + skipped, min(seq.num_uncomputed_tokens, budget, self._max_step)
            if seq.num_uncomputed_tokens > 1 and (ahead := sum(   # the decodes after it
                    s.num_uncomputed_tokens == 1 and not self.is_paused(s) and not self._ending(s)
                    for s in self.running[i + 1:])):
                if ahead >= budget:   # they take the budget: it goes behind them (at the end, none is after it)
                    self.running.append(self.running.pop(i))
                    continue
                num_new = min(num_new, budget - ahead)
            if not bm.writes_in_place(seq.block_table, seq.num_computed_tokens, num_new):
                need, coming = self._blocks_needed(seq, num_new), self._ending_blocks() if coming is None else coming
                covered = need <= bm.num_free_blocks + coming - self._promised   # by the free and the coming blocks
                if need > bm.num_free_blocks - max(0, self._promised - coming) and (waits or covered):
                    self._promised, skipped = self._promised + need * covered, skipped + 1   # a waiter: the free
                    waits.add(id(seq))                           # blocks it counts on are no later sequence's
                    continue
                held = False   # short of blocks that only paused sequences hold: it waits for them, keeping its own
                while self._blocks_needed(seq, num_new) > bm.num_free_blocks:
                    if self.running == [seq]:
                        self._finish_too_large(seq, out)
                        break
                    victim = self._pick_victim(seq)   # never after a waiter: every one short of blocks waits
                    if held := victim is seq and self._held_by_paused(seq):
                        break
                    if victim is not seq and self.running.index(victim) < self.running.index(seq) and all(
                            item.seq is not victim for item in out.scheduled):
                        skipped -= 1   # a decode the short budget passed over, before `seq`: it leaves the prefix
                    budget += self._preempt(victim, out)
                    if victim is seq:
                        break
                if held and not (num_new := self._fitting(seq, num_new)):   # no part of its chunk fits: it waits,
                    skipped += 1   # promising nothing (paused ones may hold their blocks for good: others use the free)
                    continue
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                self._grow(seq, num_new, out)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            seq.last_scheduled_step = self._step
            budget -= num_new
        return budget

    def _fitting(self, seq: Sequence, num_new: int) -> int:
        """The part of `seq`'s next `num_new` tokens that the free blocks hold: a prefill chunk clipped to them (a
        decode whole or not at all)."""
        bm = self.block_manager
        blocks = len(seq.block_table) + bm.num_free_blocks - int(self._write_block_shared(seq))
        return max(0, min(num_new, blocks * bm.block_size - seq.num_computed_tokens))

    def _decodes_served(self, budget: int) -> set[int] | None:
        """When the budget is short of the running decodes (a step composer's time target beside a busy interactive
        pool), the ids of the `budget` of them scheduled longest ago (in running order among equals): a short budget
        slows every decode of the pool in turn, never starves the ones behind. None when it covers them all."""
        decodes = [s for s in self.running
                   if s.num_uncomputed_tokens == 1 and not self.is_paused(s) and not self._ending(s)]
        if len(decodes) <= budget:
            return None
        oldest = sorted(range(len(decodes)), key=lambda k: (decodes[k].last_scheduled_step, k))[:budget]
        return {id(decodes[k]) for k in oldest}

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        """Swapped-out sequences back in, in waiting-queue order (priority, then arrival), while blocks and limits
        allow; returns the budget left."""
        resumable = [s for s in self.swapped if not self.is_paused(s)]
        while resumable and budget > 0 and self._num_seqs_held() + 1 + resumable[0].num_pending_forks <= \
                self.config.max_num_seqs:
            seq = resumable[0]
            num_new, bm = min(seq.num_uncomputed_tokens, budget, self._max_step), self.block_manager
            counted = (bm.num_prefix_queries, bm.num_prefix_hits)   # the cache's hit counts stay the prompts'
            shared = bm.acquire_cached(seq.block_table, seq.token_ids[:seq.num_computed_tokens + 1], seq.cache_salt)
            bm.num_prefix_queries, bm.num_prefix_hits = counted     # (blocks a sibling holds take no free one)
            if not bm.can_allocate(seq.block_table, seq.num_computed_tokens + num_new):
                bm.free(seq.block_table)
                break
            self.swapped.remove(resumable.pop(0))
            self._swap_in(seq, num_new, shared, out)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, before: tuple[bool, int] | None = None) -> None:
        """Admit waiting sequences in strict order (their cached prefix first) while limits allow, only those
        more urgent than `before` (a swapped sequence's (background, priority), which resumes first). One
        whose next prompt block a running sequence is prefilling right now waits for it (it is skipped,
        not a block to the others): admitted after, it finds the block in the prefix cache instead of
        computing the same prefix again beside it (questions on a document that is being read)."""
        bm = self.block_manager
        index = 0
        while index < len(self.waiting) and budget > 0:
            seq = self.waiting[index]
            if self.is_paused(seq):   # passed by the others; admitted once resumed
                index += 1
                continue
            if before is not None and (seq.background, seq.priority) >= before:
                break
            if self._num_seqs_held() + 1 + seq.num_pending_forks > self.config.max_num_seqs:
                break
            counted = (bm.num_prefix_queries, bm.num_prefix_hits)
            if seq.num_computed_tokens == 0 and not seq.block_table and not seq.wants_prompt_logits:
                seq.num_computed_tokens = bm.acquire_cached(seq.block_table, seq.token_ids, seq.cache_salt)
            load = self.state_snapshots.admit(seq) if self.state_snapshots and seq.block_table else None
            num_new = min(seq.num_uncomputed_tokens, budget, self._max_step)
            reading = self._being_read(seq)
            if reading or (num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill) or \
                    not bm.can_allocate(seq.block_table, seq.num_computed_tokens + num_new):
                bm.free(seq.block_table)  # give back the cached prefix; the next try finds it again
                bm.num_prefix_queries, bm.num_prefix_hits = counted  # counted once, when admitted
                seq.num_computed_tokens = 0
                if reading:
                    self.stats.num_prefix_waits += 1
                    index += 1
                    continue
                if not self.running and bm.num_free_blocks == bm.num_blocks and \
                        bm.num_blocks_for(seq.num_tokens) > bm.num_blocks:
                    self.waiting.pop(index)  # alone in an empty pool and still too large: it never will fit
                    self._finish_too_large(seq, out)
                    continue
                break  # strict order: later arrivals do not overtake the head of the queue
            self.waiting.pop(index)
            bm.allocate(seq.block_table, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            seq.admitted_at_output = seq.num_output_tokens
            seq.last_scheduled_step = self._step
            self.running.append(seq)
            self.stats.num_admitted += 1
            out.scheduled.append(ScheduledSeq(seq, num_new, state_load=load))
            if load is not None:
                self.state_snapshots.num_loaded += 1
            budget -= num_new

    def _num_seqs_held(self) -> int:
        """The sequences running, and the samples their first samples will fork once prefilled (n > 1): what
        counts against max_num_seqs (the forks join `running` without passing admission)."""
        return len(self.running) + sum(s.num_pending_forks for s in self.running)

    def _being_read(self, seq: Sequence) -> bool:
        """Whether a running sequence of the pool is prefilling the next block `seq` would otherwise
        compute itself: the same tokens up to that block's end (same prefix-cache partition), not yet
        computed there, and not paused. Only with prefix caching (without it nothing would be shared)."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or seq.wants_prompt_logits:   # it computes its prompt itself
            return False
        end = seq.num_computed_tokens + bm.block_size
        if end > seq.num_tokens - 1:      # no further whole block it could take from the cache
            return False
        head = seq.token_ids[:end]
        return any(other.num_uncomputed_tokens > 1 and other.cache_salt == seq.cache_salt
                   and other.num_computed_tokens < end <= other.num_tokens and other.token_ids[:end] == head
                   and not self.is_paused(other)   # a paused reader reads nothing: it would hold `seq` back for good
                   for other in self.running)

    def _write_block_shared(self, seq: Sequence) -> bool:
        """Whether the block the next token goes into is shared (a fork's prompt tail): copy on write."""
        index = seq.num_computed_tokens // self.block_manager.block_size
        return index < len(seq.block_table) and self.block_manager.ref_count(seq.block_table[index]) > 1

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        return self.block_manager.num_new_blocks(seq.block_table, seq.num_computed_tokens + num_new) + \
            int(self._write_block_shared(seq))

    def _grow(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        bm = self.block_manager
        if self._write_block_shared(seq) and (copy := bm.copy_on_write(
                seq.block_table, seq.num_computed_tokens // bm.block_size)) is not None:
            out.move("copy", [copy])
        bm.allocate(seq.block_table, seq.num_computed_tokens + num_new)

    # --- preemption --------------------------------------------------------------------------
    def _ending(self, seq: Sequence) -> bool:   # its last token is in flight: no step, blocks free when it lands
        return bool(seq.num_pending) and seq.ends_when_known(self.max_model_len)

    @property
    def blocks_coming(self) -> bool:
        """Whether a running sequence's last token is in flight: its blocks come back a step later."""
        return any(self._ending(s) for s in self.running)

    def _ending_blocks(self) -> int:   # the blocks the ending sequences alone hold (n samples' shared ones too)
        held = Counter(b for s in self.running if self._ending(s) for b in s.block_table)   # back a step later
        return sum(self.block_manager.ref_count(b) == n for b, n in held.items())

    def _held_by_paused(self, seq: Sequence) -> bool:
        """Whether all running sequences but `seq` are paused or ending, one paused: preempting itself would not
        help (without the prefix cache it is admitted again at once and re-prefills up to the same shortage)."""
        return any(self.is_paused(s) for s in self.running) and \
            all(s is seq or self.is_paused(s) or self._ending(s) for s in self.running)

    def _pick_victim(self, needy: Sequence) -> Sequence:
        """The running sequence to preempt so that `needy` can grow, by the pool's victim policy. Sequences under
        the stability floor are spared while another candidate exists. Paused ones keep their blocks, and ending
        ones give theirs back a step later: neither is a victim."""
        floor = self.config.stability_floor_tokens
        active = [s for s in self.running if not self.is_paused(s) and not self._ending(s)]
        candidates = [s for s in active if s.num_output_tokens - s.admitted_at_output >= floor] or active
        return victim_by_policy(self.config.victim_policy, candidates, self.running, self._served)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Preempt `seq`; returns the token budget given back if it was already scheduled this step."""
        started = time.perf_counter()
        k = next((k for k, item in enumerate(out.scheduled) if item.seq is seq), None)
        given_back = out.scheduled.pop(k).num_new_tokens if k is not None else 0
        self.running.remove(seq)
        self._cache_computed(seq)   # kept past its blocks' free (recompute) or swap-out, as a finished one's
        self.stats.num_preemptions += 1
        seq.num_preemptions += 1
        out.preempted.append(seq)
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = self.cost_model.choose(seq.num_computed_tokens) if self.cost_model else "recompute"
        if mode == "swap" and self._swap_out(seq, out):
            self.stats.num_swap_preemptions += 1
        else:
            self.stats.num_recompute_preemptions += 1
            self.stats.num_recomputed_tokens += seq.num_computed_tokens
            self.block_manager.free(seq.block_table)
            seq.num_computed_tokens = 0
            self.add(seq)
        self.stats.preempt_seconds += time.perf_counter() - started
        return given_back

    def _swap_out(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Copy the computed blocks to CPU and free the device blocks; False if the CPU pool is full."""
        bm, cpu = self.block_manager, self.swap_manager
        num_blocks = bm.num_blocks_for(seq.num_computed_tokens)
        cpu_table: list[int] = []
        try:
            cpu.allocate(cpu_table, seq.num_computed_tokens)
        except NoFreeBlocksError:
            return False
        out.move("swap_out", list(zip(seq.block_table[:num_blocks], cpu_table)))
        self.stats.num_swapped_out_blocks += num_blocks
        bm.free(seq.block_table)
        seq.cpu_block_table = cpu_table
        seq.status = SequenceStatus.SWAPPED
        bisect.insort(self.swapped, seq, key=Sequence.sort_key)
        return True

    def _swap_in(self, seq: Sequence, num_new: int, shared: int, out: SchedulerOutput) -> None:
        """Its full blocks the prefix cache still holds (registered at its swap-out, or a sibling's: the `shared`
        tokens already in its table) are shared again, not copied back; the rest is copied from its CPU blocks."""
        bm = self.block_manager
        bm.allocate(seq.block_table, seq.num_computed_tokens + num_new)
        shared //= bm.block_size
        out.move("swap_in", list(zip(seq.cpu_block_table[shared:], seq.block_table[shared:])))
        self.stats.num_swapped_in_blocks += len(seq.cpu_block_table) - shared
        self.swap_manager.free(seq.cpu_block_table)
        seq.status, seq.admitted_at_output = SequenceStatus.RUNNING, seq.num_output_tokens
        seq.last_scheduled_step = self._step
        self.running.append(seq)

    def _finish_too_large(self, seq: Sequence, out: SchedulerOutput) -> None:
        bm = self.block_manager
        if seq.status is SequenceStatus.WAITING and seq not in self.waiting:
            seq.status = SequenceStatus.FINISHED  # already taken off the queue
        seq.error = (f"prompt: pool {self.name!r} cannot hold this sequence: it needs "
                     f"{bm.num_blocks_for(seq.num_tokens)} blocks of {bm.block_size} tokens, the pool has "
                     f"{bm.num_blocks}")
        self.stats.num_too_large += 1
        self.finish(seq, FinishReason.LENGTH)
        out.finished.append(seq)

    # --- leaving -----------------------------------------------------------------------------
    def _cache_computed(self, seq: Sequence) -> None:   # a block whose last token was in flight at its commit
        self.block_manager.register_computed(seq.block_table, seq.token_ids, min(   # (overlap) is cached now
            seq.num_computed_tokens, len(seq.token_ids) - seq.num_pending), seq.cache_salt)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take the sequence out of the pool and free its blocks (finished, stopped or aborted)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap_manager.free(seq.cpu_block_table)
        self._cache_computed(seq)
        self.block_manager.free(seq.block_table)
        seq.drop_pending()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.stats.num_aborted += reason is FinishReason.ABORT
        if self.is_paused(seq) and all(s.request_id != seq.request_id for s in (*self.running, *self.waiting,
                                                                                *self.swapped)):
            self.paused.discard(seq.request_id)   # its last sequence here ended

    def check_integrity(self) -> None:
        """The block managers agree with the live sequences' tables: waiting ones hold no blocks,
        swapped ones hold only CPU blocks (admission allocates, preemption frees everything)."""
        for seq in (*self.waiting, *self.swapped):
            if seq.block_table:
                raise AssertionError(f"{seq.status.name.lower()} sequence {seq.seq_id} holds blocks {seq.block_table}")
        self.block_manager.check_integrity([s.block_table for s in self.running])
        if self.swap_manager is not None:
            self.swap_manager.check_integrity([s.cpu_block_table for s in self.swapped])


def build_scheduler(pool: PoolConfig, *, block_size: int, first_block: int, max_model_len: int,
                    bytes_per_block: int, kv_bytes_per_token: int,
                    swap_bytes_per_second: float | None = None, swap_latency_seconds: float = 0.0) -> Scheduler:
    """One pool's scheduler: its blocks from `first_block` on, its CPU swap block ids (swap and auto
    modes: `swap_space_bytes // bytes_per_block` of them) and the auto mode's cost model. The engine
    and the simulator (pools.simulation) both build their schedulers here, so both schedule alike; the
    engine allocates the swap tensors beside it and sets the swap copies' measured bandwidth and latency."""
    sc = pool.scheduler
    bm = BlockManager(pool.num_blocks, block_size, first_block=first_block,
                      enable_prefix_caching=sc.enable_prefix_caching)
    swap_manager = cost_model = None
    if sc.uses_swap:
        num_cpu_blocks = sc.swap_space_bytes // bytes_per_block
        if num_cpu_blocks <= 0:
            raise ConfigError(f"pools.{pool.name}.swap_space_bytes: {sc.swap_space_bytes} bytes hold no "
                              f"block of {bytes_per_block} bytes")
        swap_manager = BlockManager(num_cpu_blocks, block_size)
        cost_model = PreemptionCostModel(kv_bytes_per_token, chunk_tokens=sc.max_num_batched_tokens,
                                         swap_bytes_per_second=swap_bytes_per_second,
                                         swap_latency_seconds=swap_latency_seconds)
    return Scheduler(sc, bm, max_model_len, name=pool.name, swap_manager=swap_manager, cost_model=cost_model)
