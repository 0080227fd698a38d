"""Parameter shapes of model files, read from the safetensors headers (or, for old .bin files, a memory-mapped
torch.load), so that `plan` can count a 12B model on a laptop without loading a weight."""

import glob
import json
import os
import struct


def numel(shape):
    n = 1
    for dim in shape:
        n *= dim
    return n


def _tensors(path):
    """{tensor name: its entry} of one .safetensors file's header (shape, dtype, data_offsets)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {key: info for key, info in header.items() if key != "__metadata__"}


def file_shapes(path):
    """{tensor name: shape} of one .safetensors file, from its header."""
    return {key: tuple(info["shape"]) for key, info in _tensors(path).items()}


def file_bytes(path):
    """Bytes of the tensors of one .safetensors file, in the dtypes it stores them, from its header."""
    return sum(info["data_offsets"][1] - info["data_offsets"][0] for info in _tensors(path).values())


def folder_bytes(folder):
    """Bytes of a model folder's weights as stored (0 where they are not safetensors files)."""
    return sum(file_bytes(f) for f in glob.glob(os.path.join(folder, "*.safetensors")))


def folder_shapes(folder):
    """{tensor name: shape} of a model folder's weights (sharded files together)."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        return {k: v for f in files for k, v in file_shapes(f).items()}
    files = sorted(glob.glob(os.path.join(folder, "*.bin")))
    if files:
        import torch

        return {k: tuple(t.shape) for f in files for k, t in torch.load(f, mmap=True, weights_only=True).items()}
    raise ValueError(f"no weights (*.safetensors or *.bin) in {folder}")
