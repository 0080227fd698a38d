"""A DeepSpeed config file that accelerate cannot find.

accelerate reads the ``deepspeed_config_file`` of a YAML config relative to the folder it is launched from,
so a YAML that names its JSON beside it only works from one folder, and from any other fails with a chain of
JSON and base64 decoding errors that never says the path was relative. In the `accelerate launch` process a
relative path that is not there is looked up beside the YAML that names it; a config file that still cannot
be found stops with one clear error, in the launcher or, without the fix there, in the training process.
"""

import base64
import json
import os

from ..errors import ConfigError
from . import old_accelerate


def _inline_json(value):
    # accelerate (HfDeepSpeedConfig) also takes the whole config as base64-encoded JSON in place of a path.
    try:
        return isinstance(json.loads(base64.urlsafe_b64decode(value).decode("utf-8")), dict)
    except (ValueError, UnicodeDecodeError, TypeError):
        return False


def _missing(path):
    return isinstance(path, str) and path != "none" and not os.path.isfile(os.path.expanduser(path)) and not _inline_json(path)


def _advice():
    return (
        "Give an absolute path in the accelerate config, or a path relative to the YAML file itself (found "
        "when ACCEL_DS_FIX=1 is set for the `accelerate launch` command; `python -m accelerate.commands.launch` "
        "runs the launcher as __main__, where the fix cannot reach it); `python -m accel_ds_fix plan --write DIR` "
        "writes a YAML + JSON pair with absolute paths."
    )


def resolve_config_file_paths(wrapped, instance, args, kwargs):
    """accelerate.commands.launch._validate_launch_command: a relative deepspeed_config_file that is not in the
    working directory is taken from beside the YAML config, where it was written."""
    result = wrapped(*args, **kwargs)
    launch_args = result[0] if isinstance(result, tuple) else result
    path = getattr(launch_args, "deepspeed_config_file", None)
    if not _missing(path):
        return result
    if os.path.isabs(os.path.expanduser(path)):
        raise ConfigError(f"accel_ds_fix: the DeepSpeed config file {path} does not exist. {_advice()}")
    from accelerate.commands.config import default_config_file

    config_file = getattr(launch_args, "config_file", None) or default_config_file
    beside = os.path.join(os.path.dirname(os.path.abspath(os.path.expanduser(config_file))), path)
    if not os.path.isfile(beside):
        raise ConfigError(
            f"accel_ds_fix: the DeepSpeed config file {path!r} named by {config_file} is neither in the working "
            f"directory ({os.getcwd()}) nor beside that YAML ({beside}). {_advice()}"
        )
    launch_args.deepspeed_config_file = beside
    return result


def check_config_file(wrapped, instance, args, kwargs):
    """DeepSpeedPlugin.__post_init__: say which file is missing, and from where it was looked for."""
    config = instance.hf_ds_config
    if config is None:
        config = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if _missing(config):
        raise ConfigError(
            f"accel_ds_fix: the DeepSpeed config file {config!r} does not exist: accelerate looked for "
            f"{os.path.abspath(os.path.expanduser(config))}, relative to the working directory {os.getcwd()}. "
            + _advice()
        )
    old_accelerate.fill_accumulation_steps(instance)
    return wrapped(*args, **kwargs)
