"""A memory model of one DeepSpeed training: peak GPU memory (allocated and reserved) and peak host memory,
from the parameter counts of the models and the DeepSpeed config, before anything is allocated.

Every term is a buffer DeepSpeed 0.19.8 allocates (the source line is named beside it); docs/memory.md puts
the predictions next to measurements. Sizes are per process, for a data-parallel world of W processes.
P: all parameters, T: trainable ones, h: bytes of the half-precision copy DeepSpeed trains (2 under fp16/bf16,
else 4), m: bytes of master weights and their gradients (4, or 2 with *_master_weights_and_grads).
"""

import dataclasses

from .. import versions
from ..deepspeed_config import STREAM_ALLOCATOR_SLACK
from ..deepspeed_config import Settings  # noqa: F401  (the model's input, read from the DeepSpeed config)
from ..nvme import sub_groups_in_ram

GIB = 1024**3

# Host memory of a training process before any model exists: Python, torch, the CUDA context and the usual
# libraries (diffusers/transformers) mapped in. Measured on the H200 host and on the CPU (docs/memory.md).
HOST_BASELINE = {"cuda": 2.6 * GIB, "cpu": 0.7 * GIB}
# Activation memory at the training peak is a property of the model, resolution and batch, not of
# DeepSpeed; SD1.5 at 512 px, batch 1, fp16, gradient checkpointing needs about this much (measured).
SD15_ACTIVATIONS = int(0.42 * GIB)
# The largest tensor SD1.5 DreamBooth trains: CLIP-L's token embedding (the staging buffer of optimizer offload).
SD15_LARGEST_TENSOR = 49408 * 768
# Reserved over allocated GPU memory under ZeRO-3 (H200, SD1.5, 6 GiB cap): weights offloaded 2.04 / 1.86 GiB;
# weights on the GPU, where the allocator also caches the partitioned weights' blocks, 3.42 / 2.56 (NVMe tier)
# and 3.34 / 2.48 (the same layout, optimizer in RAM).
STAGE3_RESERVED = 1.10
STAGE3_RESERVED_WEIGHTS_ON_GPU = 1.35
# NVMe optimizer offload holds about this much more host memory per trained parameter in training than the
# buffers listed below account for (measured, with the swap buffers sized by the largest sub group as DeepSpeed
# forms it: 2.4 on the H200 host with SD1.5, 0.9 on the CPU with 51M parameters, pipelined or not; not traced
# to one allocation in DeepSpeed 0.19.8's swapper).
NVME_UNTRACED_BYTES = 2


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the model side contributes."""

    params: int
    trainable: int
    largest_trainable: int = 0  # elements of the largest trainable parameter (a staging buffer's size)
    largest_weight: int = 0  # elements of the largest parameter, frozen ones included (0: where unknown)
    weight_bytes: int = 4  # bytes per element of the weights as handed to prepare()
    activations: int = 0  # bytes; 0 where unknown (the check inside prepare() cannot know them)
    groups: tuple = ()  # trainable elements per optimizer parameter group; () means one group
    # elements of each trainable parameter, one tuple per optimizer parameter group, in the optimizer's order;
    # () where unknown (`plan`): ZeRO-3's sub groups are then bounded, not formed
    param_sizes: tuple = ()
    # bytes of frozen models the script keeps on the card beside the prepared ones (T5 for each step's prompts,
    # the VAE): never handed to DeepSpeed, so on the card whatever the tier
    frozen_on_gpu: int = 0
    # bytes of the prepared models that the script itself moves to the card before prepare() (diffusers' LoRA
    # scripts move the frozen base there): a peak before any tier acts
    moved_before_prepare: int = 0
    # host bytes of every model as the script loads it, before its own casts and moves (a pipeline's scripts load
    # the transformer in fp32 and T5 beside it); 0: the prepared weights at weight_bytes
    loaded_bytes: int = 0
    # bytes of the largest block of frozen weights (a layer of a ModuleList: what streams at once); 0: unknown
    largest_block: int = 0
    # bytes of the frozen weights of the prepared models but the largest (the text encoders a LoRA script trains
    # beside the denoiser), which the streaming tier keeps on the card first
    frozen_smaller_prepared: int = 0
    trained_tensors: int = 0  # the optimizer's tensors (a LoRA: two for each weight it wraps); 0: unknown


@dataclasses.dataclass
class Prediction:
    gpu_allocated: int
    gpu_reserved: int
    host: int  # peak resident memory of the process, the baseline included
    nvme: int
    parts: list  # (what, where, bytes)
    host_resume: int = 0  # peak resident memory of a run that resumes with load_state (its training buffers held)

    def gib(self):
        return {k: round(getattr(self, k) / GIB, 2)
                for k in ("gpu_allocated", "gpu_reserved", "host", "host_resume", "nvme")}


def checkpoint_bytes(work, s):
    """What one save_state writes, about: the fp32 master weights and optimizer states of every trained parameter,
    and the model's weights in the training precision (a NVMe-tier checkpoint copies the swapped states in)."""
    return (s.master_bytes + s.optimizer_state_bytes) * work.trainable + s.half_bytes * work.params


