"""The ground floor of hf_distill: names and rules every layer shares (batch keys, counted positions, the generation
checks, the optimizer-step watch). Its modules import nothing from the rest of the package, so any layer may import
them without making a circle (tests/test_layers.py checks it)."""
