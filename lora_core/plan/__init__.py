"""The memory planner (numpy only): a training run's per-rank peak memory and FLOPs per token
from a model config, method, precision, GC, ZeRO stage and batch (``memory``); ``lora-plan``
on the console (``cli``)."""

from .memory import METHODS, SYSTEMS, Plan, PlanConfig, bench_plan, plan, resolve_model

__all__ = ["METHODS", "SYSTEMS", "Plan", "PlanConfig", "bench_plan", "plan", "resolve_model"]
