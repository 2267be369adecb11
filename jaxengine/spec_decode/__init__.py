"""Speculative decoding: proposers (draft tokens, host side) and the verification of a step's
samples against them."""
