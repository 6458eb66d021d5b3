"""Grammar-constrained decoding (JSON schema, regex, choice, grammar) with llguidance.

``params`` is what a request asks for, ``compiler`` turns it into a grammar off the engine
loop (cached by content), ``manager`` keeps each request's matcher and fills a step's token
bitmask, and ``bitmask.apply_token_bitmask`` is the pure tensor function samplers call.
"""

from neuron_runtime.structured_output.bitmask import apply_grammar_bitmasks, apply_token_bitmask
from neuron_runtime.structured_output.compiler import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
)
from neuron_runtime.structured_output.manager import StructuredOutputManager
from neuron_runtime.structured_output.params import StructuredOutputsParams

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "apply_grammar_bitmasks",
    "apply_token_bitmask",
]
