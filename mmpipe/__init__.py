"""mmpipe: pipeline-parallel training of image+text models on DeepSpeed."""
from mmpipe._version import __version__  # noqa: E402

from mmpipe.config import load_config  # noqa: E402
from mmpipe.errors import ConfigError, DataError, MmpipeError  # noqa: E402


def build_model(config, seed=None):
    """Plain (single-process) model for a run config: ``encode_image``, ``encode_text``, ``forward`` -> loss."""
    from mmpipe.models import build_model as _build
    return _build(config, seed)


def load_weights(path, step=None):
    """The plain model's state dict from a run directory or checkpoint of any layout (no engine)."""
    from mmpipe.checkpoint import load_weights as _load
    return _load(path, step)


__all__ = ["load_config", "build_model", "load_weights", "ConfigError", "DataError", "MmpipeError", "__version__"]
