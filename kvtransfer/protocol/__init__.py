"""What crosses the wire: the typed control messages (:mod:`.messages`), the deployment
identity both sides compare at first contact (:mod:`.identity`), and the KV checksums a
Complete may carry (:mod:`.checksum`)."""
