"""How a model is parallelised before it trains: FSDP2 or DDP, tensor parallelism, activation
checkpointing, the post-forward meshes."""
