"""ZeRO seen by a compiler: the training step as an FX graph, and ZeRO as passes over it."""
