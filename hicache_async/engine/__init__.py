"""The tiny reference engine the cache is proven on."""
from .model import ModelConfig, SeqChunk, TinyModel

__all__ = ["ModelConfig", "SeqChunk", "TinyModel"]
