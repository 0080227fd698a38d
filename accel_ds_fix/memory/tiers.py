"""The DeepSpeed configurations this package ships and validates (configs/ is written from these), from the
fastest to the one that needs the least memory. Each is an accelerate YAML + DeepSpeed JSON pair; the
training script chooses its own mixed precision (``--mixed_precision fp16``), so neither file sets it."""

import dataclasses
import json
import os

from ..deepspeed_config import offload_device

# Options every tier shares: accelerate fills the "auto" values from the script's own arguments.
_COMMON = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto", "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
             "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "steps_per_print": 1000000,
}
# ZeRO-3's bucket and gathering sizes for a ~1B-parameter model on a small card (what the GPU runs measured).
_ZERO3 = {
    "stage": 3,
    "contiguous_gradients": True,
    "overlap_comm": False,
    "reduce_bucket_size": 50000000,
    "stage3_prefetch_bucket_size": 50000000,
    "stage3_param_persistence_threshold": 100000,
    "stage3_max_live_parameters": 100000000,
    "stage3_max_reuse_distance": 100000000,
    "stage3_gather_16bit_weights_on_model_save": True,
}
# Where the NVMe tier swaps its optimizer states unless told otherwise: a folder on a disk, not in RAM
# (/tmp is a tmpfs on several distributions), with room for 16 bytes a trained parameter.
DEFAULT_NVME_PATH = "/var/tmp/accel_ds_fix_nvme"


@dataclasses.dataclass(frozen=True)
class Tier:
    name: str
    title: str
    zero: dict
    extra: dict = dataclasses.field(default_factory=dict)
    caveat: str = ""  # what a user must know before choosing it, said by `plan`

    def deepspeed_config(self, nvme_path=DEFAULT_NVME_PATH, nvme_ram_gib=None, frozen_on_card_gib=None):
        """A fresh copy each call: callers may change it. ``nvme_ram_gib``: the NVMe tier's host memory for sub
        groups kept off the disk, where not the shipped amount (`plan` lowers it to fit a machine);
        ``frozen_on_card_gib``: the streaming tier's frozen weights kept on the card (as much as the card leaves,
        as shipped)."""
        config = json.loads(json.dumps({**_COMMON, "zero_optimization": self.zero, **self.extra}))
        if offload_device(config, "offload_optimizer") == "nvme":
            config["zero_optimization"]["offload_optimizer"]["nvme_path"] = nvme_path
        if nvme_ram_gib is not None and "nvme_optimizer_ram_gib" in config.get("accel_ds_fix", {}):
            config["accel_ds_fix"]["nvme_optimizer_ram_gib"] = nvme_ram_gib
        if frozen_on_card_gib is not None and "stream_frozen_weights" in config.get("accel_ds_fix", {}):
            config["accel_ds_fix"]["frozen_on_card_gib"] = frozen_on_card_gib
        return config

    @property
    def json_name(self):
        return f"ds_{self.name.replace('-', '_')}.json"

    @property
    def yaml_name(self):
        return f"accelerate_{self.name.replace('-', '_')}.yaml"


_ZERO2_OFFLOAD = {
    "stage": 2,
    "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "contiguous_gradients": True,
    "overlap_comm": False,
    "reduce_scatter": True,
    "reduce_bucket_size": 50000000,
    "allgather_bucket_size": 50000000,
}

