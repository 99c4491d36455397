"""Which replica of a pool serves a request: the one that can start it soonest, by token load and
prefix affinity. Ints and hashes only (no asyncio), tested in milliseconds; `pools.credits.queue` asks
it each time its ledger admits a request on a pool with several replicas.

The gateway keeps, per replica, its **token load**: the work its admitted requests still ask of it,

    load_r = sum of prefill tokens not computed yet   (a request's uncached prompt, until its first token)
           + sum of output tokens still to come        (max_tokens - generated, each sample capped at avg_len)

and which prompt blocks it has likely cached: the chain hashes of the full blocks of every prompt
sent to it (salted with the request's prefix-cache partition, as the engine salts them), least
recently used first out, at most as many as the pool has blocks (the engine's cache holds no more;
it evicts the least recently used, as this does). The engine corrects the guess: each request's
final output says how many of its prompt tokens it found cached (`engine_cached`); when that is fewer
than the record promised, the first block it missed was evicted, and with it (LRU) every block used
less recently than that one: they leave the record (not for a block another request there was still
computing when it was placed: no evidence of an eviction). The record survives a reconnection to the same
replica process (its cache is intact) and is wiped when a new process serves the replica (`forget`).

A request of p prompt tokens whose first m tokens are cached on replica r (whole blocks), s of them
still being prefilled there by a running request, scores

    score_r = load_r - s + (p - m)

(the s tokens are in load_r as that request's prefill, and the new one needs exactly that work done
wherever it goes: elsewhere it computes the blocks itself; without this, a document's second
question would leave the replica that is reading the document for its first).

The request goes to the lowest score among the replicas where its KV credits fit (a tie: more free
credits, then the lower index), except that a replica caching more of its prompt than the others
keeps it unless that replica is clearly busier: unless its score is over `1 + AFFINITY_SLACK` (1.25)
times the lowest. That holds too when the caching replica has no room for it now: the request then
waits in the pool's queue until that replica's credits come back (its score counts the work whose
end frees them; the queue bounds that wait: `pools.credits.queue`), rather than reading the document again on a replica that has room; it holds back
only that replica meanwhile, the others serve the rest of the queue (`pools.credits.ledger`). Scores
are estimates (outputs at their cap, a cache assumed from what was sent), and a prompt sent where it is
cached saves the whole system its prefill, while one sent elsewhere costs it again there. So with nothing cached requests spread by the tokens they ask for, not by
their count, and a prompt whose prefix one replica holds goes there unless that replica would start
it more than a quarter later than another. The load counts only what the gateway knows at once
(admissions, first tokens, tokens streamed), never a worker's report, so two requests admitted in
the same instant see each other.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


AFFINITY_SLACK = 0.25   # the replica caching most of a prompt is clearly busier when it would start it 25% later


@dataclass(frozen=True)
class Work:
    """What a request asks of a replica: its prompts' token ids, the output tokens it may take per
    prompt (every sample together, each capped), and its prefix-cache partition."""

    prompts: tuple[tuple[int, ...], ...]
    output_tokens: int
    salt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass
class _Running:
    replica: int
    prefill: int          # uncached prompt tokens not computed yet (0 from the first token on)
    output: int           # output tokens still to come (the estimate)
    cached: int           # prompt tokens it found cached there when placed
    computing: list[int]  # hashes of the blocks it computes itself, until its first token
    promised: list[tuple[int, tuple[int, ...]]]   # per prompt: its length, the last use of each leading block
                                                  # found cached (and computed) there


def block_hashes(ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The chain hash of each full block of `ids`: block i's hash covers every token before its end."""
    hashes, prev = [], hash(("cliffguard-prefix", salt))
    for start in range(0, len(ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(ids[start:start + block_size])))
        hashes.append(prev)
    return hashes


