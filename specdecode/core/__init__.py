"""The lowest layer: atomic writes, output locks, device / dtype, config helpers. Imports nothing else of specdecode."""
