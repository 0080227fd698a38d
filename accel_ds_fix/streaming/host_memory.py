"""Pinned host memory for the streamed weights. torch's caching host allocator rounds every pinned request up to a
power of two (a 75.5 MB Flux weight would hold 128 MB, 24 GB of weights about 36); chunks of exactly a power of two
are carved into the weights instead, so only each chunk's tail is lost. Without a GPU, plain host memory."""

import torch

CHUNK = 512 * 1024**2


class HostMemory:
    def __init__(self, pinned):
        self.pinned = pinned
        self.chunks = []
        self._free = 0  # bytes left at the end of the last chunk
        self.nbytes = 0  # bytes held, chunk tails included

    def like(self, tensor, dtype):
        """An uninitialised host tensor of ``tensor``'s shape in ``dtype``."""
        if not self.pinned:
            out = torch.empty(tensor.shape, dtype=dtype)
            self.nbytes += out.numel() * out.element_size()
            return out
        need = tensor.numel() * torch.empty((), dtype=dtype).element_size()
        align = 512
        need_aligned = -(-need // align) * align
        if need_aligned > self._free:
            size = max(CHUNK, 1 << (need_aligned - 1).bit_length())
            self.chunks.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
            self._free = size
            self.nbytes += size
        chunk = self.chunks[-1]
        start = chunk.numel() - self._free
        self._free -= need_aligned
        return chunk[start:start + need].view(dtype).view(tensor.shape)
