"""wire: the sans-IO wire format of diloco-node.

Bytes in, messages out; no sockets, no clocks. Tensor codecs, frames, authentication and
limits live here so that every other part (and another implementation) can share them.
"""
