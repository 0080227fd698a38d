"""One process's streamer: each streamed block's weights live in host memory; on the card each weight is a tensor
whose storage is empty until the block is loaded (its storage grown and filled from the host copy) and emptied
again when the block is released. The tensors themselves never change, so what autograd saved of them in the
forward finds the weights again once the block is loaded for the backward (and an unloaded use fails loudly,
never silently).

Copies run on a side stream: while block k computes, the next block of the order the last step used is copied;
the card waits for a copy only where it is needed. The first step has no order yet and loads each block when it is
needed, recording the order (forward, gradient checkpointing's recomputation, backward) for the steps after it."""

import torch


class Streamer:
    def __init__(self, device, prefetch=1):
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.prefetch_depth = prefetch
        self.blocks = []  # every streamed block (blocks.Block), each with its host copies in .hosts
        self.order = []  # the blocks in the order the last whole step loaded them
        self._recording = []  # this step's order so far
        self._cursor = 0  # where in self.order the last load was
        self._backward_seen = False  # a load in a backward since the last step's order was taken
        self._last = None  # (block, in a backward) of the last need
        self.loaded = {}  # block -> the event its copy recorded (None: the card has it)
        self.forward_index = {}  # block -> its place among this step's forward loads
        self.prefetched = []  # loaded ahead, not yet used, oldest first
        # what the tests and the bench's probe read (bench/diffusers/script_probe.py)
        self.host_bytes = 0  # pinned host memory of the copies, chunk tails included
        self.loads = 0  # copies made
        self.waited = 0  # loads the card had to wait for at once (not prefetched)
        self.bytes_copied = 0

    # --- the weights' storage on the card
    def _grow_and_copy(self, block):
        main = torch.cuda.current_stream(self.device) if self.cuda else None
        for p, host in zip(block.params, block.hosts):
            p.untyped_storage().resize_(host.numel() * host.element_size())  # allocated on the main stream
        if not self.cuda:
            for p, host in zip(block.params, block.hosts):
                p.data.copy_(host)
            return None
        # the side stream copies only after the main stream's earlier work (the memory may be a freed block's)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            for p, host in zip(block.params, block.hosts):
                p.data.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.side)
        return event

    def _load(self, block):
        self.loaded[block] = self._grow_and_copy(block)
        self.loads += 1
        self.bytes_copied += block.nbytes

    def release(self, block):
        if block not in self.loaded:
            return
        event = self.loaded.pop(block)
        if event is not None:  # a copy still running must end before its memory can be reused
            torch.cuda.current_stream(self.device).wait_event(event)
        if block in self.prefetched:
            self.prefetched.remove(block)
        for p in block.params:
            p.untyped_storage().resize_(0)

    # --- what the hooks call
    def need(self, block, in_backward):
        """``block`` is about to compute: have it on the card, and start the next copies."""
        if block not in self.loaded:
            self._load(block)
            self.waited += 1
        if block in self.prefetched:
            self.prefetched.remove(block)
        event = self.loaded[block]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            self.loaded[block] = None
        self._follow(block, in_backward)
        if in_backward:
            self._backward_seen = True
            self._release_later_than(block)
        else:
            self.forward_index.setdefault(block, len(self.forward_index))
        self._prefetch_next()

    def _release_later_than(self, block):
        # The backward reaches a block once every block after it in the forward has had its backward: their
        # weights are done with (a prefetched block is the next one's, kept).
        here = self.forward_index.get(block)
        if here is None:
            return
        for other in list(self.loaded):
            if other is not block and other not in self.prefetched and self.forward_index.get(other, -1) > here:
                self.release(other)

    def next_is(self, block):
        """Whether ``block`` is the next block the last step's order uses (then keep it on the card)."""
        return bool(self.order) and self.order[self._cursor % len(self.order)] is block

    def _follow(self, block, in_backward):
        if not in_backward and self._backward_seen:  # a new step: the last one's order is the one to follow
            self.order, self._recording, self._cursor = self._recording, [], 0
            self._backward_seen = False
            self.forward_index = {}
        if self._last == (block, in_backward):
            return  # needed again in a row (its recomputation after its backward hook): the same place
        self._last = (block, in_backward)
        self._recording.append(block)
        if not self.order:
            return
        n = len(self.order)
        for step in range(n):
            if self.order[(self._cursor + step) % n] is block:
                self._cursor = (self._cursor + step + 1) % n
                return

    def _prefetch_next(self):
        if not self.order:
            return
        n = len(self.order)
        for step in range(min(self.prefetch_depth, n)):
            block = self.order[(self._cursor + step) % n]
            if block in self.loaded:
                continue
            while len(self.prefetched) >= self.prefetch_depth:  # the order changed: drop the oldest guess
                self.release(self.prefetched[0])
            self._load(block)
            self.prefetched.append(block)

    def release_all(self, keep_prefetched=True):
        """The end of a backward: every loaded block goes but the next ones the order uses."""
        for block in list(self.loaded):
            if not (keep_prefetched and (block in self.prefetched or self.next_is(block))):
                self.release(block)

    def forget(self, block):
        """``block`` no longer streams (its weights left for good)."""
        self.release(block)
        self.blocks = [b for b in self.blocks if b is not block]
        self.order = [b for b in self.order if b is not block]
        self._recording = [b for b in self._recording if b is not block]
        self._cursor = 0
        self.forward_index.pop(block, None)
