"""A prepare() call with several optimizers (GAN-style scripts: a generator and its optimizer, a discriminator and
its own): one DeepSpeed engine per optimizer, each holding the models whose trainable parameters that optimizer
owns. Decides the engines from the call's MergePlan, and refuses what one engine per optimizer cannot train."""

import torch

from ..errors import MergeError
from .merge_plan import optimizer_params

SUPPORTED_STAGES = (1, 2)


class EngineGroup:
    """The models, optimizer and schedulers of one engine, and where each sits in prepare()'s argument list."""

    def __init__(self, optimizer_position, optimizer):
        self.optimizer_position = optimizer_position
        self.optimizer = optimizer
        self.model_positions, self.models, self.names = [], [], []
        self.scheduler_positions = []


class EngineGroups:
    """Decides which engine each model, optimizer and scheduler of one prepare() call goes to, from the call's
    MergePlan (which classified the arguments and owns the checks every engine needs)."""

    def __init__(self, plan):
        self.plan = plan
        self.groups = []

    def build(self):
        """Check everything, then return the groups (one per optimizer, in argument order)."""
        plan = self.plan
        self._check_config()
        plan.check()  # each model once, none prepared, no parameter of no model, optimizers DeepSpeed can offload
        owner = self._owners()
        groups = [EngineGroup(p, plan.args[p]) for p in plan.optimizer_positions]
        frozen = []
        for i, model in enumerate(plan.models):
            owners = sorted({owner[id(p)] for p in model.parameters() if p.requires_grad and id(p) in owner})
            if len(owners) > 1:
                self._refuse_split(i, model, owners, owner)
            if not owners:
                frozen.append(i)
                continue
            self._add(groups[owners[0]], i)
        for k, group in enumerate(groups):
            if not group.models:
                raise MergeError(
                    f"accel_ds_fix: {plan.optimizer_label(k)} holds no trainable parameter of the models passed to "
                    f"prepare() ({plan.model_labels(range(len(plan.models)))}). Each optimizer trains its own "
                    "models in its own DeepSpeed engine: pass the model it trains to the same prepare() call, or "
                    "leave the optimizer out."
                )
        for i in frozen:  # a frozen model joins the first engine: it runs there with the engine's precision
            self._add(groups[0], i)
        self._check_nothing_shared(groups)
        self._assign_schedulers(groups)
        self.groups = groups
        return groups

    def _add(self, group, i):
        group.model_positions.append(self.plan.positions[i])
        group.models.append(self.plan.models[i])
        group.names.append(self.plan.names[i])

    def _check_config(self):
        plan, stage = self.plan, self.plan.stage
        optimizers = ", ".join(plan.optimizer_label(k) for k in range(len(plan.optimizer_positions)))
        if any(not isinstance(o, torch.optim.Optimizer) for o in plan.optimizers):
            raise MergeError(
                f"accel_ds_fix: this prepare() call holds {len(plan.optimizer_positions)} optimizers ({optimizers}), "
                "one of them accelerate's DummyOptim (the optimizer of the DeepSpeed config). A config describes one "
                "optimizer, and two engines need two: build both optimizers in the script (torch.optim.AdamW, say) "
                "and drop the config's \"optimizer\" section."
            )
        if stage not in SUPPORTED_STAGES:
            raise MergeError(
                f"accel_ds_fix: this prepare() call holds {len(plan.optimizer_positions)} optimizers ({optimizers}): "
                f"each gets a DeepSpeed engine of its own, which accel_ds_fix trains under ZeRO stage 1 and 2 only; "
                f"the config asks for stage {stage}. "
                + ("Under ZeRO-3 one loss through two engines (a generator loss through the discriminator) gathers "
                   "and partitions each engine's weights from the other's backward, which is not made right here. "
                   if stage == 3 else "")
                + "Use zero_stage 2 (with offload_optimizer_device cpu to save GPU memory), or 1."
            )
        if plan.fp16:
            raise MergeError(
                f"accel_ds_fix: this prepare() call holds {len(plan.optimizer_positions)} optimizers ({optimizers}), "
                "each with a DeepSpeed engine of its own, and the config trains in fp16: each engine scales its loss "
                "by its own dynamic loss scale, and one loss that reaches two engines (a generator loss through the "
                "discriminator) cannot carry two scales. Use mixed_precision bf16 (or no), or one optimizer."
            )

    def _owners(self):
        """{id(parameter): optimizer index}; refuses a parameter two optimizers share."""
        plan, owner = self.plan, {}
        for k, optimizer in enumerate(plan.optimizers):
            for p in optimizer_params(optimizer):
                if id(p) in owner and owner[id(p)] != k:
                    models = [i for i, m in enumerate(plan.models) if any(q is p for q in m.parameters())]
                    first, owners = plan.optimizer_label(owner[id(p)]), plan.model_labels(models) or "no model passed"
                    raise MergeError(
                        f"accel_ds_fix: a parameter of shape {tuple(p.shape)} is in both {first} and "
                        f"{plan.optimizer_label(k)} (it belongs to {owners}). "
                        "Each optimizer gets a DeepSpeed engine of its own, which owns and steps its parameters "
                        "alone: a parameter cannot be trained by two engines. Put each parameter into one optimizer "
                        "(parameter groups give parts of it their own learning rates), or pass one optimizer."
                    )
                owner[id(p)] = k
        return owner

    def _refuse_split(self, i, model, owners, owner):
        counts = {k: sum(1 for p in model.parameters() if p.requires_grad and owner.get(id(p)) == k) for k in owners}
        parts = ", ".join(f"{n} in {self.plan.optimizer_label(k)}" for k, n in counts.items())
        raise MergeError(
            f"accel_ds_fix: the trainable parameters of {self.plan.label(i)} are split between optimizers ({parts}). "
            "Each optimizer gets a DeepSpeed engine of its own, and an engine wraps whole models: pass the parts "
            "as separate models to prepare() (each with its own optimizer), or put all of this model's trainable "
            "parameters into one optimizer (parameter groups for their own learning rates)."
        )

    def _check_nothing_shared(self, groups):
        where = {}
        for k, group in enumerate(groups):
            for position, model in zip(group.model_positions, group.models):
                for p in model.parameters():
                    other = where.setdefault(id(p), (k, position))
                    if other[0] != k:
                        first, second = (self.plan.label(self.plan.positions.index(q)) for q in (other[1], position))
                        raise MergeError(
                            f"accel_ds_fix: {first} (engine of {self.plan.optimizer_label(other[0])}) and {second} (engine "
                            f"of {self.plan.optimizer_label(k)}) share a submodule or parameter (shape {tuple(p.shape)}). "
                            "Each optimizer gets a DeepSpeed engine of its own, and a module cannot live in two "
                            "engines (each casts, partitions and checkpoints its own copy). Pass the shared module "
                            "once: keep it out of the other model (call it from the training step instead), or "
                            "train both models with one optimizer."
                        )

    def _assign_schedulers(self, groups):
        for position in self.plan.scheduler_positions:
            optimizer = self.plan.args[position].optimizer
            k = next((k for k, o in enumerate(self.plan.optimizers) if o is optimizer), None)
            if k is None:
                raise MergeError(
                    f"accel_ds_fix: the scheduler at argument {position + 1} of prepare() "
                    f"({type(self.plan.args[position]).__name__}) steps an optimizer that is not passed to this "
                    "prepare() call. With several optimizers each scheduler goes to the engine of its optimizer: "
                    "pass that optimizer to the same call."
                )
            if groups[k].scheduler_positions:
                raise MergeError(
                    f"accel_ds_fix: arguments {groups[k].scheduler_positions[0] + 1} and {position + 1} of prepare() "
                    f"are two schedulers of {self.plan.optimizer_label(k)}; accelerate binds one scheduler to an "
                    "engine. Combine them (torch.optim.lr_scheduler.SequentialLR), or prepare one."
                )
            groups[k].scheduler_positions.append(position)

    def describe(self, stage):
        parts = []
        for k, group in enumerate(self.groups):
            parts.append(f"engine {k + 1} ({self.plan.optimizer_label(k)}): {', '.join(group.names)}")
        return (f"one DeepSpeed engine per optimizer (ZeRO stage {stage}): " + "; ".join(parts) + ". "
                "accelerator.backward(loss) trains the engine whose trainable parameters the loss reaches.")
