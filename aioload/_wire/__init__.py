"""What crosses between the parent and its workers: messages, the framed channel, packed
replies and the shared-memory slabs batches travel in."""
