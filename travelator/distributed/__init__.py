"""Tensor parallelism over torch.distributed (see README, "Tensor parallelism").

- ``comm``: the group of one engine's ranks: a data group (gloo on CPU, NCCL on CUDA) for
  the collectives inside the model, and a gloo control group for the driver's step messages.
- ``executor``: the driver side (rank 0, inside the engine): launches or joins the workers,
  sends each step's small description, samples from the gathered logits.
- ``worker``: the loop of the other ranks: apply the step description, run their shard.
"""
