"""mmpipe: pipeline-parallel training of image+text models on DeepSpeed."""
__version__ = "0.1.0"

from mmpipe.config import load_config  # noqa: E402
from mmpipe.errors import ConfigError, DataError, MmpipeError  # noqa: E402


def build_model(config, seed=None):
    """Plain (single-process) model for a run config: ``encode_image``, ``encode_text``, ``forward`` -> loss."""
    from mmpipe.models import build_model as _build
    return _build(config, seed)


__all__ = ["load_config", "build_model", "ConfigError", "DataError", "MmpipeError", "__version__"]
