"""Pages to bytes: every address formula of a pool entry and of its tensor-parallel shards
(:mod:`.layout`), and the registered slots that gather or scatter fragmented pages
(:mod:`.staging`)."""
