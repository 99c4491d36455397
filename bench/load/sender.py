"""One request of a load, sent and measured: its record (`RequestRecord`: send time, every content
chunk, usage, errors, the pool that served it) and the SSE reading that fills it."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.load.plan import LoadConfig, PlannedRequest, request_body
from pools.workload import ENDPOINTS
from pools.config.checks import is_int

POOL_HEADER = "x-cliffguard-pool"
REPLICA_HEADER = "x-cliffguard-replica"
DONE = "[DONE]"


# --- one request ------------------------------------------------------------------------------------------

def parse_sse_line(line: bytes | str) -> Any:
    """One line of a server-sent event stream -> the JSON value of a `data:` line, `DONE` for
    `data: [DONE]`, None for anything else (blank lines, comments, `event:`/`id:` fields). A `data:` line
    that is not JSON raises ValueError."""
    if isinstance(line, bytes):
        line = line.decode("utf-8")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    return DONE if payload == DONE else json.loads(payload)


def error_message(payload: Any, limit: int = 300) -> str:
    """The message of an OpenAI error body (`{"error": {"message": ...}}`, a JSON text of it, or any text)."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            return payload.strip()[:limit]
    if isinstance(payload, dict) and "error" in payload:
        payload = payload["error"]
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return payload["message"][:limit]
    return (payload if isinstance(payload, str) else json.dumps(payload))[:limit]


@dataclass
class RequestRecord:
    """What one request did. `*_s` times are seconds from the run's start, except `chunk_s`: the arrival of
    each content chunk, in seconds from the request's send time (so TTFT = chunk_s[0]).

    `status`: ok | error | unfinished (timed out, cancelled at the drain timeout, or never sent).
    Written only by the task that sends the request, then by the drain.
    """

    index: int
    class_name: str
    endpoint: str
    scheduled_s: float
    prompt_len: int
    max_tokens: int
    sent_s: float | None = None
    end_s: float | None = None
    status: str = "unfinished"
    error: str | None = "never sent"
    http_status: int | None = None
    pool: str | None = None
    replica: str | None = None        # the replica that answered (`x-cliffguard-replica`), when the server says
    prefix: int | None = None         # the shared document its prompt starts with (a class with `shared_prefix`)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)

    def add_chunk(self, chunk: Any, t: float) -> None:
        """Apply one parsed stream chunk that arrived `t` s after the request was sent."""
        if not isinstance(chunk, dict):
            raise ValueError(f"stream chunk is not a JSON object: {str(chunk)[:200]}")
        if chunk.get("error") is not None:
            self.status, self.error = "error", "error chunk: " + error_message(chunk)
            return
        tokens = 1
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if is_int(usage.get("prompt_tokens")):
                self.prompt_tokens = usage["prompt_tokens"]
            if is_int(usage.get("completion_tokens")):
                tokens = usage["completion_tokens"] - (self.output_tokens or 0)
                self.output_tokens = usage["completion_tokens"]
        text = ""
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text += choice.get("text") or delta.get("content") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if text:
            self.chunk_s.append(t)
            self.chunk_tokens.append(max(1, tokens))

    @property
    def send_lag(self) -> float:
        """How late the request left against its scheduled arrival (the client's own delay: 0 when on time)."""
        return max(0.0, self.sent_s - self.scheduled_s) if self.sent_s is not None else 0.0

    @property
    def ttft(self) -> float | None:
        """From the scheduled arrival (open loop: a client that sent late makes no latency vanish) to the first
        token."""
        return self.send_lag + self.chunk_s[0] if self.chunk_s else None

    @property
    def e2e(self) -> float | None:
        """From the scheduled arrival to the end of the answer."""
        return self.end_s - self.sent_s + self.send_lag if self.status == "ok" else None

    @property
    def itl(self) -> list[float]:
        """One gap per output token after the first (`LoadConfig.continuous_usage`): a chunk that carried n
        tokens `wait` s after the one before counts as n gaps of wait / n, so a stall that delivered n tokens
        at once weighs in the percentiles as the n tokens it delayed, not as one."""
        return [(b - a) / n for a, b, n in zip(self.chunk_s, self.chunk_s[1:], self.chunk_tokens[1:])
                for _ in range(n)]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens from the usage chunk, else the content chunks' count."""
        return self.output_tokens if self.output_tokens is not None else sum(self.chunk_tokens)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e - TTFT) / (output tokens - 1)."""
        n = self.num_output_tokens
        if self.status != "ok" or self.ttft is None or n < 2:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(ttft_s=self.ttft, tpot_s=self.tpot, e2e_s=self.e2e)
        return data


async def _read_stream(response: Any, record: RequestRecord, sent: float) -> None:
    """Feed every `data:` line of an SSE response to `record` until `data: [DONE]`."""
    buffer = b""
    async for data in response.content.iter_any():
        now = time.perf_counter() - sent
        *lines, buffer = (buffer + data).split(b"\n")
        for line in lines:
            event = parse_sse_line(line)
            if event == DONE:
                if record.status != "error":
                    record.status, record.error = "ok", None
                return
            if event is not None:
                record.add_chunk(event, now)
    if record.status != "error":
        record.status, record.error = "error", "stream ended without data: [DONE]"


async def send_request(session: Any, config: LoadConfig, model: str, planned: PlannedRequest,
                       record: RequestRecord, start: float) -> None:
    """Send one request and fill `record` as its stream arrives; failures land in the record, never raised
    (cancellation aside: the caller marks a cancelled record)."""
    import aiohttp

    url = config.base_url + ENDPOINTS[planned.workload.endpoint]
    body = request_body(planned, model, config.continuous_usage)
    sent = time.perf_counter()
    record.sent_s, record.error = sent - start, "in flight"
    try:
        async with asyncio.timeout(config.timeout):
            async with session.post(url, json=body, headers=config.headers()) as response:
                record.http_status = response.status
                record.pool = response.headers.get(POOL_HEADER)
                record.replica = response.headers.get(REPLICA_HEADER)
                if response.status != 200:
                    text = await response.text(errors="replace")
                    record.status, record.error = "error", f"HTTP {response.status}: {error_message(text)}"
                    return
                await _read_stream(response, record, sent)
    except TimeoutError:
        record.status, record.error = "unfinished", f"timeout: no end of stream within {config.timeout:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        record.status, record.error = "error", f"{type(exc).__name__}: {exc}"[:300]
    finally:
        record.end_s = time.perf_counter() - start
