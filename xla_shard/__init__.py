"""FSDP training on Cloud TPUs (torch_xla) with a CUDA FSDP2 fallback, from one config."""

__version__ = "0.1.0"
