"""Running real nodes locally for tests, the demo, chaos and benchmarks: the node launcher, the WAN
link emulator and the chaos harness. Not used by a production daemon."""
