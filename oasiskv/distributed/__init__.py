"""Tensor parallelism (--tensor-parallel-size N) on torch.distributed: gloo on CPUs, NCCL on GPUs.

  group.py    this process's rank in the group, and the few collectives the engine needs
  launch.py   the engine's process 0 spawns ranks 1..N-1, each an engine without a scheduler
              that runs the plans rank 0 broadcasts; shutdown
  layers.py   row-parallel linear (all-reduced), vocab-parallel embedding and LM head (gathered)
  shard.py    which heads, MLP columns and vocabulary rows a rank keeps; sharding a loaded model
  scores.py   one block selection per (request, layer) across ranks: per-rank scores combined
"""
