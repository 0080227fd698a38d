"""Work that one process does for all (a checkpoint's conversion): the main process does it, every process gets its
outcome, and an error there is raised on every process, not a hang of the others in their next collective."""

from ..errors import CheckpointError


def on_main_for_all(accelerator, work, failure):
    """``work()`` on the main process; its result on every process. An exception becomes ``failure(exc)`` (a
    CheckpointError is kept as it is) and is raised on every process."""
    outcome = None
    if accelerator.is_main_process:
        try:
            outcome = ("done", work())
        except Exception as exc:  # noqa: BLE001 - handed to every process below
            outcome = ("error", exc if isinstance(exc, CheckpointError) else failure(exc))
    if accelerator.num_processes > 1:
        import torch.distributed

        box = [outcome]
        torch.distributed.broadcast_object_list(box, src=0)
        outcome = box[0]
    kind, value = outcome
    if kind == "error":
        raise value
    return value