def sub_group_sizes(work, s):
    """Elements per rank of ZeRO-3's optimizer sub groups, in the step's order; None where the parameters'
    sizes are unknown (`plan`). DeepSpeed (stage3.py _create_fp16_sub_groups) takes a parameter group's
    parameters in order and closes a sub group at the first parameter that brings it to sub_group_size, so one
    may hold up to a parameter more than that."""
    if not work.param_sizes:
        return None
    sizes = []
    for group in work.param_sizes:
        current = 0
        for n in group:
            current += -(-n // s.world_size)
            if current >= s.sub_group:
                sizes.append(current)
                current = 0
        if current:
            sizes.append(current)
    return sizes


def largest_sub_group(work, s):
    """Elements per rank of ZeRO-3's largest optimizer sub group, the size of each NVMe swap buffer (bounded
    where the parameters' sizes are unknown)."""
    sizes = sub_group_sizes(work, s)
    if sizes is None:
        W = s.world_size
        bound = s.sub_group + -(-work.largest_trainable // W) - 1 if work.largest_trainable else s.sub_group
        return max((min(bound, g // W) for g in (work.groups or (work.trainable,))), default=0)
    return max(sizes, default=0)


def kept_in_ram(work, s, device="cuda"):
    """Elements per rank and host bytes of the sub groups the NVMe tier keeps in RAM within ``s.nvme_ram``
    (nvme/sub_groups_in_ram.py); where the sizes are unknown, as if every sub group were sub_group_size."""
    if s.offload_optimizer != "nvme" or not s.nvme_ram:
        return 0, 0
    sizes = sub_group_sizes(work, s)
    if sizes is None:
        per_rank = work.trainable // s.world_size
        sizes = [s.sub_group] * (per_rank // s.sub_group) + ([per_rank % s.sub_group] if per_rank % s.sub_group else [])
    pinned = s.pin_memory and device == "cuda"
    kept = sub_groups_in_ram.choose(sizes, [True] * len(sizes), s.nvme_ram, pinned)
    return (sum(sizes[i] for i in kept), sum(sub_groups_in_ram.host_bytes(sizes[i], pinned) for i in kept))


def _pinned(nbytes, device):
    # torch's caching host allocator hands out page-locked blocks rounded up to a power of two (on a GPU host).
    return sub_groups_in_ram.pinned_bytes(nbytes) if device == "cuda" else nbytes


def predict(work, s, device="cuda", host_baseline=None):
    """Peak memory of training ``work`` with DeepSpeed settings ``s`` on ``device`` ("cuda" or "cpu": on a
    CPU-only machine DeepSpeed's device buffers are host memory too)."""
    W, P, T, h, m = s.world_size, work.params, work.trainable, s.half_bytes, s.master_bytes
    groups = [g // W for g in (work.groups or (T,))]
    pin = s.pin_memory and device == "cuda"
    gpu_build, gpu_train, host_parts, nvme = [], [], [], 0

    def host(what, nbytes, pinned=False):
        host_parts.append((what, _pinned(nbytes, device) if pinned else nbytes))

    if s.stage in (0, 1, 2):
        if s.stream:
            # streaming/: the trained weights and the frozen ones within frozen_on_card on the card, the rest in
            # pinned host memory, two blocks on the card at a time (the one computing, the next one copied)
            split = stream_split(work, s)
            on_card = h * T + split.kept + split.in_flight
            gpu_build.append(("trained weights, frozen weights kept on the card, blocks in flight", on_card))
            gpu_train.append(("trained weights, frozen weights kept on the card, blocks in flight", on_card))
            host("streamed frozen weights (pinned, in whole chunks: streaming/host_memory.py)", split.streamed)
        else:
            # engine.py: module.half() (or bfloat16()) and module.to(device)
            gpu_build.append(("half-precision weights", h * P))
            gpu_train.append(("half-precision weights", h * P))
        if s.stage > 0:
            # stage_1_and_2.py:505 flattens the trainable weights while the per-parameter blocks still exist
            gpu_build.append(("flat copy of the trainable weights while ZeRO flattens them", h * T))
        gpu_train.append(("gradient bucket (reduce_bucket_size)", h * min(s.reduce_bucket, max(T, 1))))
        if s.offload_optimizer == "cpu":
            gpu_train.append(("staging buffer of the largest parameter", h * work.largest_trainable))
            # stage_1_and_2.py:560 fp32 master partition, :566 bit16 staging copy, :940 fp32 gradient partition
            for g in groups:
                host("master weights (pinned)", m * g, pin)
                host("half-precision staging copy (pinned)", h * g, pin)
                host("gradient partition (pinned)", m * g, pin)
            host("optimizer states (DeepSpeedCPUAdam)", s.optimizer_state_bytes * T // W)
        else:
            if s.stage == 2:  # stage_1_and_2.py: contiguous gradients of this rank's partition
                gpu_train.append(("gradient partition", h * T // W))
            per_rank = (m + m + s.optimizer_state_bytes) * T // W
            gpu_train.append(("master weights, gradients and optimizer states", per_rank))
    else:
        params_on_gpu = s.offload_param == "none"
        # the fix partitions the models from host memory, one weight at a time (zero3/host_partition.py);
        # DeepSpeed alone would move the whole module to the card first (h * P)
        gpu_build.append(("one weight on the card while ZeRO-3 partitions it", h * max(work.largest_weight,
                                                                                       work.largest_trainable)))
        if params_on_gpu:
            gpu_train.append(("partitioned half-precision weights", h * P // W))
        else:
            host("partitioned half-precision weights (pinned)", h * P // W, pin)
        # Weights gathered for the layers in flight; from host memory they pass through a device staging
        # buffer first, a second copy (measured: docs/memory.md)
        copies = 1 if params_on_gpu else 2
        gpu_train.append(("gathered weights in flight (prefetch bucket + max live parameters)",
                          copies * h * min(P, s.prefetch_bucket + s.max_live)))
        gpu_train.append(("gradient bucket (reduce_bucket_size)", h * min(s.reduce_bucket, max(T, 1))))
        largest = largest_sub_group(work, s)
        if s.offload_optimizer == "none":
            gpu_train.append(("master weights, gradients and optimizer states",
                              (m + s.grad_accum_bytes + m + s.optimizer_state_bytes) * T // W))
        else:
            # stage3.py:791 gradient partitions of every trainable parameter, on the host
            host("gradient partitions (pinned)", s.grad_accum_bytes * T // W, pin)
            # stage3.py:1306 one gradient buffer of the largest sub group
            host("gradient buffer of the largest sub group", m * largest)
            if s.offload_optimizer == "cpu":
                host("master weights", m * T // W)
                host("gradients of the master weights (pinned)", m * T // W, pin)
                host("optimizer states (DeepSpeedCPUAdam)", s.optimizer_state_bytes * T // W)
            else:  # nvme: master weights and optimizer states live on disk, swapped in one sub group at a time
                host("swap buffers (buffer_count x the largest sub group, pinned)", s.swap_buffers * 4 * largest)
                if s.pipelined and not versions.in_range("deepspeed", versions.PIPELINED_SWAP_RELEASE):
                    # nvme/pipelined_swap.py's release is not applied to this release: Adam's states of every
                    # sub group stay in host memory from the first step
                    host("Adam states DeepSpeed's pipelined swapper keeps after the first step", 8 * T // W)
                host("in training, beyond these buffers (measured, not traced)", NVME_UNTRACED_BYTES * T // W)
                kept, kept_bytes = kept_in_ram(work, s, device)
                if kept:
                    host("sub groups kept in RAM (nvme_optimizer_ram_gib): fp32 weights, Adam states, gradients",
                         kept_bytes)
                nvme = (m + s.optimizer_state_bytes) * (T // W - kept)
    if work.activations:
        gpu_train.append(("activations", work.activations))
    if work.frozen_on_gpu and not s.stream:  # streaming places them with the prepared models' frozen weights
        for where in (gpu_build, gpu_train):
            where.append(("frozen models the script keeps on the card (not prepared)", work.frozen_on_gpu))

    build, train = sum(b for _, b in gpu_build), sum(b for _, b in gpu_train)
    before = work.moved_before_prepare + work.frozen_on_gpu  # on the card before prepare() begins
    # Under ZeRO-3 and streaming the fix holds that move back and places the weights from host memory
    # (zero3/held_moves.py)
    if work.moved_before_prepare and s.stage < 3 and not s.stream and before > build:
        gpu_build.append(("prepared models the script moves to the card before prepare() (a LoRA's frozen base)",
                          before - build))
        build = before
    baseline = HOST_BASELINE[device] if host_baseline is None else host_baseline
    deepspeed_host = sum(b for _, b in host_parts)
    # The weights as loaded (before prepare) leave the host when they move to the GPU; on a CPU they stay.
    loaded = work.loaded_bytes or work.weight_bytes * P
    if device == "cpu":  # the device buffers are host memory too, allocated before DeepSpeed's host buffers
        # What the tensors hold. glibc may keep freed blocks besides (its dynamic mmap threshold): up to ~15 % more
        # resident memory on the CPU, never on a GPU host, whose DeepSpeed buffers are pinned (docs/memory.md).
        host_peak = baseline + max(loaded, build, train + deepspeed_host)
        gpu_alloc = gpu_reserved = 0
    else:
        host_peak = baseline + max(loaded, deepspeed_host)
        gpu_alloc = max(build, train)
        # ZeRO-1/2: reserved = allocated with the fix's release of ZeRO's freed blocks (merge/gpu_block_release.py);
        # ZeRO-3 gathers and frees weights all the time, and the caching allocator keeps 10-35% more (measured).
        if s.stream:
            gpu_reserved = int(gpu_alloc * STREAM_ALLOCATOR_SLACK)
        elif s.stage < 3:
            gpu_reserved = gpu_alloc
        else:
            factor = STAGE3_RESERVED_WEIGHTS_ON_GPU if s.offload_param == "none" else STAGE3_RESERVED
            gpu_reserved = int(gpu_alloc * factor)
    host_resume = host_peak + resume_extra(work, s, device)
    parts = [(w, "gpu (construction)", b) for w, b in gpu_build] + [(w, "gpu (training)", b) for w, b in gpu_train]
    parts += [(w, "host", b) for w, b in host_parts] + [("process baseline", "host", baseline)]
    if nvme:
        parts.append(("master weights and optimizer states", "nvme", nvme))
    return Prediction(gpu_alloc, gpu_reserved, host_peak, nvme, parts, host_resume)


@dataclasses.dataclass(frozen=True)
class StreamSplit:
    """Where the streaming tier puts the frozen weights, in bytes, and what crosses to the card each step."""

    kept: int  # frozen weights kept on the card
    streamed_prepared: int  # the prepared models' frozen weights streamed: crossing for the forward and the backward
    streamed_beside: int  # the models the script keeps beside them (T5, the VAE), streamed: crossing once a step
    in_flight: int  # blocks on the card while streaming (the one computing and the next one copied)
    # the frozen weights whose computation hides the streamed ones' copies: the prepared models' less the text
    # encoders kept first (they compute next to nothing)
    prepared: int = 0

    @property
    def streamed(self):
        return self.streamed_prepared + self.streamed_beside

    @property
    def per_step(self):
        return 2 * self.streamed_prepared + self.streamed_beside


def stream_split(work, s):
    """The streaming tier's split, as the run keeps blocks (streaming/engine_build.keep_first): the frozen weights
    of the prepared models but the largest (the text encoders) are kept on the card first, then the models the
    script keeps beside them (T5, the VAE: used once a step), then the largest prepared model's (the denoiser),
    within s.frozen_on_card (None: none kept, the least the card needs; `plan` sets it to what the card leaves)."""
    prepared = s.half_bytes * (work.params - work.trainable)
    budget = s.frozen_on_card or 0
    kept_smaller = min(work.frozen_smaller_prepared, prepared, budget)
    kept_beside = min(work.frozen_on_gpu, budget - kept_smaller)
    kept_prepared = kept_smaller + min(prepared - kept_smaller, budget - kept_smaller - kept_beside)
    streamed = prepared + work.frozen_on_gpu - kept_prepared - kept_beside
    block = work.largest_block or s.half_bytes * work.largest_weight * 8
    return StreamSplit(kept_prepared + kept_beside, prepared - kept_prepared, work.frozen_on_gpu - kept_beside,
                       min(streamed, 2 * block) if streamed else 0, prepared - kept_smaller)


# The forward's share of a step's computation under gradient checkpointing: the forward, its recomputation in the
# backward and the backward itself (twice the forward's work)
FORWARD_SHARE = 1 / 4


def stream_step(split, h2d_bytes_per_second, compute_seconds):
    """(seconds a step, seconds of copies the computation does not hide) under the streaming tier, for a step
    whose computation takes ``compute_seconds`` on the card (the same script's step where the whole model fits).

    Each streamed block is copied while the block before it computes (one ahead): its copy hides behind that
    block's computation, the excess waits. The prepared models' streamed blocks cross for the forward, where they
    compute a quarter of the step's work in proportion to their share of the frozen weights, and again for the
    recomputation and backward (three quarters); the models beside them (T5, the VAE) compute next to nothing and
    wait for their copies whole."""
    bw = h2d_bytes_per_second
    if not split.streamed:
        return compute_seconds, 0.0
    share = split.streamed_prepared / split.prepared if split.prepared else 0.0
    copy = split.streamed_prepared / bw
    forward = max(0.0, copy - share * FORWARD_SHARE * compute_seconds)
    backward = max(0.0, copy - share * (1 - FORWARD_SHARE) * compute_seconds)
    unhidden = forward + backward + split.streamed_beside / bw
    return compute_seconds + unhidden, unhidden


# What ZeRO-2 with its optimizer on the CPU adds to a step for each tensor it trains (gradient hooks, the gradients'
# copies to the host, DeepSpeed's reads of each tensor's inf/NaN flag and norm back to the host) where the host, not
# the card, bounds the step; where the card's kernels bound it, this hides behind them. Measured on an H100 host
# against the uncapped step without DeepSpeed, over what stream_step gives (docs/gpu.md runs 19 - 20): SDXL's LoRA
# at 1024 px, 1472 tensors, 0.64 s with 0.17 s of copies, all hidden (0.43 ms a tensor); SD3.5-large's, 958 tensors,
# 0.44 - 0.51 s (0.46 - 0.53 ms); Flux.1-dev's at 512 px, 780 tensors, 0.26 s (0.33 ms); at 1024 px 0.05 s (hidden).
# Run 21 (as shipped: DeepSpeed's own reads): SDXL 2.11 - 2.13 s against this fit's 2.09. Those per-tensor waits
# are not this cost: the flags and norms read once a step instead made the same step slower, 2.57 - 2.82 s, runs
# interleaved (docs/gpu.md run 21).
OFFLOAD_HOST_SECONDS_PER_TENSOR = 0.45e-3


def host_bound_step(work, step_seconds):
    """The streaming tier's step where the host bounds it: ``step_seconds`` (stream_step's) and the tier's own work
    for each trained tensor."""
    return step_seconds + work.trained_tensors * OFFLOAD_HOST_SECONDS_PER_TENSOR


def resume_extra(work, s, device="cuda"):
    """Host memory that load_state holds beside the training's buffers, at its peak. DeepSpeed (0.19.8,
    engine._get_all_zero_checkpoint_state_dicts) reads this rank's ZeRO file whole with torch.load; the fix maps it
    instead (checkpoints/mapped_load.py): the master weights are copied into the run's buffers and Adam's states
    out into memory of the process's own, which the training holds anyway from its first step, so nothing comes on
    top (zero2-offload, 75.5M parameters on the CPU: load_state's anonymous peak 1.83 GiB against the training's
    1.88; DeepSpeed's own read 2.11). Under NVMe offload that file holds only the sub groups kept in RAM (the rest
    are swap files, which DeepSpeed copies on disk), which nvme_resume.py reads from the mapping: SD1.5 at 1.5 GiB
    kept, load_state's anonymous peak 0.46 GiB above prepare's, the file 1.05 GiB (bench/resume_peak.py --model sd15
    --full-size, on the CPU)."""
    if s.stage == 0 or s.offload_optimizer != "nvme":
        return 0
    return (s.master_bytes + s.optimizer_state_bytes) * kept_in_ram(work, s, device)[0]
