"""The ground floor of storage, beside `clock.py`: durable writes (`durable.py`), the failpoints
that fault them (`failpoints.py`) and the checksummed record framing (`records.py`). Every layer
that keeps files uses them (learn's data cache, ops' checkpoints and history, the daemon's
coordination store); they import nothing of the project above them (tests/test_layout.py)."""
