"""Speculative decoding: proposers (n-gram lookup, a draft model, the model's MTP head) suggest
the tokens that follow a sequence; the next step verifies them in one target forward pass
(verify.py), keeping the longest run the target itself would have produced."""
