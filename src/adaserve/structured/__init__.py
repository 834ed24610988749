"""Structured outputs (JSON schema, regex, choice, grammar) and tool calls.

Torch-free: the request's constraint (``params``), grammar compilation with a
content-keyed cache (``compiler``), the per-request grammar state that gives every
node of a token tree its own mask (``matcher``), and the tool-call parsers (``tools``).
The tensor side (masks applied to logits rows) is ``adaserve.spec_decode.grammar``.
"""

from adaserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
