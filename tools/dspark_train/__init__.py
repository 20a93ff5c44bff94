"""Training DSpark draft layers for a V4.1 checkpoint whose main model stays frozen (a tool: it
imports torch; the runtime and the tests never import it). See tools/train_dspark.py."""
