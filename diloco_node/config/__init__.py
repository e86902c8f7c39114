"""Configuration: a node's own settings (`settings`) and the run manifest every site agrees on (`manifest`)."""
