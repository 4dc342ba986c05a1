"""Drafters behind one interface (`base.Drafter`): n-gram lookup, a separate draft
model, and the target's truncated self-draft."""
from .base import Drafter, DraftSeq, Proposal
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["Drafter", "DraftSeq", "Proposal", "ModelDrafter", "NgramDrafter"]
