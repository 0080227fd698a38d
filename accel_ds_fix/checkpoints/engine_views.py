"""The merged modules of several engines (one per optimizer of a GAN-style prepare()) seen as one by the manifest
and the frozen-parameter bookkeeping of save_state / load_state. Model names are unique across the engines, so
every parameter name (``models.<name>.<param>``) is too. With one engine its own merged module is used."""


class AllEngines:
    def __init__(self, engines, tags):
        self.modules = [engine.module for engine in engines]
        self.models = {name: model for module in self.modules for name, model in module.models.items()}
        # which DeepSpeed checkpoint (accelerate's tag) holds which models
        self.engines = [{"checkpoint": tag, "models": list(module.models)} for tag, module in zip(tags, self.modules)]

    def named_parameters(self):
        for module in self.modules:
            yield from module.named_parameters()

    def parameters(self):
        for _, param in self.named_parameters():
            yield param


def merged_view(engines, tag_of):
    """What the manifest describes: the one engine's merged module, or all engines' together."""
    if len(engines) == 1:
        return engines[0].module
    return AllEngines(engines, [tag_of(engine) for engine in engines])
