"""A device of the configuration (`devices.<name>` in the YAML): where its pools run, on how many GPUs,
as how many replicas (a fixed number, or autoscaled between a min and a max), on this machine or on a
Ray cluster.

`DeviceSpec` is a frozen msgspec model (`pools.config.checks.Spec`): its field types are the schema and
`check()` the rules across fields; its errors are `SpecError`s whose key path the YAML loader
(`pools.config.yaml_file`) prefixes with `devices.<name>`. `pools.config.spec` re-exports it. The keys
are documented in `config/README.md`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal, get_args

import msgspec

from engine.capacity import DEFAULT_MEMORY_UTILIZATION
from engine.config import (DEFAULT_COLLECTIVE_TIMEOUT_SECONDS, KV_CACHE_DTYPES, QUANTIZATIONS, SLIDING_KV,
                           check_device_name, parse_dtype)
from pools.config.checks import ByteSize, Fraction, Seconds, Spec, SpecError, Text, engine_rules

MIN_COLLECTIVE_TIMEOUT_SECONDS = 1.0   # `collective_timeout_seconds`: below a step's own time on a loaded host
MAX_COLLECTIVE_TIMEOUT_SECONDS = 86_400.0   # a day: a rank that late is hung whatever the step (and past what
                                            # torch.distributed's timedelta holds, a rank's start fails)

KvCacheDtype = Literal[KV_CACHE_DTYPES]   # engine.config's choices, one definition
SlidingKv = Literal[SLIDING_KV]
Quantization = Literal[QUANTIZATIONS]
Placement = Literal["local", "ray"]   # local: worker processes on this machine; ray: actors on a Ray cluster
PLACEMENTS: tuple[str, ...] = get_args(Placement)
# Autoscaled devices: a request of the device's pools that has waited this long for KV credits adds a
# replica (the wait `pools.demand` counts as a backlog: longer than a queue that drains on its own) ...
DEFAULT_SCALE_UP_WAIT_SECONDS = 2.0
# ... and a replica idle (no request in flight, none admitted) or spare (its load carried by the others at most
# half full: `gateway.workers.autoscaler`) this long is stopped, down to min: a
# minute outlasts the gaps between bursts, so a replica is not reloaded for each one.
DEFAULT_SCALE_DOWN_IDLE_SECONDS = 60.0
RAY_ADDRESS_ENV = "RAY_ADDRESS"   # Ray's own variable: the cluster `ray.init()` joins
GpuIndex = Annotated[int, msgspec.Meta(ge=0)]
MAX_SLOTS = 1024   # replicas of one device, ranks of one replica, torch threads of a rank: far past any machine's
Slots = Annotated[int, msgspec.Meta(ge=1, le=MAX_SLOTS)]
Threads = Slots


class ReplicaRange(Spec):
    """YAML `replicas: {min, max, scale_up_wait_seconds, scale_down_idle_seconds}`: an autoscaled device,
    read into DeviceSpec's `min_replicas`, `replicas` (the max) and timings."""

    min: Slots
    max: Slots
    scale_up_wait_seconds: Seconds = DEFAULT_SCALE_UP_WAIT_SECONDS
    scale_down_idle_seconds: Seconds = DEFAULT_SCALE_DOWN_IDLE_SECONDS

    def device_fields(self) -> dict[str, int | float]:
        return {"replicas": self.max, "min_replicas": self.min, "scale_up_wait_seconds": self.scale_up_wait_seconds,
                "scale_down_idle_seconds": self.scale_down_idle_seconds}


