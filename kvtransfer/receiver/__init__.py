"""Decode's side: :class:`~.receiver.KVReceiver` (registration, quarantine, completion), the
unsigned refusal hints it may act on (:mod:`.hints`), and the staging slots it lends to rooms
and scatters from (:mod:`.staging`)."""
