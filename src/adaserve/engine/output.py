"""Output processing: commit a step's accepted tokens to each request (stop tokens,
stop strings, length limits), prompt and output log-probabilities, and the
speculation statistics of requests and of the engine."""

from __future__ import annotations

from adaserve.core.counters import Counters
from adaserve.core.scheduler import Scheduler
from adaserve.core.step import Batch, Commit
from adaserve.core.tree import CandidateTree
from adaserve.engine.model_runner import logprob_entries
from adaserve.engine.verification import StepResult
from adaserve.hardware.calibration import Calibrator
from adaserve.spec_decode.request import Request
from adaserve.text.tokenizer import Tokenizer


class OutputProcessor:
    """Appends tokens and says which requests finished (the scheduler ends them)."""

    def __init__(
        self,
        sched: Scheduler,
        tokenizer: Tokenizer | None,
        eos_ids: set[int],
        max_model_len: int,
        flops_per_token: tuple[float, float],
    ):
        self.sched = sched
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.flops_per_token = flops_per_token

    @property
    def counters(self) -> Counters:
        return self.sched.counters

    def commit(
        self,
        batch: Batch,
        trees: dict[int, CandidateTree],
        result: StepResult,
        calibrator: Calibrator,
        now: float,
    ) -> tuple[list[Commit], dict[int, int]]:
        """Append ``result``'s tokens at time ``now``; returns (each request's commit, for
        the scheduler to apply, in batch order; accepted candidates per decoding
        request)."""
        commits: list[Commit] = []
        accepted: dict[int, int] = {}
        for r, n in batch.prefill:
            cached = r.num_cached + n
            self.counters.prompt_tokens += n
            if cached < len(r.tokens):  # a chunk that does not complete the prompt
                commits.append(Commit(r, cached))
                continue
            acc = result.accepted[r.rid]
            reason = self._append(r, acc.tokens, acc.logprobs, now)
            commits.append(Commit(r, cached, first_token=True, finish=reason))
        for r in batch.decode:
            acc = result.accepted[r.rid]
            cached = len(r.tokens) + len(acc.path)
            self._record_spec(r, trees[r.rid], acc.path, calibrator)
            accepted[r.rid] = len(acc.path)
            commits.append(Commit(r, cached, finish=self._append(r, acc.tokens, acc.logprobs, now)))
        return commits, accepted

    def record_prompt_logprobs(self, r: Request, p: int, lsm) -> None:
        """Prompt logprobs from one prefill chunk: row j of lsm [m, V] (the chunk
        starting at position p) scores prompt token p + j + 1."""
        m = lsm.shape[0]
        k = r.params.prompt_logprobs
        assert k is not None  # recorded only for a request that asked for them
        scored = logprob_entries(lsm, r.prompt_ids[p + 1 : p + 1 + m], k)
        if not r.prompt_logprobs:
            r.prompt_logprobs = [None]  # the first token has no context to score it
        del r.prompt_logprobs[p + 1 :]  # a chunk prefilled again after preemption
        r.prompt_logprobs.extend(scored)

    def _record_spec(
        self, r: Request, t: CandidateTree, path: list[int], calibrator: Calibrator
    ) -> None:
        n = len(t.tokens) - 1
        r.stats.steps += 1
        if n == 0:
            return
        c = self.counters
        r.stats.verified_tokens += n
        r.stats.tree_nodes += n
        r.stats.accepted_tokens += len(path)
        c.spec_drafts += 1
        c.spec_draft_tokens += n
        c.spec_accepted_tokens += len(path)
        for depth in range(1, len(path) + 1):
            r.stats.accepted_by_depth[depth] = r.stats.accepted_by_depth.get(depth, 0) + 1
            c.accepted_per_pos[depth - 1] = c.accepted_per_pos.get(depth - 1, 0) + 1
        rejected = n - len(path)
        r.stats.rejected_flops_target += rejected * self.flops_per_token[0]
        r.stats.rejected_flops_draft += max(0, rejected) * self.flops_per_token[1]
        calibrator.observe(t, path)

    def _append(self, r: Request, new: list[int], logprobs: list | None, now: float) -> str | None:
        """Append tokens one by one, stopping at EOS / stop ids / stop strings / limits;
        the logprobs of tokens not appended are dropped. Returns the finish reason when
        one stopped it (the scheduler ends the request)."""
        keep = r.num_output
        if logprobs is not None:
            r.logprobs[keep:] = logprobs
        p = r.params
        reason = None
        for tok in new:
            r.tokens.append(tok)
            r.token_times.append(now)
            self.counters.generation_tokens += 1
            # a constrained output ends where its grammar does
            ended = r.grammar is not None and not r.grammar.commit(tok)
            may_stop = r.num_output > p.min_tokens  # stops only after min_tokens
            if may_stop and (tok in p.stop_token_ids or (tok in self.eos_ids and not p.ignore_eos)):
                reason = "stop"
            elif r.num_output >= p.max_tokens or len(r.tokens) >= self.max_model_len:
                reason = "length"
            elif (
                may_stop
                and p.stop
                and self.tokenizer is not None
                and self._hit_stop_string(r, p.stop, self.tokenizer)
                or ended
            ):
                reason = "stop"
            if reason:
                break
        if logprobs is not None:
            del r.logprobs[r.num_output :]
        return reason

    def _hit_stop_string(self, r: Request, stop: tuple[str, ...], tok: Tokenizer) -> bool:
        """Whether ``r``'s output holds one of ``stop`` (its ``params.stop``), decoded
        with ``tok`` (the tokenizer)."""
        p = r.params
        longest = max(len(s) for s in stop)
        skip = p.skip_special_tokens
        tail = tok.decode(r.output_ids[-(longest + 8) :], skip)
        if not any(s in tail for s in stop):
            return False
        text = tok.decode(r.output_ids, skip)
        at, s = min((text.find(s), s) for s in stop if s in text)
        # the text is cut where the stop string starts, or after it (vLLM's
        # include_stop_str_in_output)
        r.stop_text_cut = at + len(s) if p.include_stop_str_in_output else at
        return True

    def output_text(self, r: Request) -> str | None:
        """The request's output text, cut before a stop string (None without a
        tokenizer)."""
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(r.output_ids, r.params.skip_special_tokens)
        if r.stop_text_cut is not None:
            text = text[: r.stop_text_cut]
        return text
