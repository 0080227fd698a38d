"""Accelerator.prepare with several optimizers: one DeepSpeed engine per optimizer, built by accelerate's own
prepare() once per engine (its models merged into one module as with one optimizer, even a single model: the
proxy, the autocast of the merged module and the checkpoint code then work the same), each scheduler bound to
its own optimizer's engine, every model handed back as a proxy of its engine. accelerator.backward is routed
per loss (backward_routing.py)."""

import logging

from .. import notices
from ..launch import cpu_threads
from ..lookup import engine_record
from . import backward_routing, clipping, engine_setup, gpu_block_release, gradient_explanation
from .merged_module import MergedModels
from .optimizer_groups import EngineGroups


def prepare(wrapped, instance, args, kwargs, plan):
    """Build one engine per optimizer of ``args`` (classified by ``plan``, a MergePlan); return prepare()'s
    results in argument order."""
    grouping = EngineGroups(plan)
    groups = grouping.build()
    if plan.optimizer_offload != "none":
        cpu_threads.warn_if_few_for_cpu_optimizer()
    handed_back = {}
    grouped = {p for g in groups for p in [*g.model_positions, g.optimizer_position, *g.scheduler_positions]}
    others = [i for i in range(len(args)) if i not in grouped]  # dataloaders and the like: with the first engine
    first_wrapper = getattr(instance, "deepspeed_engine_wrapped", None)
    for k, group in enumerate(groups):
        merged = MergedModels(group.models, group.names, fp32_outputs=True)
        positions = [group.optimizer_position, *group.scheduler_positions] + (others if k == 0 else [])
        # accelerate keeps one engine wrapper for accelerator.backward and warns at the second: each engine's
        # wrapper is kept on the engine instead, and accelerate's attribute keeps the first.
        instance.deepspeed_engine_wrapped = None
        with gpu_block_release.building_engine():
            result = wrapped(merged, *(args[i] for i in positions), **kwargs)
        result = list(result) if isinstance(result, (tuple, list)) else [result]
        engine, wrapper = result[0], instance.deepspeed_engine_wrapped
        first_wrapper = first_wrapper or wrapper
        instance.deepspeed_engine_wrapped = first_wrapper
        handed_back.update(zip(positions, result[1:]))
        proxies = engine_setup.adopt(engine, group.names, group.models)
        handed_back.update({p: proxies[n] for p, n in zip(group.model_positions, group.names)})
        engine_record(engine).wrapper = wrapper
        backward_routing.manage(instance, engine, handed_back[group.optimizer_position],
                                f"{', '.join(group.names)} (engine of {plan.optimizer_label(k)})")
    gradient_explanation.watch(plan.stage)
    if instance.is_main_process:
        notices.say(grouping.describe(plan.stage), level=logging.INFO)
        clipping.say_at_prepare(instance)
    return tuple(handed_back[i] for i in range(len(args)))
