"""Hugging Face checkpoints in and out: the families meshpar's transformer computes (`families`: each one's
config.json and tensor table) and the lazy, sharded reading and the writing of their safetensors
(`checkpoint`)."""

from models.hf.checkpoint import INDEX_FILE, SINGLE_FILE, export, import_params, load_config, read_config_json
from models.hf.families import FAMILIES, config_from_hf, config_to_hf, family_of

__all__ = ["FAMILIES", "INDEX_FILE", "SINGLE_FILE", "config_from_hf", "config_to_hf", "export", "family_of",
           "import_params", "load_config", "read_config_json"]
