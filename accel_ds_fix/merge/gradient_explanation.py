"""After the traceback of a script that dies touching gradients or weights outside forward under ZeRO-2/3,
say why: DeepSpeed owns them there (``param.grad`` is None after ``accelerator.backward``; ZeRO-3 weights are
shape-[0] shards outside forward), and the error the script raises deep inside itself says nothing of that.
Only appends text to what Python prints for an uncaught exception; it never changes or swallows one."""

import linecache
import os
import re
import sys
import traceback

_stage = None
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the whole package

GRAD_NOTE = (
    "accel_ds_fix: the failing code reads a parameter's .grad, which is None here: under accelerate + "
    "DeepSpeed, accelerator.backward() runs DeepSpeed's backward and its optimizer step at once, and ZeRO "
    "stage {stage} keeps the gradients in DeepSpeed's own buffers. To change gradients (keep all embedding rows "
    "but a new token's, say), register a hook on the parameter before accelerator.prepare(): "
    "param.register_hook(lambda grad: grad * mask). Or train without DeepSpeed. README: 'Gradients and weights "
    "outside forward'."
)
SHARD_NOTE = (
    "accel_ds_fix: under DeepSpeed ZeRO stage 3 each weight is a shape-[0] shard outside forward, and the failing "
    "code indexes, writes or loads into one. Read full weights inside deepspeed.zero.GatheredParameters(params); change the "
    "weights that train with deepspeed.utils.safe_set_full_fp32_param(param, value) after optimizer.step() (a "
    "write to the module's weights alone is overwritten from the optimizer's fp32 copy at the next step); every "
    "process must make these calls. README: 'Gradients and weights outside forward'."
)


# How far above the failing line a gradient read into a variable is looked for: diffusers'
# train_custom_diffusion.py reads `grads_text_encoder = ...weight.grad` 7 - 9 lines above its failing write.
GRAD_READ_LINES = 40


def _failing_code(tb):
    """The failing line of the script and the few lines before it (a gradient is often read a line earlier),
    plus, for each name the failing line uses, the nearest line above that assigned it from a ``.grad``."""
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(_OWN)]
    if not frames:
        return ""
    last = frames[-1]
    lines = [linecache.getline(last.filename, n) for n in range(max(1, last.lineno - 5), last.lineno + 1)]
    return "\n".join(lines + _grad_reads(last.filename, last.lineno, last.line or lines[-1]))


def _grad_reads(filename, lineno, failing_line):
    """Lines above ``lineno`` that read a ``.grad`` into a name the failing line uses (``g = p.grad`` ...
    ``g.data[...] = ...``): the read a few lines earlier that made the name None."""
    names = set(re.findall(r"\b([A-Za-z_]\w*)\s*(?:\.|\[)", failing_line))
    found = []
    for n in range(lineno - 1, max(0, lineno - GRAD_READ_LINES), -1):
        line = linecache.getline(filename, n)
        match = re.match(r"\s*([A-Za-z_]\w*)\s*=[^=].*\.grad\b", line)
        if match and match.group(1) in names:
            found.append(line)
    return found


def _explain(exc, tb):
    code, text = _failing_code(tb), str(exc)
    if isinstance(exc, (TypeError, AttributeError)) and "NoneType" in text and ".grad" in code:
        return GRAD_NOTE.format(stage=_stage)
    if _stage == 3 and isinstance(exc, (IndexError, RuntimeError)) and ("size 0" in text or "[0]" in text):
        return SHARD_NOTE
    return None


def watch(stage):
    """Called once a merged engine of ZeRO stage ``stage`` exists; installs the excepthook once."""
    global _stage
    if not isinstance(stage, int) or stage < 2:
        return
    first = _stage is None
    _stage = max(stage, _stage or 0)
    if not first:
        return
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        note = _explain(exc, tb)
        if note:
            sys.stderr.write(note + "\n")

    sys.excepthook = excepthook