class Placement:
    """The token load and likely-cached blocks of each replica of one pool. Event-loop only."""

    def __init__(self, num_replicas: int, block_size: int, max_cached_blocks: int, avg_len: int = 1024,
                 share_blocks: bool = True) -> None:
        self.block_size = block_size
        self.share_blocks = share_blocks   # the pool's engine has its prefix cache on (`enable_prefix_caching`)
        self.max_cached_blocks = max_cached_blocks
        self.avg_len = avg_len
        self.load = [0] * num_replicas
        self._cached: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(num_replicas)]   # hash -> last use
        self._clock = 0                                   # uses so far (`start`s): a block's last use is one
        self._computing: list[dict[int, int]] = [{} for _ in range(num_replicas)]   # hash -> requests prefilling it
        self._running: dict[str, _Running] = {}

    def work(self, prompts: Sequence[Sequence[int]], max_tokens: int | None, n: int, max_model_len: int,
             salt: str | None = None) -> Work:
        """A request's Work: each sample's output capped at max_tokens (unset: the context left) and at avg_len."""
        per_prompt = []
        for ids in prompts:
            limit = max_tokens if max_tokens is not None else max(1, max_model_len - len(ids))
            per_prompt.append(n * min(limit, self.avg_len))
        return Work(tuple(tuple(p) for p in prompts), sum(per_prompt), salt)

    def prompt_blocks(self, work: Work) -> tuple[int, ...]:
        """The chain hashes of the prompt blocks `work` may share with other requests on a replica, distinct,
        in order: each prompt's full blocks before its last token (the engine computes a prompt's last token
        itself, so a prompt of whole blocks reuses all but its last: `BlockManager.acquire_cached`); none
        where the engine caches no prefix."""
        if not self.share_blocks:
            return ()
        return tuple(dict.fromkeys(h for ids in work.prompts
                                   for h in block_hashes(ids[:len(ids) - 1], self.block_size, work.salt)))

    def matched_tokens(self, work: Work, replica: int) -> int:
        """Prompt tokens of `work` whose blocks replica `replica` likely has cached (leading whole blocks)."""
        return self._match(work, replica)[0]

    def _match(self, work: Work, replica: int) -> tuple[int, int, list[int]]:
        """(tokens of the leading blocks likely cached on `replica`, those of them a running request there is
        still prefilling, the hashes of the prompt blocks past the cached ones); none without a prefix cache."""
        if not self.share_blocks:
            return 0, 0, []
        cached, computing = self._cached[replica], self._computing[replica]
        matched = shared = 0
        rest: list[int] = []
        for ids in work.prompts:
            hashes = block_hashes(ids, self.block_size, work.salt)
            for i, h in enumerate(hashes):
                if h not in cached:
                    rest += hashes[i:]
                    break
                matched += self.block_size
                shared += self.block_size if computing.get(h) else 0
        return matched, shared, rest

    def scores(self, work: Work, replicas: Sequence[int]) -> dict[int, int]:
        """Each replica's score for `work` (lower starts it sooner)."""
        return self._scores(work, {r: self._match(work, r) for r in replicas})

    def _scores(self, work: Work, matches: dict[int, tuple[int, int, list[int]]]) -> dict[int, int]:
        """The scores from each replica's `_match` of `work`."""
        p = work.num_prompt_tokens
        return {r: self.load[r] - shared + p - matched for r, (matched, shared, _) in matches.items()}

    def choose(self, work: Work, fitting: Sequence[int], free: Sequence[int],
               waiting: Sequence[int] = ()) -> int | None:
        """The replica among `fitting` that starts `work` soonest, or the one that caches most of its prompt
        unless that one is clearly busier; `free[r]`: replica r's free credits. `waiting`: replicas that
        are up but where it may not go now (no room: their credits come back as their requests end). When
        the replica caching most of the prompt is one of those and is not clearly busier, None: the request
        waits for it rather than computing its prefix again elsewhere (its score counts the load that frees
        it)."""
        matches = {r: self._match(work, r) for r in (*fitting, *waiting)}   # hashes each prompt once per replica
        scores = self._scores(work, matches)
        soonest = min(fitting, key=lambda r: (scores[r], -free[r], r))
        matched = {r: m[0] for r, m in matches.items()}
        most = max(matched.values())
        if most and most != min(matched.values()):
            affine = min((r for r in scores if matched[r] == most), key=lambda r: (scores[r], -free[r], r))
            if scores[affine] <= (1 + AFFINITY_SLACK) * scores[soonest]:
                return affine if affine in fitting else None
        return soonest

    # --- what happened ----------------------------------------------------------------------------
    def start(self, key: str, replica: int, work: Work) -> int:
        """`work` (request `key`) now runs on `replica`: its load counts there and its prompt blocks are
        cached there from now on. Returns the prompt tokens that were already cached there."""
        matched, _, computing = self._match(work, replica)
        cached, pending = self._cached[replica], self._computing[replica]
        self._clock += 1
        promised = []   # blocks another request there is still computing promise nothing the engine must have
        for ids in work.prompts if self.share_blocks else ():   # without a prefix cache nothing is kept
            hashes = block_hashes(ids, self.block_size, work.salt)
            uses = itertools.takewhile(lambda use: use is not None, (None if pending.get(h) else cached.get(h)
                                                                     for h in hashes))
            promised.append((len(ids), tuple(uses)))
            for h in hashes:
                cached[h] = self._clock
                cached.move_to_end(h)
        while len(cached) > self.max_cached_blocks:
            cached.popitem(last=False)
        running = _Running(replica, work.num_prompt_tokens - matched, work.output_tokens, matched, computing,
                           promised)
        self._running[key] = running
        self.load[replica] += running.prefill + running.output
        for h in computing:
            self._computing[replica][h] = self._computing[replica].get(h, 0) + 1
        return matched

    def engine_cached(self, key: str, prompt: int, num_tokens: int) -> None:
        """Running request `key`'s engine found `num_tokens` of prompt `prompt`'s tokens (of its `Work`)
        cached. Fewer than the record promised (whole blocks, at most the prompt's length - 1, as the
        engine counts them): the first block it missed was evicted, so every block used before that one's
        last use leaves the record (the engine evicts the least recently used first)."""
        running = self._running.get(key)
        if running is None or not 0 <= prompt < len(running.promised):
            return
        prompt_len, uses = running.promised[prompt]
        found = num_tokens // self.block_size
        if found >= min(len(uses), max(0, prompt_len - 1) // self.block_size):
            return
        missed, cached = uses[found], self._cached[running.replica]
        while cached and next(iter(cached.values())) < missed:
            cached.popitem(last=False)

    def cached_tokens(self, key: str) -> int:
        """The prompt tokens running request `key` found cached where it was placed (0 if unknown)."""
        running = self._running.get(key)
        return running.cached if running is not None else 0

    def observe(self, key: str, num_tokens: int) -> None:
        """Request `key` streamed `num_tokens` more tokens: its prefill is done, its output goes down."""
        running = self._running.get(key)
        if running is None or num_tokens <= 0:
            return
        done = running.prefill + min(num_tokens, running.output)
        running.prefill, running.output = 0, running.output - min(num_tokens, running.output)
        self.load[running.replica] -= done
        self._computed(running)

    def finish(self, key: str) -> None:
        """Request `key` ended (finished, failed or aborted): what it still asked is no load any more."""
        running = self._running.pop(key, None)
        if running is not None:
            self.load[running.replica] -= running.prefill + running.output
            self._computed(running)

    def _computed(self, running: _Running) -> None:
        """`running`'s own blocks are computed (its first token came) or never will be (it ended)."""
        computing = self._computing[running.replica]
        for h in running.computing:
            computing[h] -= 1
            if not computing[h]:
                del computing[h]
        running.computing = []

    def forget(self, replica: int) -> None:
        """A new process serves `replica`: its prefix cache is empty."""
        self._cached[replica].clear()

    def check_integrity(self) -> None:
        """Each replica's load is the sum of what its running requests still ask; raises with the numbers."""
        expected = [0] * len(self.load)
        for running in self._running.values():
            expected[running.replica] += running.prefill + running.output
        if expected != self.load:
            raise AssertionError(f"placement load {self.load}, running requests sum to {expected}")
        computing = [{} for _ in self.load]
        for running in self._running.values():
            for h in running.computing:
                computing[running.replica][h] = computing[running.replica].get(h, 0) + 1
        if computing != self._computing:
            raise AssertionError("placement: the blocks being prefilled do not match the running requests'")