class DeviceSpec(Spec):
    """A device that local pools run on: one copy of the weights and one KV tensor, over
    `tensor_parallel_size` GPUs (one worker process per rank), run as up to `replicas` identical copies.

    `replicas` is the number of replica slots: everything per replica (the capacity plan, the engine
    config of each replica, the GPUs claimed) is planned for all of them. An autoscaled device
    (`min_replicas` below `replicas`) starts `min_replicas` of them and the gateway starts and stops the
    others by load (`scale_up_wait_seconds`, `scale_down_idle_seconds`); a fixed one runs them all.

    GPUs: with `gpus` listed, replica r takes `gpus[r·T:(r+1)·T]`; otherwise replica r takes the T GPUs
    after the device's own index (`cuda`: 0, `cuda:N`: N) and those of the replicas before it. With
    `placement: ray` the replicas run on a Ray cluster, which assigns their GPUs: `gpus` is refused and
    the device claims none of this machine's.
    """

    NOT_IN_YAML = ("name", "min_replicas", "scale_up_wait_seconds", "scale_down_idle_seconds")

    name: Text = "default"               # the key under `devices`
    device: str = "auto"                 # auto | cpu | cuda | cuda:N
    memory_bytes: ByteSize | None = msgspec.field(default=None, name="memory")   # None (auto): the GPU's total
    memory_utilization: Fraction = DEFAULT_MEMORY_UTILIZATION   # the capacity formula's 0.9
    dtype: str = "auto"                  # auto | float32 | bfloat16 | float16
    tensor_parallel_size: Slots = 1      # GPUs of one replica (engine.parallel)
    replicas: Slots = 1                  # replica slots (autoscaled: the max), each serving every pool of the device
    gpus: Annotated[tuple[GpuIndex, ...], msgspec.Meta(min_length=1)] | None = None   # CUDA: the ranks' GPUs
    cpu_threads: Threads | None = None     # CPU: torch threads of each rank (None: the cores shared out)
    enforce_eager: bool = False          # CUDA: no decode graphs (their memory is then not set aside)
    async_scheduling: bool | None = None  # overlapped steps (engine.overlap); None: on CUDA
    kv_cache_dtype: KvCacheDtype = "auto"   # auto: the model's dtype; fp8: e4m3, 1 byte an element of S_KV
    sliding_kv: SlidingKv = "auto"       # sliding layers' K/V: window (a ring a sequence) | full (engine.sliding_kv)
    quantization: Quantization = "auto"   # the weights: auto (FP8, MXFP4 checkpoints kept so on CUDA), fp8, mxfp4, none
    calculate_kv_scales: bool = True     # fp8 without the checkpoint's scales: measured at start (false: 1.0)
    collective_timeout_seconds: Seconds = DEFAULT_COLLECTIVE_TIMEOUT_SECONDS   # tensor parallel: a rank this late is hung
    min_replicas: Slots | None = None    # autoscaled: the replicas always up (None: fixed, all `replicas` up)
    scale_up_wait_seconds: Seconds = DEFAULT_SCALE_UP_WAIT_SECONDS      # autoscaled: waited for credits this long: +1
    scale_down_idle_seconds: Seconds = DEFAULT_SCALE_DOWN_IDLE_SECONDS  # autoscaled: a replica idle this long: -1
    placement: Placement = "local"
    ray_address: Text | None = None      # placement ray: the cluster (None: the RAY_ADDRESS environment variable)

    def check(self) -> None:
        if self.collective_timeout_seconds < MIN_COLLECTIVE_TIMEOUT_SECONDS:
            raise SpecError("collective_timeout_seconds", f"must be at least {MIN_COLLECTIVE_TIMEOUT_SECONDS:g} s (a "
                            "step's all-reduces wait for its slowest rank: shorter, a healthy step fails and the "
                            f"replica restarts), got {self.collective_timeout_seconds}")
        if self.collective_timeout_seconds > MAX_COLLECTIVE_TIMEOUT_SECONDS:
            raise SpecError("collective_timeout_seconds", f"must be at most {MAX_COLLECTIVE_TIMEOUT_SECONDS:g} s (a "
                            f"day), got {self.collective_timeout_seconds:g}")
        with engine_rules():
            check_device_name(self.device)
            if self.dtype != "auto":
                parse_dtype(self.dtype)
        if self.min_replicas is not None and self.min_replicas > self.replicas:
            raise SpecError("replicas.min", f"{self.min_replicas} is above max {self.replicas}")
        if self.cpu_threads is not None and self.device.startswith("cuda"):
            raise SpecError("cpu_threads", f"only for a CPU device (device is {self.device!r}: its ranks run on "
                                           f"GPUs), got {self.cpu_threads}")
        if self.placement == "ray" and self.device.startswith("cuda:"):   # Ray picks the GPU: N would be dropped
            raise SpecError("device", f"with placement: ray, write cuda (Ray assigns each replica its GPUs), got "
                                      f"{self.device!r}")
        if self.placement != "ray" and self.ray_address is not None:
            raise SpecError("ray_address", f"only with placement: ray (placement is {self.placement!r}), "
                                           f"got {self.ray_address!r}")
        if self.gpus is not None:
            self._check_gpus()

    def _check_gpus(self) -> None:
        if self.placement == "ray":
            raise SpecError("gpus", f"not with placement: ray (Ray assigns each replica its GPUs), "
                                    f"got {list(self.gpus)}")
        if self.device != "cuda":   # cuda:N names one GPU, which the list would silently overrule
            raise SpecError("gpus", f"lists CUDA GPUs, and device is {self.device!r}; set device: cuda")
        seen: dict[int, int] = {}
        for i, gpu in enumerate(self.gpus):
            if gpu in seen:
                raise SpecError(f"gpus[{i}]", f"GPU {gpu} is listed twice (also gpus[{seen[gpu]}]); "
                                              "each rank of each replica needs a GPU of its own")
            seen[gpu] = i
        need = self.replicas * self.tensor_parallel_size
        if len(self.gpus) != need:
            raise SpecError("gpus", f"{len(self.gpus)} GPUs listed; replicas {self.replicas} x tensor_parallel_size "
                                    f"{self.tensor_parallel_size} need {need}")

    @property
    def autoscaled(self) -> bool:
        """Replicas start and stop by load, between `min_replicas` and `replicas`."""
        return self.min_replicas is not None and self.min_replicas < self.replicas

    @property
    def initial_replicas(self) -> int:
        """The replicas started with the gateway (and never stopped for idleness): the min, or all."""
        return self.min_replicas if self.min_replicas is not None else self.replicas

    def resolved_ray_address(self, environ: Mapping[str, str]) -> str:
        """The Ray cluster a `placement: ray` device joins: `ray_address`, else `environ["RAY_ADDRESS"]`;
        a SpecError naming `devices.<name>.ray_address` when neither is set."""
        if self.placement != "ray":
            raise SpecError(f"devices.{self.name}.placement: {self.placement!r}; only a ray device has a cluster")
        address = self.ray_address or environ.get(RAY_ADDRESS_ENV, "").strip()
        if not address:
            raise SpecError(f"devices.{self.name}.ray_address: placement is ray and no cluster address: set "
                            f"ray_address or the {RAY_ADDRESS_ENV} environment variable")
        return address

    def replica_gpus(self, replica: int, device: str | None = None) -> tuple[int, ...]:
        """The CUDA GPU indices of one replica's ranks (empty for a CPU device, or for `auto` unless
        `device`, what `auto` resolved to on this machine, names CUDA)."""
        tp = self.tensor_parallel_size
        if self.gpus is not None:
            return self.gpus[replica * tp:(replica + 1) * tp]
        device = device if self.device == "auto" and device else self.device
        if not device.startswith("cuda"):
            return ()
        base = int(device.partition(":")[2] or 0)
        return tuple(range(base + replica * tp, base + (replica + 1) * tp))

    @property
    def claimed_gpus(self) -> tuple[int, ...]:
        """Every GPU of this machine the device's replica slots take (empty unless the device names CUDA,
        and for `placement: ray`, whose GPUs Ray assigns on its nodes)."""
        if self.placement == "ray":
            return ()
        return tuple(g for r in range(self.replicas) for g in self.replica_gpus(r))
