"""The optimizer's floor: what an engine does with the script's optimizer, below the engines.

* checks: what an engine accepts as its optimizer (a torch optimizer or a factory of one);
* param_groups: the script's optimizer handed to an engine (its groups moved onto the tensors
  the engine updates, its step run through PyTorch's step hooks);
* param_views: one view per parameter of the slice of a flat buffer a rank updates, so the
  optimizer works parameter by parameter while the collectives move whole buckets;
* whole_matrix: Muon and Adafactor, whose update needs a whole matrix, given whole to one rank;
* sharded_optimizer: ZeRO-1's optimizer half on its own (zl.ShardedOptimizer);
* combined_optimizer: two optimizers stepped as one (zl.CombinedOptimizer: Muon + AdamW).

Nothing here imports zerolab.engines: the engines stand on this floor.
"""
