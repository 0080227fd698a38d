"""accelerate's map_pytorch_optim_to_deepspeed (optimizer offload) imports bitsandbytes, where it is installed, only
to ask whether the optimizer is one of its classes: 1.5 s of a launch (its import compiles kernels with
torch.compile). An optimizer of bitsandbytes cannot exist before bitsandbytes is imported, so inside
accelerate.utils.deepspeed it counts as available once imported, and the question is answered without the import.
(DeepSpeed asks the same of its Muon optimizer in several places; that import stays.)
"""

import sys


def only_if_imported(wrapped, instance, args, kwargs):
    """accelerate.utils.deepspeed.is_bnb_available"""
    return "bitsandbytes" in sys.modules and wrapped(*args, **kwargs)
