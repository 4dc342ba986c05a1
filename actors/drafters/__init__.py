"""Drafters behind one interface (`base.Drafter`): n-gram lookup, suffix decoding, a separate
draft model, and the target's truncated self-draft."""
from .base import Drafter, DraftSeq, Proposal
from .model import ModelDrafter
from .ngram import NgramDrafter
from .suffix import SuffixDrafter

__all__ = ["Drafter", "DraftSeq", "Proposal", "ModelDrafter", "NgramDrafter", "SuffixDrafter"]
