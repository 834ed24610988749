"""xgrammar as the structured-outputs backend (``--structured-outputs-backend
xgrammar``): grammars compiled ahead into a pushdown automaton with an adaptive token
mask cache; EBNF (GBNF) grammars, JSON schema, regex. Lark grammars are llguidance's
and are refused here with a message that says so."""

from __future__ import annotations

import json

from adaserve.errors import InvalidRequestError
from adaserve.structured.params import StructuredOutputsParams

# JSON's optional whitespace: at most this many characters in a row (the bound the
# llguidance backend's default pattern sets too)
MAX_WHITESPACE = 17


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        import transformers
        import xgrammar as xgr
        from tokenizers import Tokenizer

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._tok = Tokenizer.from_str(tokenizer_json)
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=self._tok)
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=sorted(eos_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: StructuredOutputsParams):
        from adaserve.structured.compiler import _bad, _no_extra_props

        c = self.compiler
        k = spec.kind
        try:
            if k == "json":
                if spec.whitespace_pattern is not None:
                    raise _bad(spec, "whitespace_pattern needs the llguidance backend")
                schema = spec.schema()
                if spec.disable_additional_properties:
                    schema = _no_extra_props(schema)
                return c.compile_json_schema(
                    json.dumps(schema),
                    any_whitespace=not spec.disable_any_whitespace,
                    max_whitespace_cnt=None if spec.disable_any_whitespace else MAX_WHITESPACE,
                    strict_mode=False,
                )
            if k == "json_object":
                return c.compile_json_schema(
                    '{"type": "object"}',
                    any_whitespace=not spec.disable_any_whitespace,
                    max_whitespace_cnt=None if spec.disable_any_whitespace else MAX_WHITESPACE,
                    strict_mode=False,
                )
            if k == "regex":
                assert spec.regex is not None  # its kind
                return c.compile_regex(spec.regex)
            if k == "choice":
                assert spec.choice is not None  # its kind
                alts = " | ".join(json.dumps(x, ensure_ascii=False) for x in spec.choice)
                return c.compile_grammar(f"root ::= {alts}")
            assert spec.grammar is not None  # the one kind left
            if "::=" not in spec.grammar:
                raise _bad(spec, "xgrammar takes EBNF (GBNF) grammars; Lark needs llguidance")
            return c.compile_grammar(spec.grammar)
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise _bad(spec, str(e)) from None

    def new_matcher(self, compiled) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr, compiled, self.vocab_size, self._tok)


class XGrammarMatcher:
    def __init__(self, xgr, compiled, vocab_size: int, tok):
        import torch

        self._torch = torch
        self.tok = tok
        self.m = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self.vocab_size = vocab_size

    def consume(self, token: int) -> bool:
        return self.m.accept_token(int(token))

    def try_consume(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            if self.m.is_terminated() or not self.m.accept_token(int(t)):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    def fill_mask(self, row) -> None:
        t = self._torch.from_numpy(row.reshape(1, -1))  # shares row's memory
        self.m.fill_next_token_bitmask(t, 0)

    def forced(self) -> list[int]:
        """The forced continuation in the model tokenizer's own encoding (xgrammar's
        greedy longest-token split is often not what the model writes: fewer of those
        are accepted), less its last token, which the text after it may merge into."""
        s = self.m.find_jump_forward_string()
        if not s:
            return []
        ids = self.tok.encode(s, add_special_tokens=False).ids
        return ids[:-1] if len(ids) > 1 else ids

    def is_terminated(self) -> bool:
        return self.m.is_terminated()
