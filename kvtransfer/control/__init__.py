"""The control plane both sides share: the thread that owns every ZMQ socket and room
(:mod:`.loop`), the rooms' monotonic state machine and table (:mod:`.state`), and the transfer
statistics (:mod:`.stats`)."""
