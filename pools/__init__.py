"""Pools: the YAML specification, the capacity plan, exact token counting and routing."""

from pools.capacity import CapacityPlan, engine_configs, plan_capacity, plan_single_pool
from pools.pool import Pool
from pools.router import NoRouteError, Router, UnknownModelError
from pools.spec import CliffguardConfig, PoolSpec, SpecError, load_config

__all__ = ["CapacityPlan", "CliffguardConfig", "NoRouteError", "Pool", "PoolSpec", "Router", "SpecError",
           "UnknownModelError", "engine_configs", "load_config", "plan_capacity", "plan_single_pool"]
