"""Model families, found by the `architectures` entry of a checkpoint's config."""

from vlmserve.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
