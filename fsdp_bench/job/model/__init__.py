"""What a rank trains: the model zoo (Llama-style presets, users' modules) and transformers
models."""
