"""The lowest layer: atomic writes, output-folder locks, the device knob and the config helpers."""