TIERS = [
    Tier(
        "zero2-offload",
        "ZeRO-2, optimizer on the CPU (fp32 master weights and Adam states in host memory)",
        _ZERO2_OFFLOAD,
    ),
    Tier(
        "zero2-stream",
        "ZeRO-2, optimizer on the CPU, frozen weights beyond the card streamed from pinned host memory (a LoRA on "
        "a base bigger than the card: Flux, SD3.5, SDXL on 8 - 24 GB cards)",
        _ZERO2_OFFLOAD,
        # without frozen_on_card_gib: as much as the card leaves beside card_reserve_gib for activations (`plan
        # --write` writes the number it predicts; accelerate refuses a value "auto" it cannot fill itself)
        {"accel_ds_fix": {"stream_frozen_weights": True, "card_reserve_gib": 4}},
        "the frozen weights that do not fit the card cross from host memory for the forward and again for the "
        "backward, block by block, while the card computes the block before; a step takes its computation and the "
        "copies it does not hide (`plan --compute-seconds S` gives the step; measured against the uncapped card "
        "without DeepSpeed: Flux.1-dev's LoRA in 16 GiB 1.1 - 1.3x at 1024 px, 1.3 - 1.7x at 512 px; "
        "SD3.5-large's in 12 GiB 1.4x and SDXL's in 8 GiB 1.45x at 1024 px, where ZeRO-2's own work for each trained "
        "tensor adds to a step the host bounds). Training without gradient checkpointing streams the same, at "
        "plain accelerate's activation memory",
    ),
    Tier(
        "zero3-offload",
        "ZeRO-3, weights and optimizer on the CPU (least GPU memory, most host memory)",
        {
            **_ZERO3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "sub_group_size": 100000000,  # one fp32 gradient buffer of this size on the host (1e9 by default)
        },
    ),
    Tier(
        "zero3-nvme",
        "ZeRO-3, weights on the GPU, fp32 master weights and Adam states on an NVMe disk (least host memory)",
        {
            **_ZERO3,
            # Pipelined: while one sub group steps, the next is read and the previous written. That holds
            # three sub groups of 4 buffers each (weights, two Adam states, gradients), all pinned, each the
            # size of the largest sub group. 25M elements: SD1.5 in 30 sub groups, the largest 54M (12 x 217
            # MB); 50M steps as fast and needs 12 x 342 MB, 12.5M needs 12 x 152 MB but each sub group's swap
            # costs a fixed time (on the CPU, 302M parameters: 4.4, 4.5 and 5.1 s a step; bench/nvme_step.py).
            "offload_optimizer": {"device": "nvme", "nvme_path": DEFAULT_NVME_PATH, "pin_memory": True,
                                  "buffer_count": 12, "pipeline_read": True, "pipeline_write": True,
                                  "fast_init": False},
            "offload_param": {"device": "none"},
            "sub_group_size": 25000000,
        },
        # The keys DeepSpeed >= 0.16.4 reads (it ignores the older thread_count): one I/O thread per handle.
        # 1.5 GiB of host memory keeps the step's last sub groups off the disk (nvme/sub_groups_in_ram.py):
        # SD1.5's last 4 of 30 sub groups, 85.1M parameters, 2 GB less through the disk each step (docs/gpu.md run 11).
        {"aio": {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 1, "single_submit": False,
                 "overlap_events": True},
         "accel_ds_fix": {"nvme_optimizer_ram_gib": 1.5}},
        "slow: each optimizer step reads and writes the fp32 master weights and Adam states on the disk (12 bytes "
        "a trained parameter each way, 11 GiB for SD1.5; the fix keeps the gradients in RAM, and the last sub "
        "groups within accel_ds_fix.nvme_optimizer_ram_gib), reading the next sub group and writing the last "
        "while one steps: 13 - 16 s a step measured for SD1.5 with 1.5 GiB of sub groups in RAM on a disk that "
        "reads and writes 1.9 GB/s (DeepSpeed alone: 19 - 21 s there), 17 s with every sub group on a 1.7 GB/s disk; "
        "`plan --nvme-path DIR --steps N` measures your disk and predicts the run's hours",
    ),
    Tier(
        "zero3-offload-nvme",
        "ZeRO-3, weights in host memory, fp32 master weights and Adam states on an NVMe disk (today's large "
        "models on small cards: a full fine-tune of SDXL, SD3.5 or Flux where RAM cannot hold the optimizer)",
        {
            **_ZERO3,
            "offload_optimizer": {"device": "nvme", "nvme_path": DEFAULT_NVME_PATH, "pin_memory": True,
                                  "buffer_count": 12, "pipeline_read": True, "pipeline_write": True,
                                  "fast_init": False},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "sub_group_size": 25000000,
        },
        {"aio": {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 1, "single_submit": False,
                 "overlap_events": True},
         "accel_ds_fix": {"nvme_optimizer_ram_gib": 1.5}},
        "slow, as zero3-nvme: each optimizer step reads and writes 12 bytes a trained parameter on the disk; the "
        "weights also cross to the card for every forward and backward",
    ),
]
BY_NAME = {tier.name: tier for tier in TIERS}


def accelerate_yaml(deepspeed_config_file):
    """An accelerate config naming ``deepspeed_config_file``; no mixed_precision (the script sets it)."""
    return (
        "# ACCEL_DS_FIX=1 accelerate launch --config_file THIS_FILE train_db.py ... --mixed_precision fp16\n"
        "compute_environment: LOCAL_MACHINE\n"
        "distributed_type: DEEPSPEED\n"
        "deepspeed_config:\n"
        f"  deepspeed_config_file: {deepspeed_config_file}\n"
        "  zero3_init_flag: false\n"
        "num_machines: 1\n"
        "num_processes: 1\n"
        "machine_rank: 0\n"
        "main_training_function: main\n"
        "use_cpu: false\n"
    )


def write(tier, directory, nvme_path=DEFAULT_NVME_PATH, relative=False, nvme_ram_gib=None, frozen_on_card_gib=None):
    """Write ``tier``'s DeepSpeed JSON and accelerate YAML into ``directory``; return both paths.

    The YAML names the JSON by its absolute path, so it works from any working directory (``relative``: by
    its bare name, for configs/ in the checkout, which the fix finds beside the YAML)."""
    os.makedirs(directory, exist_ok=True)
    json_path = os.path.abspath(os.path.join(directory, tier.json_name))
    yaml_path = os.path.abspath(os.path.join(directory, tier.yaml_name))
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(tier.deepspeed_config(nvme_path, nvme_ram_gib, frozen_on_card_gib), f, indent=2)
        f.write("\n")
    with open(yaml_path, "w", encoding="utf-8") as f:
        f.write(accelerate_yaml(tier.json_name if relative else json_path))
    return yaml_path, json_path
