"""mmpipe: pipeline-parallel training of image+text models on DeepSpeed."""
from mmpipe._version import __version__  # noqa: E402

from mmpipe.config import load_config  # noqa: E402
from mmpipe.errors import ConfigError, DataError, MmpipeError  # noqa: E402


def build_model(config, seed=None):
    """The plain (single-process) model of a run config's family (``model.type``): an ``nn.Module``
    whose ``forward(*inputs, *labels)`` is the scalar loss (CLIP: ``encode_image``, ``encode_text``).
    Fields a config leaves to the tokenizer (e.g. ``model.text.vocab_size``) must be set.
    ``config`` may also be a directory written by ``mmpipe export --format mmpipe``: the model comes
    back with its trained weights."""
    from mmpipe.export import build_exported, is_export
    if is_export(config):
        return build_exported(config, seed)
    from mmpipe.families import build_family
    return build_family(config, seed).plain_model()


def load_weights(path, step=None):
    """The plain model's state dict from a run directory or checkpoint of any layout (no engine), or
    from an ``mmpipe export --format mmpipe`` directory."""
    from mmpipe.export import is_export, load_export_weights
    if is_export(path):
        return load_export_weights(path)
    from mmpipe.checkpoint import load_weights as _load
    return _load(path, step)


__all__ = ["load_config", "build_model", "load_weights", "ConfigError", "DataError", "MmpipeError", "__version__"]
