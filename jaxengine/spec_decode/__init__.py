"""Speculative decoding, all of it: the proposers (prompt lookup on the host, ``ngram``; a draft
model's and an EAGLE-3 or MTP head's device executables, ``drafter`` and ``eagle_drafter``), the
gate that plans how many drafts pay (``gate``) and the verification of a step's samples against
them (``verify``). The model runner proposes after it samples; the scheduler budgets the drafts."""
