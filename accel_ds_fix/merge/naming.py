"""Stable names for the models merged out of one ``prepare()`` call.

The names become the ``models.<name>.`` prefix of every key in the merged DeepSpeed checkpoint, so they must
not depend on anything that changes between runs (ids, memory addresses): only on the class and argument order.
"""

import re


def _slug(text):
    # ModuleDict keys cannot contain "." and should be valid attribute names.
    slug = re.sub(r"\W+", "_", text).strip("_").lower()
    return slug or "model"


def model_names(models):
    """One name per model: the snake-cased class name, with ``_1``, ``_2`` … on repeats, in argument order."""
    names = []
    seen = {}
    for model in models:
        base = _slug(model.__class__.__name__)  # __class__: a model that was prepared already is named as itself
        count = seen.get(base, 0)
        seen[base] = count + 1
        names.append(base if count == 0 else f"{base}_{count}")
    return names
