"""Structured outputs in the engine core: grammars (llguidance), compiled off the step loop; each step's bitmask of
the constrained requests that sample, sent to the workers (GrammarOutput); matchers advanced by applied tokens."""

from engine_core.structured_output.grammar import GrammarError, check
from engine_core.structured_output.manager import StructuredOutputManager

__all__ = ["GrammarError", "StructuredOutputManager", "check"]
