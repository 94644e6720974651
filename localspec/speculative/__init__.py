"""Speculative decoding's parts, each testable alone: sampling and acceptance (pure numpy), the
proposers (where drafts come from), the draft-length policies and the pass-cost models they price
drafts with."""
