"""ZeRO-R: the residual states (activations, temporary buffers) and what shares them out.

* mesh: a data-parallel x tensor-parallel grid of ranks;
* tensor_parallel: Megatron's split of a GPT's matrices over a mesh's tensor-parallel group;
* activation_checkpointing: checkpointed activations, and ZeRO-R's partitioned (P_a) and
  offloaded ones.
"""
