"""Validation shim, loaded by zz_kohya_val.pth in the machine's site-packages; does nothing unless KOHYA_VAL_OUT is set.

- KOHYA_VAL_CAP_GIB: cap the card (torch.cuda.set_per_process_memory_fraction) when the Accelerator is made, so
  only the training process is capped, as a 6 GB card would be.
- KOHYA_VAL_OUT: a JSON file written at exit: every loss passed to accelerator.backward, the time between backward
  calls, peak GPU allocated/reserved and the process's peak RSS.
- KOHYA_VAL_JAN2023_SHIM=1: the two accelerate behaviours kohya's January 2023 train_db.py (bf691aef, written for accelerate 0.15) needs
  from accelerate >= 1.7: Accelerator(logging_dir=...) and unwrap_model("dummy", True) without an error.
- KOHYA_VAL_UNET_CHANNELS=32,64,64,64: kohya's own UNet (library/original_unet.py, whose widths are module constants
  fixed at SD1.5's) built this narrow, to match `make_inputs.py --unet-channels`: the SD1.5 layout at a size that a
  CPU machine trains under every tier (a rehearsal; the script itself is not changed).
- KOHYA_VAL_SDPA=no-cudnn: torch.backends.cuda.enable_cudnn_sdp(False) in the training process (cuDNN's attention
  backward is broken on torch 2.11+cu130 with cuDNN 9.19: docs/gpu.md run 13).
- KOHYA_VAL_SDXL_CHANNELS=64: kohya's own SDXL UNet (library/sdxl_original_unet.py, SDXL's widths as module
  constants) built that narrow, to match `make_shape_pipeline.py sdxl --random --tiny`: sdxl_train.py's rehearsal.
"""
import atexit
import json
import os
import resource
import time

OUT = os.environ.get("KOHYA_VAL_OUT")
_losses, _times = [], []


def _write():
    report = {"losses": _losses, "step_times": _times, "pid": os.getpid(),
              "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            report["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            report["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    except Exception as e:  # the report is best effort: never change the script's exit
        report["error"] = repr(e)
    if _losses:  # only the training process (the launcher has none)
        with open(OUT, "w") as f:
            json.dump(report, f, indent=1)


def _patch(accelerate):
    cls = accelerate.Accelerator
    init, backward, unwrap = cls.__init__, cls.backward, cls.unwrap_model

    def __init__(self, *args, **kwargs):
        if os.environ.get("KOHYA_VAL_JAN2023_SHIM") == "1" and "logging_dir" in kwargs:
            kwargs["project_dir"] = kwargs.pop("logging_dir")
        init(self, *args, **kwargs)
        if os.environ.get("KOHYA_VAL_SDPA") == "no-cudnn":
            import torch
            torch.backends.cuda.enable_cudnn_sdp(False)
        cap = os.environ.get("KOHYA_VAL_CAP_GIB")
        if cap:
            import torch
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(float(cap) * 2**30 / total)

    def backward_(self, loss, *args, **kwargs):
        _losses.append(float(loss.detach().float().item()))
        _times.append(time.perf_counter())
        return backward(self, loss, *args, **kwargs)

    def unwrap_model(self, model, *args, **kwargs):
        if isinstance(model, str) and os.environ.get("KOHYA_VAL_JAN2023_SHIM") == "1":
            return model
        return unwrap(self, model, *args, **kwargs)

    cls.__init__, cls.backward, cls.unwrap_model = __init__, backward_, unwrap_model


def _narrow_unet(original_unet):
    channels = tuple(int(c) for c in os.environ["KOHYA_VAL_UNET_CHANNELS"].split(","))
    original_unet.BLOCK_OUT_CHANNELS = channels
    original_unet.TIMESTEP_INPUT_DIM = channels[0]
    original_unet.TIME_EMBED_DIM = channels[0] * 4


def _narrow_sdxl_unet(sdxl_original_unet):
    channels = int(os.environ["KOHYA_VAL_SDXL_CHANNELS"])
    sdxl_original_unet.MODEL_CHANNELS = channels
    sdxl_original_unet.TIME_EMBED_DIM = channels * 4


if OUT:
    import wrapt
    wrapt.register_post_import_hook(_patch, "accelerate")
    if os.environ.get("KOHYA_VAL_UNET_CHANNELS"):
        wrapt.register_post_import_hook(_narrow_unet, "library.original_unet")
    if os.environ.get("KOHYA_VAL_SDXL_CHANNELS"):
        wrapt.register_post_import_hook(_narrow_sdxl_unet, "library.sdxl_original_unet")
    atexit.register(_write)
