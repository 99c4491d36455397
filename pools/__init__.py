"""Pools: the YAML specification, the capacity plan, exact token counting and routing."""

from pools.capacity import CapacityPlan, engine_configs, plan_capacity
from pools.router import NoRouteError, Router, RouteTarget, UnknownModelError
from pools.spec import CliffguardConfig, PoolSpec, SpecError, load_config

__all__ = ["CapacityPlan", "CliffguardConfig", "NoRouteError", "PoolSpec", "RouteTarget", "Router", "SpecError",
           "UnknownModelError", "engine_configs", "load_config", "plan_capacity"]
