"""Checkpoint I/O: Hugging Face safetensors reading, one tp rank's slice of a tensor, the
sharded safetensors writer and reader, the manifest schema, the format's names
(``format.py``) and atomic publishing (``publish.py``).

Layout on disk (docs/checkpoints.md, format in format.py): ``pp{p}-tp{t}.safetensors`` per (pp, tp)
coordinate plus ``manifest.json`` with every tensor's placement, layout and pieces, the
pipeline structure and a sha256 per file. Conversions between layouts are in
:mod:`parallelizer.convert`.
"""
from parallelizer.checkpoint.hf import load_hf_state_dict, match_to_model
from parallelizer.checkpoint.slicing import local_piece, shard_slice
from parallelizer.checkpoint.reader import load_full, load_shard, load_tensor, read_manifest
from parallelizer.checkpoint.writer import write_checkpoint

__all__ = ["load_hf_state_dict", "match_to_model", "shard_slice", "local_piece",
           "write_checkpoint", "read_manifest", "load_shard", "load_tensor", "load_full"]
