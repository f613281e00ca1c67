"""Speculative decoding: EAGLE-3, draft-model and n-gram proposals, verified in one target pass, with
the rejection-sampling rule that leaves the output distribution exactly the target's.

Modules, one job each: `ngram` (host-side prompt lookup), `policy` (per-request state and how many
tokens to propose), `draft` (the draft's jitted proposal loop), `eagle3_draft` (an EAGLE-3 head's
proposals from the target's stored states, and its catch-up after the target), `rejection` (on-device acceptance),
`step` (the jitted propose + verify + accept step), `decoder` (host orchestration for the engine: what to
propose, packing, acceptance). The runner lowers, compiles and calls the steps (`jaxserve.runner.speculative`).
"""

from jaxserve.spec_decode.decoder import SpeculativeDecoder, load_draft
from jaxserve.spec_decode.ngram import propose_ngram
from jaxserve.spec_decode.policy import SpecPolicy, SpecState

__all__ = ["SpeculativeDecoder", "load_draft", "propose_ngram", "SpecPolicy", "SpecState"]
