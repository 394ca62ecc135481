"""Prefill's side: :class:`~.sender.KVSender` (rooms, groups, completion), the handling of
decode's registrations (:mod:`.inbox`, checks in :mod:`.registration`), tensor-parallel pieces
(:mod:`.pieces`) and the staged path for fragmented page tables (:mod:`.staging`)."""
