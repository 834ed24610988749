"""The engine's structured-outputs side: the backend and its cache, made on first use
(no grammar library is imported until a request asks for a constraint)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from adaserve.errors import InvalidRequestError
from adaserve.structured.compiler import BACKENDS, Compiled, GrammarCompiler, make_backend
from adaserve.structured.matcher import GrammarState
from adaserve.structured.params import StructuredOutputsParams


class StructuredOutputs:
    """Compiles constraints for one model and gives each request its ``GrammarState``.

    tokenizer_json: a callable returning the model's ``tokenizer.json`` text (None: the
                    model has no tokenizer, and constraints are refused)
    """

    def __init__(
        self,
        backend: str,
        tokenizer_json: Callable[[], str] | None,
        vocab_size: int,
        eos_ids: Iterable[int],
    ):
        if backend not in BACKENDS:
            raise ValueError(f"structured outputs backend must be one of {', '.join(BACKENDS)}")
        self.backend_name = "llguidance" if backend == "auto" else backend
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        # totals for the metrics (the engine thread adds to them)
        self.mask_s = 0.0
        self.masks = 0
        self.forced_tokens = 0  # proposed from the grammar without a draft step
        self.forced_accepted = 0

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer_json is None:
                    raise InvalidRequestError(
                        "structured outputs need the model's tokenizer", "structured_outputs"
                    )
                self._compiler = GrammarCompiler(
                    make_backend(
                        self.backend_name, self._tokenizer_json(), self.vocab_size, self.eos_ids
                    )
                )
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Compiled:
        return self.compiler.compile(spec)

    def state_for(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh grammar state at the start of ``spec``'s grammar (compiled now if
        nothing compiled it before)."""
        return GrammarState(
            self.compile(spec).new_matcher(), self.vocab_size, self.eos_ids, stats=self
        )

    def mask_ms_per_node(self, min_masks: int = 200) -> float | None:
        """The mean host time of one node's mask so far (None below ``min_masks``)."""
        return 1000 * self.mask_s / self.masks if self.masks >= min_masks else None

    def summary(self) -> dict:
        """Totals since start: compiles and their time, masks and theirs, forced
        tokens (``/v1/slo/report``, the dashboard)."""
        c = self._compiler
        n = c.compiled if c is not None else 0
        return {
            "backend": self.backend_name,
            "grammars_compiled": n,
            "compile_ms_mean": 1000 * c.compile_s_total / n if c is not None and n else None,
            "compile_ms_max": 1000 * c.compile_s_max if c is not None and n else None,
            "cache_hits": c.hits if c is not None else 0,
            "masks": self.masks,
            "mask_us_per_node": 1e6 * self.mask_s / self.masks if self.masks else None,
            "mask_s": self.mask_s,
            "forced_tokens": self.forced_tokens,
            "forced_accepted": self.forced_accepted,
        }

    def drain_compile_times(self) -> list[float]:
        c = self._compiler
        if c is None:
            return []
        with c._lock:
            out, c.compile_times = c.compile_times, []
        return out
