"""Speculative decoding: the acceptance rule, the controller and its cost model, and the proposers
(a smaller tier's model, n-gram prompt lookup). May import sample, worker and below."""
