"""Checkpoints: Hugging Face import, (pp, tp) layout math, safetensors writer and reader.

Layout on disk (DESIGN.md §4): ``pp{p}-tp{t}.safetensors`` per (pp, tp) coordinate plus
``manifest.json`` with the plan hash, every tensor's pieces and a sha256 per file.
"""
from parallelizer.checkpoint.hf import load_hf_state_dict, match_to_model
from parallelizer.checkpoint.layout import local_piece, shard_slice
from parallelizer.checkpoint.reader import load_full, load_shard, load_tensor, read_manifest
from parallelizer.checkpoint.writer import write_checkpoint

__all__ = ["load_hf_state_dict", "match_to_model", "shard_slice", "local_piece",
           "write_checkpoint", "read_manifest", "load_shard", "load_tensor", "load_full"]
