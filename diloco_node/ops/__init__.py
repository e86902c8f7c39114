"""What operators see and keep: /status and /metrics documents, systemd, checkpoints, history files."""
