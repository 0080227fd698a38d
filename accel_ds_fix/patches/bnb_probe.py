"""accelerate's map_pytorch_optim_to_deepspeed (optimizer offload) imports bitsandbytes, when it is installed, only to
ask whether the optimizer is one of its classes: 1.5 s of every launch (its import compiles kernels with
torch.compile). An optimizer of bitsandbytes cannot exist before bitsandbytes is imported, so inside
accelerate.utils.deepspeed it counts as available once imported, and the question is answered without the import.
"""

import sys


def only_if_imported(wrapped, instance, args, kwargs):
    """accelerate.utils.deepspeed.is_bnb_available"""
    return "bitsandbytes" in sys.modules and wrapped(*args, **kwargs)
