"""Prompt datasets read from files: the geometry3k-style parquet layout for VLMs."""

from mmrl.data.parquet import (
    ParquetSchemaError,
    UnsafeMediaPathError,
    VisionPromptDataset,
    load_vision_parquet,
    write_vision_parquet,
)

__all__ = [
    "ParquetSchemaError",
    "UnsafeMediaPathError",
    "VisionPromptDataset",
    "load_vision_parquet",
    "write_vision_parquet",
]
