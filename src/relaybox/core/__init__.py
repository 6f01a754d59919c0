"""The I/O-free core: messages, identifiers, payload encoding, lifecycle, partitions."""
