"""When a streamed block is needed and when it is done.

- forward pre-hook: the block is needed (in the forward, or in gradient checkpointing's recomputation inside the
  backward);
- forward hook: outside a backward the block is done, unless the last step's order uses it next (the last block
  of the forward is the backward's first); where the output will have a gradient, a hook on it loads the block
  again before its backward (what autograd saved of the weights is the same tensor, filled again), and the end of
  the backward releases what it loaded. With gradient checkpointing the recomputation finds the block loaded.
- state_dict() gives the host copies; load_state_dict() fills them (a checkpoint holds the whole model, whatever
  streams); a .to() or cast that changes the weights' device or dtype ends the streaming of the blocks inside.
"""

import logging
import weakref

import torch

from .. import notices

_by_module = weakref.WeakKeyDictionary()  # block module -> (streamer, block)
_queued = set()  # graph tasks whose end releases the loaded blocks
_hosts = {}  # id(streamed parameter) -> its host copy
_applying = False  # inside Module._apply's recursion


def _in_backward():
    return torch._C._current_graph_task_id() != -1


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif hasattr(value, "to_tuple"):  # diffusers' and transformers' output classes
        yield from _tensors(value.to_tuple())


def attach(streamer, block):
    names = {id(p): name for name, p in block.module.named_parameters(remove_duplicate=False)}
    block.names = [names[id(p)] for p in block.params]

    def before(module, args):
        streamer.need(block, _in_backward())

    def after(module, args, output):
        if _in_backward():
            return output  # the recomputation of gradient checkpointing: its backward follows at once
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(_backward_hook(streamer, block))
        if not streamer.next_is(block):
            streamer.release(block)
        return output

    block.handles = [
        block.module.register_forward_pre_hook(before),
        block.module.register_forward_hook(after),
        block.module._register_state_dict_hook(_state_dict_hook),
        block.module._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True),
        block.module.register_load_state_dict_post_hook(_load_post_hook),
    ]
    _by_module[block.module] = (streamer, block)
    _hosts.update((id(p), host) for p, host in zip(block.params, block.hosts))


def detach(block):
    for handle in getattr(block, "handles", ()):
        handle.remove()
    _by_module.pop(block.module, None)
    for p in block.params:
        _hosts.pop(id(p), None)


def load_into_host_copies(wrapped, instance, args, kwargs):
    """DeepSpeedEngine.load_module_state_dict: ZeRO-1/2 copy each frozen weight of the checkpoint into the
    parameter itself (frozen_param_fragments), which a streamed weight has empty on the card: for the call its
    parameters are its host copies, loaded to the card afresh when next needed."""
    inside = {id(m) for m in instance.module.modules()}
    swapped = []
    for module, (streamer, block) in list(_by_module.items()):
        if id(module) in inside:
            streamer.release(block)
            for p, host in zip(block.params, block.hosts):
                swapped.append((p, p.data))
                p.data = host
    try:
        return wrapped(*args, **kwargs)
    finally:
        for p, card in swapped:
            p.data = card


def host_copy_in_checkpoint(wrapped, instance, args, kwargs):
    """DeepSpeedEngine._get_param_fragment_func: ZeRO-1/2 checkpoints hold every frozen weight apart
    (frozen_param_fragments); a streamed one is its host copy (on the card it may be empty)."""
    param = args[0] if args else kwargs["param"]
    host = _hosts.get(id(param))
    return host.detach().clone() if host is not None else wrapped(*args, **kwargs)


def _backward_hook(streamer, block):
    def hook(grad):
        streamer.need(block, True)
        task = torch._C._current_graph_task_id()
        if task not in _queued:
            _queued.add(task)

            def at_end():
                _queued.discard(task)
                streamer.release_all(keep_prefetched=True)

            torch.autograd.Variable._execution_engine.queue_callback(at_end)
        return grad

    return hook


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    _, block = _by_module[module]
    for name, host in zip(block.names, block.hosts):
        if prefix + name in state_dict:
            state_dict[prefix + name] = host
    return state_dict


def _load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    streamer, block = _by_module[module]
    streamer.release(block)  # loaded again from the new host copies when next needed
    for name, host, p in zip(block.names, block.hosts, block.params):
        value = state_dict.pop(prefix + name, None)
        if value is None:
            continue
        if tuple(value.shape) != tuple(host.shape):
            error_msgs.append(f"size mismatch for {prefix + name}: copying a param with shape {tuple(value.shape)} "
                              f"from checkpoint, the shape in current model is {tuple(host.shape)}.")
            continue
        with torch.no_grad():
            host.copy_(value)
        block.loaded_keys = getattr(block, "loaded_keys", set()) | {prefix + name}


def _load_post_hook(module, incompatible_keys):
    _, block = _by_module[module]
    loaded = getattr(block, "loaded_keys", set())
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in loaded]
    block.loaded_keys = set()


def _changes(fn, p):
    probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
    return probe.dtype != p.dtype or probe.device != p.device


def end_streaming_on_change(wrapped, instance, args, kwargs):
    """torch.nn.Module._apply (.to(), .cuda(), .float(), ...): a change of the streamed weights' device or dtype
    ends their streaming first; the weights are then the host copies, which the call moves or casts."""
    global _applying
    if not _by_module or _applying:  # _apply recurses into every submodule: the outermost call looks once
        return wrapped(*args, **kwargs)
    _applying = True
    try:
        _end_streaming_inside(instance, args[0] if args else kwargs.get("fn"))
        return wrapped(*args, **kwargs)
    finally:
        _applying = False


def _end_streaming_inside(instance, fn):
    inside = [_by_module[m] for m in instance.modules() if m in _by_module]
    if inside and fn is not None and _changes(fn, inside[0][1].params[0]):
        for streamer, block in inside:
            streamer.release(block)
            streamer.forget(block)
            for p, host in zip(block.params, block.hosts):
                p.data = host
            detach(block)
        notices.say(f"{type(instance).__name__}: a .to() or cast after prepare() changes its streamed weights' device "
                    f"or dtype; {len(inside)} blocks stop streaming and are moved as asked.",
                    level=logging.WARNING, once_key=("stream_end", type(instance).__name__))
