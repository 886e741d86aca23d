"""What runs inside the inference engine's process: the step recorder, the record format and the
engine adapters. It imports the standard library and numpy only (see tests/test_layering.py), so
loading it costs the engine as little as possible."""
