"""The demo pipeline: stages cached by resolved config, and the demo wiring them."""
