"""Model architectures. Importing this package registers every architecture in `MODELS`."""
from kvrelay.engine.models import llama  # noqa: F401  (registers the Llama family)
from kvrelay.engine.models import qwen3  # noqa: F401
from kvrelay.engine.models.base import MODELS, ArchConfig, CausalLM, ModelLoadError, model_types

__all__ = ["MODELS", "ArchConfig", "CausalLM", "ModelLoadError", "model_types"]
