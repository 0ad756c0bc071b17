"""mmpipe: pipeline-parallel training of image+text models on DeepSpeed."""
from mmpipe._version import __version__  # noqa: E402
from mmpipe.config.schema import load_config  # noqa: E402
from mmpipe.errors import ConfigError, DataError, MmpipeError  # noqa: E402
from mmpipe.parallel.plain import plain_model


def build_model(config, seed=None):
    """The plain (single-process) model of a run config's family (``model.type``): an ``nn.Module``
    whose ``forward(*inputs, *labels)`` is the scalar loss (CLIP: ``encode_image``, ``encode_text``).
    Fields a config leaves to the tokenizer (e.g. ``model.text.vocab_size``) must be set.
    ``config`` may also be a path: a YAML run config, a directory written by ``mmpipe export
    --format mmpipe``, or a run directory (its resolved config.yaml; with a checkpoint, the model
    comes back with its latest weights, as from an export)."""
    import os

    from mmpipe.train.export import build_exported, is_export
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if is_export(path):
            return build_exported(path, seed)
        run_config = os.path.join(path, "config.yaml")
        if os.path.isdir(path) and os.path.isfile(run_config):
            model = build_model(load_config(run_config), seed)
            if os.path.isfile(os.path.join(path, "checkpoints", "latest")):
                model.load_state_dict(load_weights(path))
            return model
        if os.path.isfile(path) and path.lower().endswith((".yaml", ".yml")):
            return build_model(load_config(path), seed)
        raise ConfigError(f"build_model({path!r}): not a run config (.yaml), a run directory (with config.yaml) or "
                          "an mmpipe export directory")
    from mmpipe.config.resolve import build_family
    return plain_model(build_family(config, seed))


def load_weights(path, step=None):
    """The plain model's state dict from a run directory or checkpoint of any layout (no engine), or
    from an ``mmpipe export --format mmpipe`` directory."""
    from mmpipe.train.export import is_export, load_export_weights
    if is_export(path):
        return load_export_weights(path)
    from mmpipe.train.checkpoint_weights import load_weights as _load
    return _load(path, step)


__all__ = ["load_config", "build_model", "load_weights", "ConfigError", "DataError", "MmpipeError", "__version__"]
