"""Configuration: the typed schema and its loading (``schema``, ``fields``), DeepSpeed JSON and
Accelerate resolution, parameter groups, and the family registry that ``model.type`` names."""
