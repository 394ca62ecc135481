"""The data plane: the Mooncake engine wrapper and its transfer workers (:mod:`.engine`), the
slot writer of the staged path (:mod:`.writer`), the proof that a peer owns the session it
names (:mod:`.proof`), and fault injection for tests (:mod:`.faults`)."""
